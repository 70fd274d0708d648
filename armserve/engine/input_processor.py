"""The input processor: a prompt and its sampling parameters -> an `EngineCoreRequest` (token ids and
validated parameters), once per request, before anything reaches an engine (vLLM v1's Processor).

    LLM.generate ─► LLMEngine.add_request ─┐
    AsyncLLM.add_request ──────────────────┼─► InputProcessor.process ─► EngineCoreRequest ─► engine core
    the server (chat already rendered) ────┘

`process` normalises the prompt (text, token ids or a dict -> token ids; chat is rendered by the
caller), checks the parameters and the prompt (empty, vocabulary range, room within max_model_len,
KV cache for all `n` completions), caps `max_tokens` at what max_model_len leaves, and fans `n` out
into one SamplingParams per completion. Its errors are `RequestError`s naming the problem; a prompt
that does not fit is a `ContextLengthError`, whose numbers the server turns into its own message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from armserve.pooling_params import PoolerConfig
from armserve.lora.request import LoRARequest
from armserve.pooling_params import PoolingParams
from armserve.prompts import prompt_to_ids
from armserve.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


class RequestError(ValueError):
    """A request cannot be served as asked (too long, bad tokens, ...); the engine is unaffected."""


class RunnerError(RequestError):
    """The request asks for what this engine's runner does not do (text from an embedding model,
    vectors from a generating one)."""


class PromptTokensError(RequestError):
    """The prompt has no token, or one outside the vocabulary."""


class LogprobsLimitError(RequestError):
    """A request asks for more logprobs per position than `max_logprobs` (--max-logprobs)."""

    def __init__(self, field: str, asked: int, limit: int) -> None:
        super().__init__(self.message(field, asked, limit))
        self.field, self.asked, self.limit = field, asked, limit

    @staticmethod
    def message(field: str, asked: int, limit: int) -> str:
        return f"{field} {asked} is more than this server returns per token: at most {limit} (max_logprobs, --max-logprobs)"


class ContextLengthError(RequestError):
    """The prompt leaves no room to generate within `max_model_len`, or with `max_tokens` (not
    None) asks for more than it; `max_tokens` 0: an input to pool is longer than max_model_len."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        n = num_prompt_tokens
        if max_tokens == 0:
            msg = (f"the input has {n} tokens, more than max_model_len {max_model_len}; shorten it or set "
                   "truncate_prompt_tokens")
        elif max_tokens is None:
            msg = f"the prompt has {n} tokens, which leaves no room to generate within max_model_len {max_model_len}"
        else:
            msg = (f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) is {n + max_tokens}, "
                   f"more than max_model_len {max_model_len}")
        super().__init__(msg)
        self.num_prompt_tokens = n
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


@dataclass(slots=True)
class EngineCoreRequest:
    """A request as an engine receives it: token ids and validated sampling parameters."""

    request_id: str
    prompt: str | None  # the text, when the prompt was text (outputs carry it back)
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens capped at what max_model_len leaves after the prompt
    arrival_time: float
    # The n fan-out: one SamplingParams per completion (n=1 each, seed + i, prompt_logprobs on the
    # first only, EOS among the stop tokens unless ignore_eos). `params` itself when n is 1.
    seq_params: list[SamplingParams]
    # A pooling request (the pooling runner's engine: one vector, no tokens generated).
    pooling: PoolingParams | None = None
    # The LoRA adapter to run with (armserve.lora.LoRARequest); None: the base model.
    lora_request: Any = None

    @property
    def n(self) -> int:
        return len(self.seq_params)


@dataclass(slots=True)
class InputProcessor:
    """Turns prompts into `EngineCoreRequest`s for one model and one KV cache.

    `vocab_size` bounds the prompt's token ids (the smaller of the model's and the tokenizer's: an
    id the tokenizer cannot decode is refused too). `num_kv_blocks` blocks of `block_size` tokens
    are the whole cache a request's `n` sequences must fit in at their longest.
    """

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: set[int]
    num_kv_blocks: int
    block_size: int
    max_logprobs: int = -1  # most logprobs per position a request may ask for; -1: no cap
    # An embedding model's pooling (the pooling runner's engine), else None: the engine generates.
    pooler: PoolerConfig | None = None

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                arrival_time: float | None = None, lora_request: Any = None) -> EngineCoreRequest:
        """The engine request of `prompt`; `RequestError` / `PromptError` (ValueErrors) naming the
        problem. `params` None: the defaults. `lora_request`: the adapter (lora.LoRARequest) or None."""
        if self.pooler is not None:
            raise RunnerError("this model is an embedding model (runner pooling): it returns vectors or scores "
                              "(LLM.embed / LLM.score, /v1/embeddings, /score, /rerank) and cannot generate text")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = prompt_to_ids(self.tokenizer, prompt)
        self.check_prompt(ids, params)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if params.n == 1:
            seq_params = [params]
        else:
            seq_params = [params.clone(n=1, seed=None if params.seed is None else params.seed + i,
                                       prompt_logprobs=params.prompt_logprobs if i == 0 else None)
                          for i in range(params.n)]
        for p in seq_params:
            p.update_from_generation_config(self.eos_token_ids)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        return EngineCoreRequest(request_id, text, ids, params, max_tokens,
                                 time.time() if arrival_time is None else arrival_time, seq_params,
                                 lora_request=lora_request)

    def process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams | None = None,
                        arrival_time: float | None = None, tokenizer: Any = None) -> EngineCoreRequest:
        """The engine request of an input to pool (embed): its token ids, cut to
        `truncate_prompt_tokens` on the tokenizer's truncation side when asked, else refused past
        max_model_len (`ContextLengthError`, max_tokens 0). `tokenizer`: a copy of the model's to
        use instead (a server's worker thread)."""
        tokenizer = tokenizer or self.tokenizer
        if self.pooler is None:
            raise RunnerError("this model generates text (runner generate) and has no pooling: serve an "
                              "embedding model (or start with --runner pooling) for embeddings")
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise RequestError(f"pooling params must be PoolingParams, got {type(params).__name__}")
        try:
            self.pooler.check_dimensions(params.dimensions)
        except ValueError as e:
            raise RequestError(str(e)) from None
        text, ids = prompt_to_ids(tokenizer, prompt)
        k = params.max_tokens(self.max_model_len)
        if k is not None and len(ids) > k:
            if text is not None and (not isinstance(prompt, dict) or "prompt_token_ids" not in prompt):
                # the tokenizer cuts text and keeps its special tokens ([CLS] ... [SEP])
                ids = list(tokenizer(text, truncation=True, max_length=k)["input_ids"])
            else:
                ids = ids[-k:] if getattr(tokenizer, "truncation_side", "right") == "left" else ids[:k]
        if not ids:
            raise PromptTokensError("the input is empty")
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptTokensError(f"input token id {bad[0]} is out of range for the vocabulary size {vocab}")
        if len(ids) > self.max_model_len:
            raise ContextLengthError(len(ids), 0, self.max_model_len)
        sp = SamplingParams(max_tokens=1)
        return EngineCoreRequest(request_id, text, ids, sp, 1, time.time() if arrival_time is None else arrival_time,
                                 [sp], params)

    def check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        """RequestError naming what keeps a prompt from being served: empty, a token outside the
        vocabulary, no room within max_model_len (`ContextLengthError`), or more KV cache than the
        whole cache for its `n` sequences (each holds its own blocks) at the longest they may grow."""
        if not ids:
            raise PromptTokensError("the prompt is empty")
        if self.max_logprobs >= 0:
            for name in ("logprobs", "prompt_logprobs"):
                asked = getattr(params, name)
                if asked is not None and asked > self.max_logprobs:
                    raise LogprobsLimitError(name, asked, self.max_logprobs)
        vocab = self.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptTokensError(f"prompt token id {bad[0]} is out of range for the vocabulary size {vocab}")
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise ContextLengthError(n, None, limit)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ContextLengthError(n, params.max_tokens, limit)
        # NOTE: all n completions counted: a request whose sequences could never all be in the cache
        # at once would run them a few at a time, holding the engine for many times its length.
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        total, seqs = n + max_tokens, params.n
        if -(-total // self.block_size) * seqs > self.num_kv_blocks:
            what = f"{seqs} x ({n} prompt + {max_tokens} max_tokens)" if seqs > 1 else \
                f"{n} prompt + {max_tokens} max_tokens"
            raise RequestError(
                f"the request needs up to {what} = {total * seqs} tokens of KV cache, more than the whole cache "
                f"holds ({self.num_kv_blocks * self.block_size} tokens); lower {'n or ' if seqs > 1 else ''}"
                "max_tokens, or raise kv_cache_space"
            )
