"""What an engine needs from a backend: run token ids through one model, nothing else.

Two backends implement it: `torch` (armserve's own model, KV cache and scheduler,
engine/torch_backend.py) and `openvino` (OpenVINO GenAI's continuous-batching pipeline,
engine/openvino_backend.py). Prompts, detokenization, stop strings, logprobs and output objects
are not (the input and output processors: engine/llm_engine.py offline, the server's front end,
engine/async_llm.py, around an engine core, engine/core.py), so a
third backend is one new file with a class of this shape, its name in config.BACKENDS and a line
in `llm_engine.create_backend`.

    LLMEngine                               EngineBackend
    ---------                               -------------
    add_request(EngineCoreRequest)   ──►    queue the request's n sequences (ValueError: it cannot)
    abort_request(id, indices)       ──►    drop sequences, free their cache
    step()                           ◄──    BackendOutput: each sequence's new tokens (+ logprobs,
                                            finish reason), prompt tokens computed, ...
    scheduler_stats()                ◄──    SchedulerStats for /metrics and the stats line
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from armserve.config import EngineConfig
from armserve.engine.input_processor import EngineCoreRequest
from armserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from armserve.engine.stats import SchedulerStats
    from armserve.engine.structured_output import StructuredOutputManager

# A new token's log-probabilities: (token ids, logprobs, rank of the chosen one), the chosen
# token first, then the top alternatives in rank order.
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass(slots=True)
class SequenceOutput:
    """One sequence's progress in one step (a sequence: one of a request's n completions)."""

    request_id: str
    index: int
    token_ids: list[int]  # new tokens; none when only its prompt logprobs (or its end) came
    logprobs: list[TokenLogprobs | None] | None = None  # per new token, when asked for
    # Set when the backend ended the sequence: "stop" (its last new token is a stop token, whose
    # text is dropped), "length" or "abort".
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
    pooled: Any = None  # a pooling request's vector (float32 tensor), with finish_reason "stop"


@dataclass(slots=True)
class BackendOutput:
    """What one backend step did."""

    sequences: list[SequenceOutput] = field(default_factory=list)
    num_prompt_tokens: int = 0  # prompt tokens computed
    # Requests scheduled in this step -> their prompt tokens found in the prefix cache.
    scheduled: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)  # a request id per preempted sequence
    # Request id -> the prompt logprobs of this step's chunk: rows of (token ids, logprobs), ranks.
    prompt_logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)


class EngineBackend(Protocol):
    """One model behind one request queue. Not thread-safe: one thread calls every method."""

    config: EngineConfig
    tokenizer: Any  # a transformers tokenizer: the engine tokenizes and detokenizes with it
    max_model_len: int
    vocab_size: int
    eos_token_ids: set[int]
    num_kv_blocks: int  # the KV cache, in blocks of kv_block_size tokens (what a request may use)
    kv_block_size: int
    # Compiles structured-output grammars off the step loop; None if the backend refuses them
    # (its add_request then raises a ValueError naming `structured_outputs`).
    structured: "StructuredOutputManager | None"

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a processed request (ValueError naming what this backend cannot carry, backend untouched)."""
        ...

    def abort_request(self, request_id: str, indices: Sequence[int] | None = None) -> None:
        """Stop a request's sequences now (`indices`, or all) and free their cache; unknown ids are ignored."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> BackendOutput:
        """Advance every running sequence by one iteration."""
        ...

    def warm_up(self) -> None:
        """Run a dummy request (`run_dummy_request`) so the first real one does not pay for
        first-touch costs; the backend's counters are as before afterwards."""
        ...

    def release_idle_memory(self) -> None:
        """Hand back memory that only a step's computation uses (called while no request is
        unfinished, beside the heap's trim: memory.IdleTrim)."""
        ...

    def scheduler_stats(self) -> "SchedulerStats":
        """The backend's state now: requests running/waiting, KV cache use, prefix cache counters."""
        ...


def run_dummy_request(backend: EngineBackend, num_tokens: int) -> None:
    """Run a greedy request of `num_tokens` dummy prompt tokens and 2 generated to its end."""
    if num_tokens < 1:
        return
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids = [1 + i % (backend.vocab_size - 1) for i in range(num_tokens)]
    backend.add_request(EngineCoreRequest("armserve-warm-up", None, ids, params, 2, time.time(), [params]))
    while backend.has_unfinished_requests():
        backend.step()
