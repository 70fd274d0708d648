"""`armserve bench latency` and `armserve bench throughput` end to end, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from armserve.benchmarks.latency import random_token_prompt


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "armserve.cli", "bench", *args], capture_output=True, text=True,
                          env=env, timeout=300)


ENGINE = ("--dtype", "float32", "--kv-cache-space", "0.01", "--no-roofline")


@pytest.mark.parametrize("n", [1, 7, 64, 300])
def test_latency_prompts_have_exactly_the_asked_length(tokenizer_dir, n):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = random_token_prompt(tok, n, seed=n)
    assert len(ids) == n and all(0 <= i < len(tok) for i in ids)


def test_bench_latency_threads_flag_sets_the_engines_threads(tiny_llama, tmp_path):
    """`--threads N` is the engine's thread count, not overridden by the engine's own choice (one
    per physical core) when OMP_NUM_THREADS is unset."""
    out = tmp_path / "lat.json"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "armserve.cli", "bench", "latency", "--model", tiny_llama, *ENGINE,
                        "--threads", "1", "--input-lens", "5", "--output-len", "2", "--num-iters", "1",
                        "--num-iters-warmup", "0", "--output-json", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["threads"] == 1


def test_bench_latency_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "lat.json"
    r = run_bench("latency", "--model", tiny_llama, *ENGINE, "--input-lens", "5,40", "--output-len", "6",
                  "--num-iters", "3", "--num-iters-warmup", "1", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["model"] == tiny_llama and res["roofline"] is None
    assert [row["input_len"] for row in res["results"]] == [5, 40]
    for row in res["results"]:
        assert row["output_len"] == 6
        for key in ("ttft_ms", "decode_tok_s"):
            s = row[key]
            assert 0 < s["min"] <= s["median"] <= s["max"]
        assert row["decode_pct_of_bw_limit"] is None
    # one table line per prompt length
    lines = [ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0] in ("5", "40")]
    assert len(lines) == 2


def test_bench_throughput_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "tp.json"
    r = run_bench("throughput", "--model", tiny_llama, *ENGINE, "--num-prompts", "5", "--input-len", "12",
                  "--output-len", "4", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    # random prompts have exactly --input-len tokens and ignore EOS, so every count is known
    assert res["num_prompts"] == 5
    assert res["total_input_tokens"] == 5 * 12
    assert res["total_output_tokens"] == 5 * 4
    assert res["requests_per_s"] == pytest.approx(5 / res["elapsed_s"])
    assert res["output_tokens_per_s"] == pytest.approx(20 / res["elapsed_s"])
    assert res["total_tokens_per_s"] == pytest.approx(80 / res["elapsed_s"])
    assert res["mean_request_decode_tok_s"] > 0
    assert "Throughput:" in r.stdout


def test_bench_offline_reports_bad_arguments(tiny_llama):
    r = run_bench("latency", "--model", tiny_llama, *ENGINE, "--input-lens", "0,5")
    assert r.returncode == 2 and "--input-lens" in r.stderr
    r = run_bench("latency", "--model", tiny_llama, *ENGINE, "--output-len", "1")
    assert r.returncode == 2 and "--output-len" in r.stderr
    r = run_bench("throughput", "--model", tiny_llama, *ENGINE, "--num-prompts", "0")
    assert r.returncode == 2 and "--num-prompts" in r.stderr
