"""What `LLM.generate` and the async engine hand back, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token at one position, its 1-based rank and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One completion (of `n`) of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt and its completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # a pooling request's float32 vector (a tensor from LLM, a numpy array from AsyncLLM, whose
    # front end has no torch); `outputs` then holds no tokens
    pooled: Any = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per input, shaped like vLLM's: `out.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_output(cls, out: RequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.pooled.tolist()), out.prompt_token_ids, out.finished)



@dataclass(slots=True)
class ScoringOutput:
    """One pair's score (vLLM's ScoringOutput): a cross-encoder's relevance probability, or the
    cosine similarity of an embedding model's two vectors."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What `LLM.score` returns per pair, shaped like vLLM's: `out.outputs.score`."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    """One input's class probabilities (vLLM's ClassificationOutput)."""

    probs: list[float]


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What `LLM.classify` returns per input: `out.outputs.probs`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
