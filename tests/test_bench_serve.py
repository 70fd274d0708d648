"""`armserve bench serve` end to end against a real `armserve serve` on a free loopback port (tiny
random Llama), `bench plot` on its results, prompt building, and the stream parser against canned
server responses of the shapes other servers send."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from armserve.benchmarks.datasets import file_requests, load_local_tokenizer, random_requests
from armserve.benchmarks.serve import build_payload, send_request

IN_LEN, OUT_LEN, N = 32, 16, 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    """`armserve serve tiny_llama` on 127.0.0.1, one compute thread."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("ARMSERVE_API_KEY", None)
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "armserve.cli", "serve", tiny_llama, "--host", "127.0.0.1",
                             "--port", str(port), "--kv-cache-space", "0.25", "--max-model-len", "256",
                             "--disable-log-stats", "--disable-access-log"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # bounded: 600 polls of 0.2 s
            assert proc.poll() is None, f"server exited:\n{open(log_path).read()[-3000:]}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"server not healthy:\n{open(log_path).read()[-3000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "armserve.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


def check_run(d: dict, n: int, in_len: int, out_len: int) -> None:
    """Numbers of one run are complete and consistent with each other."""
    assert d["completed"] == n and d["failed"] == 0, d.get("errors")
    assert d["total_output_tokens"] == n * out_len  # ignore_eos: every request ran to its length
    assert d["total_input_tokens"] == n * in_len  # the server's own count: prompts are exactly in_len
    pr = d["per_request"]
    assert pr["output_lens"] == [out_len] * n and pr["input_lens"] == [in_len] * n
    for ttft, e2el, itl in zip(pr["ttfts"], pr["e2els"], pr["itls"]):
        assert 0 < ttft <= e2el
        assert len(itl) <= out_len - 1 and all(g >= 0 for g in itl)
        # The gaps run from the first text chunk to the last one, which ends the request here.
        assert sum(itl) == pytest.approx(e2el - ttft, abs=1e-6)
    assert d["request_throughput"] == pytest.approx(n / d["duration"])
    assert d["output_throughput"] == pytest.approx(n * out_len / d["duration"])
    assert d["total_token_throughput"] == pytest.approx(n * (in_len + out_len) / d["duration"])
    assert d["duration"] >= max(s + e for s, e in [(0.0, max(pr["e2els"]))])
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < d[f"median_{name}_ms"] <= d[f"p99_{name}_ms"]
        assert d[f"mean_{name}_ms"] > 0
    assert d["mean_ttft_ms"] <= d["mean_e2el_ms"]
    assert d["mean_tpot_ms"] < d["mean_e2el_ms"]
    assert d["good_requests"] == n  # SLOs far above anything a tiny model takes
    assert d["request_goodput"] == pytest.approx(d["request_throughput"])
    assert 1 <= d["max_concurrent_requests"] <= n


def test_bench_serve_sweep_and_plot(server, tiny_llama, tmp_path) -> None:
    out = tmp_path / "results"
    r = bench("serve", "--base-url", server, "--tokenizer", tiny_llama, "--num-prompts", str(N),
              "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN), "--ignore-eos", "--request-rate", "4", "16",
              "--slo", "ttft:60000,tpot:60000", "--metric-percentiles", "50,99", "--label", "armserve",
              "--save-result", "--save-detailed", "--result-dir", str(out), "--disable-tqdm")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Serving Benchmark Result") == 2
    assert "Mean TTFT (ms):" in r.stdout and "P99 ITL (ms):" in r.stdout and "Request goodput" in r.stdout
    files = sorted(glob.glob(str(out / "*.json")))
    assert [os.path.basename(f) for f in files] == ["armserve-rate16.json", "armserve-rate4.json"]
    for f in files:
        d = json.load(open(f))
        assert d["label"] == "armserve" and d["max_concurrency"] is None and d["ignore_eos"] is True
        check_run(d, N, IN_LEN, OUT_LEN)
    assert {json.load(open(f))["request_rate"] for f in files} == {4.0, 16.0}

    # Fixed concurrency, prompts from a file cut to an exact length.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Tell me about the number {i} and why it matters."})
                                 for i in range(5)))
    r = bench("serve", "--base-url", server, "--tokenizer", tiny_llama, "--dataset-name", "file",
              "--dataset-path", str(prompts), "--num-prompts", str(N), "--input-len", "24",
              "--output-len", str(OUT_LEN), "--ignore-eos", "--request-rate", "inf", "--max-concurrency", "2",
              "--slo", "e2el:60000", "--label", "armserve", "--save-result", "--save-detailed",
              "--result-dir", str(out), "--disable-tqdm")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.load(open(out / "armserve-rateinf-conc2.json"))
    check_run(d, N, 24, OUT_LEN)
    assert d["max_concurrent_requests"] <= 2 and d["request_rate"] == "inf"

    png = tmp_path / "plot.png"
    r = bench("plot", *sorted(glob.glob(str(out / "*.json"))), "-o", str(png), "--title", "tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image

    h, w = matplotlib.image.imread(str(png)).shape[:2]
    assert w > 600 and h > 300


def test_bench_serve_reports_a_bad_model_name(server, tiny_llama, tmp_path) -> None:
    r = bench("serve", "--base-url", server, "--tokenizer", tiny_llama, "--model", "no-such-model",
              "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--ready-check-timeout-sec", "0")
    assert r.returncode != 0
    assert "test request" in r.stderr and "404" in r.stderr


def test_bench_plot_rejects_other_json(tmp_path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    r = bench("plot", str(bad), "-o", str(tmp_path / "p.png"))
    assert r.returncode != 0 and "not a `bench serve` result" in r.stderr
    assert not (tmp_path / "p.png").exists()


# ---- prompts -------------------------------------------------------------------------------------


def test_random_and_file_prompts_have_exact_lengths(tokenizer_dir, tmp_path) -> None:
    tok = load_local_tokenizer(tokenizer_dir)
    reqs = random_requests(tok, 20, 48, 7, seed=1)
    assert [r.prompt_len for r in reqs] == [48] * 20 and [r.expected_output_len for r in reqs] == [7] * 20
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == 48 for r in reqs)
    assert len({r.prompt for r in reqs}) == 20
    assert [r.prompt for r in random_requests(tok, 20, 48, 7, seed=1)] == [r.prompt for r in reqs]  # seeded
    # A shared prefix and a spread of lengths.
    reqs = random_requests(tok, 30, 40, 10, range_ratio=0.5, prefix_len=16, seed=2)
    ids = [tok.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert all(len(i) == r.prompt_len for i, r in zip(ids, reqs))
    assert all(16 + 20 <= r.prompt_len <= 16 + 60 for r in reqs) and len({r.prompt_len for r in reqs}) > 3
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({tuple(i[:12]) for i in ids}) == 1  # the prefix (up to merges at its end) is common

    f = tmp_path / "p.txt"
    f.write_text("Short one.\n\nA somewhat longer prompt about rivers and mountains.\n")
    reqs = file_requests(tok, str(f), 4, 5)
    assert [r.prompt for r in reqs] == ["Short one.", "A somewhat longer prompt about rivers and mountains."] * 2
    assert reqs[0].prompt_len == len(tok.encode("Short one.", add_special_tokens=False))
    reqs = file_requests(tok, str(f), 3, 5, input_len=30)
    assert all(len(tok.encode(r.prompt, add_special_tokens=False)) == 30 for r in reqs)
    with pytest.raises(ValueError, match="not a file"):
        file_requests(tok, str(tmp_path / "missing.jsonl"), 1, 5)
    with pytest.raises(ValueError, match="input-len"):
        random_requests(tok, 2, 0, 5)


# ---- the stream parser against canned responses --------------------------------------------------


def serve_canned(bodies: dict[str, tuple[int, list[bytes]]]):
    """An aiohttp app on a free loopback port answering POST /<name> with the given status and chunks."""
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        status, chunks = bodies[request.match_info["name"]]
        if status != 200:
            return web.Response(status=status, text=chunks[0].decode())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/{name}", handler)
    return app


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def run_canned(bodies, name: str, count_tokens=None):
    import aiohttp
    from aiohttp import web

    async def go():
        runner = web.AppRunner(serve_canned(bodies))
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await send_request(session, f"http://127.0.0.1:{port}/{name}", {"prompt": "x"}, 5,
                                          count_tokens=count_tokens)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_stream_parser_on_other_servers_shapes() -> None:
    text = lambda t, fin=None: {"choices": [{"index": 0, "text": t, "finish_reason": fin}]}  # noqa: E731
    bodies = {
        # transformers serve: a last chunk with no text, a finish reason and the usage.
        "tf": (200, [sse(text("a")), sse(text("b")), sse(text("c")),
                     sse({**text("", "length"), "usage": {"prompt_tokens": 9, "completion_tokens": 3}}),
                     b"data: [DONE]\n\n"]),
        # llama-server style: no usage at all, an SSE comment, and a chat delta on one chunk.
        "llama": (200, [b": ping\n\n", sse(text("he")), sse({"choices": [{"index": 0, "delta": {"content": "llo"}}]}),
                        sse(text(" world")), b"data: [DONE]\n\n"]),
        "err": (500, [b"boom"]),
        "inband": (200, [sse(text("a")), sse({"error": {"message": "engine died"}})]),
        "empty": (200, [sse({"choices": [], "usage": {"completion_tokens": 0}}), b"data: [DONE]\n\n"]),
    }
    r = run_canned(bodies, "tf")
    assert r.success and r.output_tokens == 3 and r.prompt_len == 9 and r.generated_text == "abc"
    assert len(r.itl) == 2  # the empty finishing chunk is no token...
    assert r.latency >= r.ttft + sum(r.itl)  # ...but it ends the request
    r = run_canned(bodies, "llama")
    assert r.success and r.generated_text == "hello world" and r.prompt_len == 5
    assert r.output_tokens == 3  # no usage and no tokenizer: one token per text chunk
    r = run_canned(bodies, "llama", count_tokens=lambda s: len(s.split()))
    assert r.output_tokens == 2  # re-tokenised, as vLLM's client does without usage
    r = run_canned(bodies, "err")
    assert not r.success and "HTTP 500" in r.error and "boom" in r.error
    r = run_canned(bodies, "inband")
    assert not r.success and "engine died" in r.error
    r = run_canned(bodies, "empty")
    assert not r.success and "no text chunk" in r.error


def test_payload_shapes() -> None:
    from armserve.benchmarks.datasets import SampleRequest

    req = SampleRequest("hi there", 2, 7)
    p = build_payload("openai", "m", req, True, {"top_k": 1})
    assert p["prompt"] == "hi there" and p["max_tokens"] == 7 and p["ignore_eos"] is True and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["temperature"] == 0.0 and p["top_k"] == 1
    p = build_payload("openai-chat", None, req, False, None)
    assert p["messages"] == [{"role": "user", "content": "hi there"}] and p["max_completion_tokens"] == 7
    assert "model" not in p and "ignore_eos" not in p and "prompt" not in p
