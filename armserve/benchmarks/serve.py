"""`armserve bench serve`: load any OpenAI-compatible server and measure it as vLLM's `bench serve` does.

Requests arrive as a Poisson process (or gamma, with `--burstiness`) at each `--request-rate`, or
all at once (`inf`) under a `--max-concurrency` cap; each streams its completion, and the client
times every chunk. One run per (rate, concurrency) pair, all with the same prompts; each run's
metrics go to the terminal as a table and, with `--save-result`, to a JSON file.

    armserve bench serve --base-url http://127.0.0.1:8000 --tokenizer MODEL \\
        --num-prompts 32 --input-len 128 --output-len 64 --ignore-eos --request-rate 1 2 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from datetime import datetime
from typing import Any, AsyncIterator, Sequence

import numpy as np

from armserve.benchmarks.datasets import (SampleRequest, ServerTokenizer, file_requests, load_local_tokenizer,
                                          random_requests)
from armserve.benchmarks.metrics import (LATENCY_METRICS, METRIC_NAMES, RequestResult, calculate_metrics,
                                         parse_percentiles, parse_slo, percentile_key)
from armserve.entrypoints.chat_client import ChatClientError, first_model

ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


# ---- one request ---------------------------------------------------------------------------------


def build_payload(backend: str, model: str | None, req: SampleRequest, ignore_eos: bool,
                  extra_body: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON body of one streaming request (greedy, usage asked for in the last chunk)."""
    body: dict[str, Any] = {"temperature": 0.0, "max_tokens": req.expected_output_len, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


def _chunk_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def send_request(session, url: str, payload: dict[str, Any], prompt_len: int,
                       headers: dict[str, str] | None = None, count_tokens=None) -> RequestResult:
    """POST one streaming request and time it.

    TTFT is taken at the first chunk with text, each further text chunk adds an ITL gap, and E2EL
    ends at the last chunk with choices. The output length is the server's `usage` count when it
    sends one, else `count_tokens(text)` (re-tokenised, as vLLM does), else the number of text chunks.
    """
    import aiohttp

    r = RequestResult(prompt_len=prompt_len)
    st = time.perf_counter()
    r.start_time = st
    last = st
    chunks = 0
    text_parts: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with session.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return r
            async for raw in resp.content:
                line = raw.strip()
                if not line or line.startswith(b":"):  # keep-alive / SSE comment
                    continue
                data = line.decode("utf-8").removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    r.error = f"server error in stream: {obj['error']}"
                    return r
                if obj.get("usage"):
                    usage = obj["usage"]
                choices = obj.get("choices") or []
                if not choices:
                    continue
                now = time.perf_counter()
                text = "".join(_chunk_text(c) for c in choices)
                if text:
                    if chunks == 0:
                        r.ttft = now - st
                    else:
                        r.itl.append(now - last)
                    chunks += 1
                    text_parts.append(text)
                last = now  # a final chunk with no text (finish_reason only) still ends the request
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    if chunks == 0:
        r.error = "the stream carried no text chunk to time the first token by"
        return r
    r.latency = last - st
    r.generated_text = "".join(text_parts)
    if usage and usage.get("completion_tokens"):
        r.output_tokens = int(usage["completion_tokens"])
    elif count_tokens is not None:
        r.output_tokens = count_tokens(r.generated_text)
    else:
        r.output_tokens = chunks
    if usage and usage.get("prompt_tokens"):
        r.prompt_len = int(usage["prompt_tokens"])
    r.success = True
    return r


# ---- the load generator --------------------------------------------------------------------------


def arrival_intervals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Gaps before each of `n` requests: the first is 0, the rest gamma-distributed with mean 1/rate
    (burstiness 1: exponential, i.e. a Poisson process; below 1 burstier, above 1 more regular).
    Rate inf sends everything at once."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    gaps = np.zeros(n)
    if n > 1 and not math.isinf(rate):
        # Gamma(shape=b, scale=1/(rate*b)) has mean 1/rate and coefficient of variation 1/sqrt(b).
        gaps[1:] = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n - 1)
    return gaps


async def arrivals(requests: Sequence[SampleRequest], rate: float, burstiness: float,
                   rng: np.random.Generator) -> AsyncIterator[SampleRequest]:
    """Yield the requests on the schedule of `arrival_intervals`."""
    for gap, req in zip(arrival_intervals(len(requests), rate, burstiness, rng), requests):
        if gap > 0:
            await asyncio.sleep(float(gap))
        yield req


async def run_benchmark(base_url: str, backend: str, model: str | None, requests: Sequence[SampleRequest],
                        rate: float, max_concurrency: int | None, burstiness: float = 1.0, seed: int = 0,
                        ignore_eos: bool = False, extra_body: dict[str, Any] | None = None,
                        api_key: str | None = None, count_tokens=None, show_progress: bool = True,
                        timeout_s: float = 6 * 3600) -> tuple[list[RequestResult], float]:
    """Send every request once; returns the per-request results (in request order) and the wall duration."""
    import aiohttp

    url = base_url.rstrip("/") + ENDPOINTS[backend]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=f"rate {rate:g}" + (f" conc {max_concurrency}" if max_concurrency else ""),
                   dynamic_ncols=True, file=sys.stderr)
    # NOTE: no connection limit of aiohttp's own (default 100 per host) may cap the concurrency we ask
    # for; and one fresh connection per request, because some servers (llama-server) close kept-alive
    # connections after a stream, and a request written into such a connection fails for nothing.
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     read_bufsize=1 << 20) as session:
        async def one(req: SampleRequest) -> RequestResult:
            payload = build_payload(backend, model, req, ignore_eos, extra_body)
            async with sem:
                res = await send_request(session, url, payload, req.prompt_len, headers, count_tokens)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(req)) async for req in arrivals(requests, rate, burstiness, rng)]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return results, duration


async def wait_ready(base_url: str, backend: str, model: str | None, req: SampleRequest, timeout_s: float,
                     ignore_eos: bool, extra_body: dict[str, Any] | None, api_key: str | None) -> RequestResult:
    """Send one test request, as the benchmark will (retrying while the server starts); raise if it never succeeds."""
    deadline = time.monotonic() + timeout_s
    while True:
        results, _ = await run_benchmark(base_url, backend, model, [req], math.inf, None, ignore_eos=ignore_eos,
                                         extra_body=extra_body, api_key=api_key, show_progress=False)
        # A 4xx answer (bad model name, unknown field) will not improve by waiting.
        client_error = results[0].error.startswith("HTTP 4")
        if results[0].success or client_error or time.monotonic() > deadline:
            if not results[0].success:
                raise RuntimeError(f"the test request to {base_url} failed: {results[0].error}")
            return results[0]
        await asyncio.sleep(2.0)


# ---- reporting -----------------------------------------------------------------------------------


def format_summary(m: dict[str, Any], rate: float, concurrency: int | None, burstiness: float,
                   metrics_shown: Sequence[str], percentiles: Sequence[float], extra: dict[str, str]) -> str:
    """The terminal table, laid out like vLLM's."""
    w = 50
    lines = [f"Traffic request rate: {rate:g}", f"Burstiness factor: {burstiness:g}"
             + (" (Poisson process)" if burstiness == 1 else ""),
             f"Maximum request concurrency: {concurrency}", " Serving Benchmark Result ".center(w, "=")]

    def row(name: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{name:<40}" + (fmt.format(value) if value is not None else "n/a"))

    row("Successful requests:", m["completed"], "{:<10}")
    if m["failed"]:
        row("Failed requests:", m["failed"], "{:<10}")
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", m["request_throughput"])
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    row("Peak concurrent requests:", m["max_concurrent_requests"], "{:<10}")
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for name in metrics_shown:
        lines.append(f" {METRIC_NAMES[name]} ".center(w, "-"))
        tag = name.upper()
        row(f"Mean {tag} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {tag} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {tag} (ms):", m[f"{percentile_key(p)}_{name}_ms"])
    if extra:
        lines.append(" Roofline ".center(w, "-"))
        for k, v in extra.items():
            lines.append(f"{k:<40}{v}")
    lines.append("=" * w)
    return "\n".join(lines)


def result_filename(label: str, rate: float, concurrency: int | None) -> str:
    r = "inf" if math.isinf(rate) else f"{rate:g}"
    return f"{label}-rate{r}" + (f"-conc{concurrency}" if concurrency else "") + ".json"


# ---- command line --------------------------------------------------------------------------------


def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {s}")
    return v


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of `armserve bench serve` (vLLM's names where vLLM has one)."""
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", default="openai", choices=sorted(ENDPOINTS),
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--model", default=None, help="model name sent in requests (default: the server's first model)")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer (HF folder or GGUF) for prompt lengths (default: the server's /tokenize)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset-name", default="random", choices=["random", "file"])
    p.add_argument("--dataset-path", default=None, help="prompt file for --dataset-name file (.jsonl/.json/.txt)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=None,
                   help="prompt tokens (random: default 128; file: default as written)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from len * [1 - r, 1 + r]")
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens of prefix shared by all prompts")
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[math.inf],
                   help="requests per second, one run per value (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                   help="cap on requests in flight, one run per value (default: no cap)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to generate exactly the output length")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--slo", "--goodput", dest="slo", nargs="+", default=None, metavar="NAME:MS",
                   help="goodput SLOs, e.g. ttft:500,tpot:50 (ttft, tpot, e2el in ms)")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-check-timeout-sec", type=float, default=600.0)
    p.add_argument("--label", default=None, help="system name in results and plots (default: backend)")
    p.add_argument("--save-result", action="store_true", help="write one JSON per run")
    p.add_argument("--save-detailed", action="store_true", help="also store per-request timings in the JSON")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None, help="file name (only with a single run)")
    p.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="extra fields for the JSON")
    p.add_argument("--roofline", action="store_true",
                   help="measure memory bandwidth and matmul peak and report decode speed as %% of the bandwidth limit")
    p.add_argument("--roofline-file", default=None, help="reuse (or write) a roofline measurement JSON")
    p.add_argument("--weight-bytes", type=int, default=None, help="bytes of weights read per decode step")
    p.add_argument("--weights", default=None,
                   help="model checkpoint (HF folder or GGUF) to count --weight-bytes from")
    p.add_argument("--weight-dtype", default=None, help="dtype the server computes in (default: as stored)")
    p.add_argument("--disable-tqdm", action="store_true")


def _first_model(base_url: str, api_key: str | None) -> str | None:
    try:
        return first_model(base_url.rstrip("/") + "/v1", api_key)
    except (ChatClientError, OSError, ValueError, KeyError):
        return None


def main(args: argparse.Namespace) -> int:
    """Run the sweep; print a table per run and save JSONs when asked."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    percentiles = parse_percentiles(args.metric_percentiles)
    slo = parse_slo(args.slo)
    shown = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for m in shown:
        if m not in LATENCY_METRICS:
            raise ValueError(f"--percentile-metrics: unknown metric {m!r}; choose from {', '.join(LATENCY_METRICS)}")
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    runs = [(r, c) for r in args.request_rate for c in args.max_concurrency]
    if args.result_filename and len(runs) > 1:
        raise ValueError("--result-filename names one file; this sweep has several runs (use --result-dir)")
    for _, c in runs:
        if c is not None and c < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {c}")

    model = args.model or _first_model(base_url, args.api_key)
    tok = load_local_tokenizer(args.tokenizer) if args.tokenizer else ServerTokenizer(base_url, model)

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    # One prompt more than the runs use: the test request gets its own, so no run starts with a
    # prompt the server has just cached.
    if args.dataset_name == "file":
        if not args.dataset_path:
            raise ValueError("--dataset-name file needs --dataset-path")
        requests = file_requests(tok, args.dataset_path, args.num_prompts + 1, args.output_len, args.input_len)
    else:
        requests = random_requests(tok, args.num_prompts + 1, args.input_len or 128, args.output_len,
                                   args.random_range_ratio, args.random_prefix_len, args.seed)
    test_request, requests = requests[-1], requests[:-1]

    roof = None
    weight_bytes = args.weight_bytes
    if args.roofline or args.roofline_file:
        from armserve.benchmarks import roofline as rl

        roof = rl.load_or_measure(args.roofline_file)
        print(f"Roofline: {rl.describe(roof)}", flush=True)
        if weight_bytes is None and args.weights:
            weight_bytes = rl.weight_bytes_per_token(args.weights, args.weight_dtype)

    print(f"Waiting for {base_url} (test request) ...", flush=True)
    asyncio.run(wait_ready(base_url, args.backend, model, test_request, args.ready_check_timeout_sec,
                           args.ignore_eos, extra_body, args.api_key))
    label = args.label or args.backend
    for rate, conc in runs:
        results, duration = asyncio.run(run_benchmark(
            base_url, args.backend, model, requests, rate, conc, args.burstiness, args.seed, args.ignore_eos,
            extra_body, args.api_key, count_tokens, show_progress=not args.disable_tqdm))
        m = calculate_metrics(results, duration, percentiles, slo)
        extra: dict[str, str] = {}
        roof_out: dict[str, Any] | None = None
        if roof is not None:
            roof_out = dict(roof)
            if weight_bytes:
                floor_ms = 1000.0 / rl.bandwidth_limit(weight_bytes, roof)
                pct = 100 * floor_ms / m["median_tpot_ms"] if m["median_tpot_ms"] > 0 else None
                roof_out.update(weight_bytes=weight_bytes, tpot_floor_ms=floor_ms, decode_pct_of_bw_limit=pct)
                extra["Weight bytes per decode step:"] = f"{weight_bytes / 1e6:.1f} MB"
                extra["Bandwidth-limited TPOT (ms):"] = f"{floor_ms:.2f}"
                extra["Median TPOT vs bandwidth limit:"] = f"{pct:.1f} %" if pct is not None else "n/a"
        print(format_summary(m, rate, conc, args.burstiness, shown, percentiles, extra), flush=True)
        errors = [r.error for r in results if not r.success]
        if errors:
            print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
        if args.save_result:
            out: dict[str, Any] = {
                "date": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
                "label": label, "backend": args.backend, "base_url": base_url, "model": model,
                "tokenizer": args.tokenizer, "dataset_name": args.dataset_name, "num_prompts": len(requests),
                "input_len": args.input_len or (128 if args.dataset_name == "random" else None),
                "output_len": args.output_len, "random_range_ratio": args.random_range_ratio,
                "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
                "max_concurrency": conc, "ignore_eos": args.ignore_eos, "slo_ms": slo or None,
                "percentiles": percentiles, "load_average": os.getloadavg()[0], **m, "roofline": roof_out,
                "errors": errors[:5],
            }
            for kv in args.metadata:
                k, sep, v = kv.partition("=")
                if not sep:
                    raise ValueError(f"--metadata item {kv!r} must be KEY=VALUE")
                out[k] = v
            if args.save_detailed:
                out["per_request"] = {
                    "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_tokens for r in results],
                    "ttfts": [r.ttft for r in results], "e2els": [r.latency for r in results],
                    "itls": [r.itl for r in results], "errors": [r.error for r in results]}
            os.makedirs(args.result_dir, exist_ok=True)
            path = os.path.join(args.result_dir, args.result_filename or result_filename(label, rate, conc))
            with open(path, "w") as f:
                json.dump(out, f, indent=1)
            print(f"Saved {path}", flush=True)
    return 0
