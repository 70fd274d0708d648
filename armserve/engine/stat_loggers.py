"""Stat loggers: what receives the engine's stats after every step (engine/stats.py) — the periodic
throughput line here, Prometheus in entrypoints/metrics.py."""

from __future__ import annotations

import logging
import time
from dataclasses import fields
from typing import Protocol

from armserve.config import DEFAULT_STATS_INTERVAL
from armserve.engine.stats import IterationStats, SchedulerStats

logger = logging.getLogger("armserve")


def combine_stats(snapshots: list[SchedulerStats]) -> SchedulerStats:
    """Several engines' snapshots as one (counts and blocks summed; usage over all blocks)."""
    if len(snapshots) == 1:
        return snapshots[0]
    counts = [f.name for f in fields(SchedulerStats) if f.name != "spec_decoding"]
    total = SchedulerStats(**{name: sum(getattr(s, name) for s in snapshots) for name in counts})
    for s in snapshots:
        if s.spec_decoding is not None:
            if total.spec_decoding is None:
                total.spec_decoding = s.spec_decoding.copy()
            else:
                total.spec_decoding.add(s.spec_decoding)
    total.kv_cache_usage = total.kv_blocks_used / total.kv_blocks_total if total.kv_blocks_total else 0.0
    return total


class StatLogger(Protocol):
    """Receives stats after every step (from a thread that is not the event loop's; implementations
    must be thread-safe to read). `engine` is the data-parallel engine's index."""

    def record(self, scheduler: SchedulerStats, iteration: IterationStats, engine: int = 0) -> None: ...


class LoggingStatLogger:
    """Logs one vLLM-style throughput line every `interval` seconds while the engine is busy."""

    def __init__(self, interval: float = DEFAULT_STATS_INTERVAL) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last: dict[int, SchedulerStats] = {}
        self._last_line_busy = False
        self._spec_at_last_line = None  # speculative decoding's counters at the previous line

    def record(self, scheduler: SchedulerStats, iteration: IterationStats, engine: int = 0) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        self._last[engine] = scheduler

    def maybe_log(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        s = combine_stats(list(self._last.values()))
        busy = bool(self._prompt_tokens or self._generation_tokens or s.num_running or s.num_waiting)
        # NOTE: one more line after going idle, so the log shows the engine drained to zero.
        if busy or self._last_line_busy:
            spec = ""
            sd = s.spec_decoding
            if sd is not None:
                # acceptance over this line's interval, as vLLM's SpecDecoding metrics line
                last = self._spec_at_last_line
                drafted = sd.num_draft_tokens - (last.num_draft_tokens if last else 0)
                accepted = sd.num_accepted_tokens - (last.num_accepted_tokens if last else 0)
                drafts = sd.num_drafts - (last.num_drafts if last else 0)
                spec = (", Draft acceptance rate: %.1f%%, Mean acceptance length: %.2f"
                        % (100 * accepted / drafted if drafted else 0.0, 1 + accepted / drafts if drafts else 0.0))
                self._spec_at_last_line = sd.copy()
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s",
                self._prompt_tokens / elapsed, self._generation_tokens / elapsed,
                s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * s.prefix_cache_hit_rate, spec,
            )
        self._last_line_busy = busy
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0
