"""What an engine reports after each step, for stat loggers (the stats line, Prometheus): its state
(`SchedulerStats`, every backend's `scheduler_stats()`), what happened since the last report
(`IterationStats`) and each finished request's life (`FinishedRequestStats`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
