"""The serving-benchmark arithmetic on synthetic timings: vLLM `bench serve` definitions of TTFT,
TPOT, ITL, E2EL, percentiles, goodput and throughput, checked against hand-computed values and numpy;
and the decode-speed definitions every benchmark script shares (armserve/benchmarks/timing.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from armserve.benchmarks.metrics import (RequestResult, calculate_metrics, parse_percentiles, parse_slo,
                                         peak_concurrency, peak_output_throughput, tpot_of)
from armserve.benchmarks.serve import arrival_intervals
from armserve.benchmarks.timing import decode_tok_s, decode_tok_s_by_difference, time_per_output_token


def req(ttft: float, latency: float, out: int, itl: list[float], prompt: int, start: float = 0.0,
        success: bool = True) -> RequestResult:
    return RequestResult(success=success, prompt_len=prompt, output_tokens=out, ttft=ttft, latency=latency,
                         itl=itl, start_time=start)


@pytest.fixture
def three_ok_one_failed() -> list[RequestResult]:
    return [
        req(0.100, 1.000, 10, [0.1] * 9, 100, start=0.0),  # TPOT (1.0 - 0.1) / 9 = 0.100
        req(0.200, 0.650, 4, [0.15] * 3, 50, start=0.5),  # TPOT (0.65 - 0.2) / 3 = 0.150
        req(0.050, 0.050, 1, [], 10, start=1.0),  # one token: no TPOT
        req(0.0, 0.0, 0, [], 999, start=1.2, success=False),
    ]


def test_tpot_excludes_the_first_token() -> None:
    assert tpot_of(req(0.1, 1.0, 10, [], 1)) == pytest.approx(0.1)
    assert tpot_of(req(0.2, 0.65, 4, [], 1)) == pytest.approx(0.15)
    assert tpot_of(req(0.05, 0.05, 1, [], 1)) is None


def test_decode_speed_definitions() -> None:
    assert decode_tok_s(5, 1.0, 3.0) == 2.0  # 4 tokens after the first in 2 s
    assert decode_tok_s(1, 1.0, 3.0) is None and decode_tok_s(5, 3.0, 3.0) is None
    assert time_per_output_token(5, 1.0, 3.0) == 0.5 and time_per_output_token(1, 1.0, 3.0) is None
    # wall time only: 9 tokens take 8 decode steps more than 1 token (2 s), for 4 sequences at once
    wall = {1: 0.5, 9: 2.5}
    assert decode_tok_s_by_difference(wall.__getitem__, 8, sequences=4) == 16.0


def test_counts_and_throughputs(three_ok_one_failed) -> None:
    m = calculate_metrics(three_ok_one_failed, duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 160  # the failed request's prompt does not count
    assert m["total_output_tokens"] == 15
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(7.5)
    assert m["total_token_throughput"] == pytest.approx(87.5)
    assert m["request_goodput"] is None and m["good_requests"] is None  # no SLO given


def test_latency_summaries_by_hand(three_ok_one_failed) -> None:
    m = calculate_metrics(three_ok_one_failed, duration_s=2.0, percentiles=[50, 99])
    # TTFT: 100, 200, 50 ms
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["p50_ttft_ms"] == pytest.approx(100)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 100)  # linear between 100 and 200 at rank 1.98
    # TPOT: 100 and 150 ms (the one-token request has none)
    assert m["mean_tpot_ms"] == pytest.approx(125)
    assert m["median_tpot_ms"] == pytest.approx(125)
    assert m["p99_tpot_ms"] == pytest.approx(100 + 0.99 * 50)
    # ITL: nine gaps of 100 ms and three of 150 ms, pooled over requests
    assert m["mean_itl_ms"] == pytest.approx((9 * 100 + 3 * 150) / 12)
    assert m["median_itl_ms"] == pytest.approx(100)
    # E2EL: 1000, 650, 50 ms
    assert m["mean_e2el_ms"] == pytest.approx(1700 / 3)
    assert m["median_e2el_ms"] == pytest.approx(650)
    assert m["std_e2el_ms"] == pytest.approx(np.std([1000, 650, 50]))


def test_percentiles_match_numpy() -> None:
    rng = np.random.default_rng(3)
    results = []
    for i in range(57):
        out = int(rng.integers(2, 40))
        itl = list(rng.exponential(0.02, size=out - 1))
        ttft = float(rng.exponential(0.3))
        results.append(req(ttft, ttft + sum(itl), out, itl, 16, start=i * 0.1))
    pcts = [25, 50, 90, 99, 99.9]
    m = calculate_metrics(results, duration_s=10.0, percentiles=pcts)
    ttft = np.array([r.ttft for r in results]) * 1000
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in results]) * 1000
    itl = np.array([g for r in results for g in r.itl]) * 1000
    e2el = np.array([r.latency for r in results]) * 1000
    for name, arr in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert m[f"mean_{name}_ms"] == pytest.approx(arr.mean())
        assert m[f"median_{name}_ms"] == pytest.approx(np.median(arr))
        for p in pcts:
            key = f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"
            assert m[f"{key}_{name}_ms"] == pytest.approx(np.percentile(arr, p))
    # With gaps summing to E2EL - TTFT, the mean TPOT of a request equals its mean ITL.
    r = results[0]
    assert tpot_of(r) == pytest.approx(np.mean(r.itl))


def test_goodput_counts_requests_meeting_every_slo(three_ok_one_failed) -> None:
    # TTFT 100 / 200 / 50 ms; TPOT 100 / 150 / (none: counts as 0, as in vLLM); E2EL 1000 / 650 / 50 ms
    m = calculate_metrics(three_ok_one_failed, 2.0, slo_ms={"ttft": 150})
    assert m["good_requests"] == 2 and m["request_goodput"] == pytest.approx(1.0)
    m = calculate_metrics(three_ok_one_failed, 2.0, slo_ms={"ttft": 150, "tpot": 90})
    assert m["good_requests"] == 1  # only the one-token request
    m = calculate_metrics(three_ok_one_failed, 2.0, slo_ms={"tpot": 150})
    assert m["good_requests"] == 3  # limits are inclusive
    m = calculate_metrics(three_ok_one_failed, 2.0, slo_ms={"e2el": 700})
    assert m["good_requests"] == 2
    m = calculate_metrics(three_ok_one_failed, 2.0, slo_ms={"ttft": 10})
    assert m["good_requests"] == 0 and m["request_goodput"] == 0.0


def test_no_successful_request_gives_zeros_not_nan() -> None:
    m = calculate_metrics([req(0, 0, 0, [], 5, success=False)], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["output_throughput"] == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics([], 0.0)


def test_peak_concurrency_and_peak_output_rate() -> None:
    rs = [
        req(0.1, 1.0, 3, [0.2, 0.2], 1, start=0.0),  # in flight [0, 1.0]
        req(0.1, 0.5, 2, [0.1], 1, start=0.2),  # [0.2, 0.7]
        req(0.1, 0.5, 2, [0.1], 1, start=1.0),  # [1.0, 1.5]: starts as the first ends
    ]
    assert peak_concurrency(rs) == 2
    # Token arrivals: 0.1, 0.3, 0.5 | 0.3, 0.4 | 1.1, 1.2 -> second 0 holds 5 tokens, second 1 holds 2.
    assert peak_output_throughput(rs) == 5.0
    # A server that sends several tokens in one chunk: the extra tokens count at the last chunk.
    rs[2].output_tokens = 6
    assert peak_output_throughput(rs) == 6.0


def test_parse_slo() -> None:
    assert parse_slo("ttft:500,tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_slo(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_slo(None) == {}
    for bad in ("itl:5", "ttft", "ttft:fast", "ttft:-1", "latency:3"):
        with pytest.raises(ValueError, match="slo"):
            parse_slo(bad)


def test_parse_percentiles() -> None:
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("0", "101", "50,-1"):
        with pytest.raises(ValueError, match="percentile"):
            parse_percentiles(bad)


def test_arrival_intervals_are_poisson_at_the_rate() -> None:
    rng = np.random.default_rng(0)
    gaps = arrival_intervals(20001, 4.0, 1.0, rng)
    assert gaps[0] == 0.0
    g = gaps[1:]
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    # Burstiness 4: gamma with the same mean, CV 1/2.
    g4 = arrival_intervals(20001, 4.0, 4.0, np.random.default_rng(1))[1:]
    assert g4.mean() == pytest.approx(0.25, rel=0.03)
    assert g4.std() / g4.mean() == pytest.approx(0.5, rel=0.05)
    assert not arrival_intervals(5, math.inf, 1.0, rng).any()  # all at once
    with pytest.raises(ValueError):
        arrival_intervals(3, 0.0, 1.0, rng)
