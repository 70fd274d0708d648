"""One request's state as the scheduler and the KV cache see it."""

from __future__ import annotations

import enum
import time

import torch

from armserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


class Request:
    """A single sequence being generated.

    The scheduler has no prefill/decode phases: it only compares `num_computed_tokens` with
    `num_tokens` (prompt + generated). A request with `num_computed_tokens < num_prompt_tokens`
    is prefilling (maybe in chunks); once all tokens but the newest are computed it decodes.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "output_token_ids", "all_token_ids", "params",
        "max_tokens", "status", "num_computed_tokens", "num_cached_tokens", "stop_reason",
        "arrival_time", "generator", "block_hashes", "num_preemptions", "prompt_logprobs_done",
        "grammar", "spec", "lora_request", "cache_salt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        lora_request=None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # NOTE: prompt + output in one list, so block hashing and recompute after preemption
        # never need to concatenate.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 = not yet looked up
        self.stop_reason: int | str | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)
        self.block_hashes: list[int] = []  # chained hash of each full block of all_token_ids
        self.num_preemptions = 0
        self.prompt_logprobs_done = 0  # prompt positions whose logprobs were already returned
        # xgrammar GrammarMatcher of a structured-output request (set by the engine), else None.
        # It has accepted exactly output_token_ids.
        self.grammar = None
        # Speculative decoding (engine/spec_decode.py): its SpecState, False where it may not
        # speculate, None until the proposer first sees it.
        self.spec = None
        # The LoRA adapter it runs with (lora.LoRARequest), None: the base model. Its KV differs from
        # the base's for the same tokens, so its prefix-cache hashes start from `cache_salt`.
        self.lora_request = lora_request
        self.cache_salt = None if lora_request is None else ("lora", lora_request.lora_int_id, lora_request.lora_path)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
