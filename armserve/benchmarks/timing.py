"""How armserve's benchmarks time things, each defined once (memory bandwidth: roofline.py).

- Decode speed of one sequence: the N - 1 tokens after the first over the time from the first
  token to the last, so prefill is left out; TPOT is the same interval per token (vLLM's).
- Decode speed from wall time alone, for a system that reports no token times: generating
  n + 1 tokens takes n decode steps more than generating 1, prefill and first token cancel.
- Microseconds of a kernel: the median of several timed loops of calls, after a warm-up call.

NOTE: standard library only. benchmarks/bench_moe.py runs this file by path (runpy.run_path) in
vLLM's interpreter, where armserve is not installed.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence, TypeVar

_T = TypeVar("_T")


def decode_tok_s(num_tokens: int, first_token_time: float, last_token_time: float) -> float | None:
    """Tokens per second after the first token; None without two tokens apart in time."""
    if num_tokens < 2 or last_token_time <= first_token_time:
        return None
    return (num_tokens - 1) / (last_token_time - first_token_time)


def request_decode_tok_s(out: Any) -> float | None:
    """`decode_tok_s` of a finished `RequestOutput` (its first sequence, the engine's token times)."""
    m = out.metrics
    return decode_tok_s(len(out.outputs[0].token_ids), m.first_token_time, m.last_token_time)


def time_per_output_token(num_tokens: int, first_token_time: float, last_token_time: float) -> float | None:
    """Seconds per token after the first (TPOT); None for at most one token."""
    if num_tokens > 1:
        return (last_token_time - first_token_time) / (num_tokens - 1)
    return None


def decode_tok_s_by_difference(run: Callable[[int], float], steps: int, sequences: int = 1) -> float:
    """Decode tokens per second when only wall time is known: `run(k)` is the seconds to generate
    k tokens for each of `sequences` sequences; run(steps + 1) - run(1) is `steps` decode steps."""
    return sequences * steps / (run(steps + 1) - run(1))


def timed(fn: Callable[[], _T]) -> tuple[_T, float]:
    """fn()'s result and the wall seconds it took."""
    t = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t


def seconds_per_call(fn: Callable[[], Any], runs: int, iters: int | None = None, min_s: float = 0.05) -> float:
    """Median over `runs` loops of `iters` calls of the seconds per call, after a warm-up call.
    iters None: as many as take about `min_s` (from the time of one call; at least 1)."""
    fn()
    if iters is None:
        _, one = timed(fn)
        iters = max(1, int(min_s / max(one, 1e-7)))
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t) / iters)
    return statistics.median(samples)


def median_min_max(xs: Sequence[float]) -> tuple[float, float, float]:
    """A figure and its spread, as the benchmark tables print them."""
    return statistics.median(xs), min(xs), max(xs)
