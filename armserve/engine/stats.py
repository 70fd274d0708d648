"""What an engine reports after each step, for stat loggers (the stats line, Prometheus): its state
(`SchedulerStats`, every backend's `scheduler_stats()`), what happened since the last report
(`IterationStats`) and each finished request's life (`FinishedRequestStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding's cumulative counters (vLLM's spec_decode_* series)."""

    num_drafts: int = 0  # verifications (a request's drafts in one step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft position j

    @classmethod
    def empty(cls, k: int) -> "SpecDecodingStats":
        return cls(num_accepted_tokens_per_pos=[0] * k)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    def add(self, other: "SpecDecodingStats") -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for j, v in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[j] += v


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the engine's state after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # cumulative
    spec_decoding: SpecDecodingStats | None = None  # cumulative; None without speculative decoding

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True)
class FinishedRequestStats:
    """One request's life, recorded when it finishes or is aborted."""

    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    time_per_output_token: float | None  # mean over the request's decode, None with < 2 tokens
    # First scheduled -> first token, and first -> last token (vLLM's prefill and decode phases);
    # None without a first token.
    prefill_time: float | None = None
    decode_time: float | None = None


@dataclass(slots=True)
class IterationStats:
    """What happened since the previous record: tokens, first tokens, finished requests."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # True when this record is one engine step (its tokens are the step's), not an idle tick or aborts.
    step: bool = False
    time_to_first_tokens: list[float] = field(default_factory=list)
    # Per request that got a token this step (not its first): the time since its previous token.
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
