"""Serving-benchmark arithmetic, with the definitions of vLLM's `vllm bench serve`.

Per request (times in seconds, measured by the client from the moment it sends the request):
  - TTFT  time to the first streamed chunk that carries text;
  - ITL   gaps between consecutive text chunks (one entry per gap, pooled over all requests);
  - E2EL  time to the last chunk of the response;
  - TPOT  (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token.
Over the run: throughputs divide by the wall duration of the whole run; goodput counts the
requests that meet every SLO given (a request with one output token has TPOT 0 there, as in vLLM).
Means, medians and percentiles are numpy's (linear interpolation), reported in milliseconds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Sequence

import numpy as np

from armserve.benchmarks.timing import time_per_output_token

# The metrics whose distributions are summarised, and the SLO keys goodput understands.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request."""

    success: bool = False
    prompt_len: int = 0  # input tokens (the server's count when it reports usage)
    output_tokens: int = 0  # generated tokens (the server's count when it reports usage)
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0  # perf_counter() when the request was sent
    generated_text: str = ""
    error: str = ""


def parse_slo(specs: Sequence[str] | str | None) -> dict[str, float]:
    """Parse `ttft:500,tpot:50` (milliseconds; also as separate items) into {"ttft": 500.0, ...}."""
    if not specs:
        return {}
    if isinstance(specs, str):
        specs = [specs]
    slo: dict[str, float] = {}
    for spec in specs:
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition(":")
            key = key.strip().lower()
            if not sep or key not in LATENCY_METRICS or key == "itl":
                raise ValueError(f"--slo item {item!r} must be NAME:MILLISECONDS with NAME one of ttft, tpot, e2el")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"--slo item {item!r}: {value!r} is not a number of milliseconds") from None
            if ms <= 0:
                raise ValueError(f"--slo item {item!r}: the limit must be > 0 ms")
            slo[key] = ms
    return slo


def parse_percentiles(spec: str | Sequence[float]) -> list[float]:
    """`"50,90,99"` -> [50.0, 90.0, 99.0]; each must lie in (0, 100]."""
    values = [float(p) for p in spec.split(",") if p.strip()] if isinstance(spec, str) else [float(p) for p in spec]
    for p in values:
        if not 0 < p <= 100:
            raise ValueError(f"percentile {p} must be in (0, 100]")
    return values


def tpot_of(r: RequestResult) -> float | None:
    """Time per output token after the first, or None for a request with at most one token."""
    return time_per_output_token(r.output_tokens, r.ttft, r.latency)


def percentile_key(p: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9": the name of a percentile in result keys."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def peak_output_throughput(results: Sequence[RequestResult], bucket_s: float = 1.0) -> float:
    """Most output tokens delivered in any one `bucket_s` window (tokens/s), from token arrival times.

    Arrival times are rebuilt from TTFT and the ITL gaps; a request whose server reports more tokens
    than chunks (several tokens per chunk) has its remaining tokens counted at its last chunk.
    """
    if not results:
        return 0.0
    t0 = min(r.start_time for r in results)
    buckets: Counter[int] = Counter()
    for r in results:
        if r.success:
            times = list(accumulate(r.itl, initial=r.start_time - t0 + r.ttft))
            buckets.update(int(t // bucket_s) for t in times)
            buckets[int(times[-1] // bucket_s)] += max(0, r.output_tokens - len(times))
    return max(buckets.values()) / bucket_s if buckets else 0.0


def peak_concurrency(results: Sequence[RequestResult]) -> int:
    """Most requests in flight at once, from each request's send time and E2EL."""
    events: list[tuple[float, int]] = []
    for r in results:
        if r.success:
            events.append((r.start_time, 1))
            events.append((r.start_time + r.latency, -1))
    # Ends sort before starts at the same instant: a request that finished is not in flight.
    events.sort(key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
    slo_ms: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The run's metrics as a flat-ish dict (the JSON result's body).

    `duration_s` is the wall time from the first request sent to the last response finished.
    Failed requests count nowhere but in `failed` (their output counts as 0 tokens).
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)

    good = len(ok)
    if slo_ms:
        limits = {k: v / 1000.0 for k, v in slo_ms.items()}
        good = 0
        for r in ok:
            value = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.latency}
            if all(value[k] <= lim for k, lim in limits.items()):
                good += 1

    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (good / duration_s) if slo_ms else None,
        "good_requests": good if slo_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": peak_output_throughput(ok),
        "max_concurrent_requests": peak_concurrency(ok),
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [t for t in map(tpot_of, ok) if t is not None]),
                         ("itl", [gap for r in ok for gap in r.itl]), ("e2el", [r.latency for r in ok])):
        arr = np.asarray(values or [0.0], dtype=np.float64) * 1000.0  # all zeros when there is none (as vLLM)
        out[f"mean_{name}_ms"] = float(np.mean(arr))
        out[f"median_{name}_ms"] = float(np.median(arr))
        out[f"std_{name}_ms"] = float(np.std(arr))
        for p in percentiles:
            out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out
