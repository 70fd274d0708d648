"""Soak and fault run of `armserve serve` on loopback (production-hardening issue): bounded phases,
each reported against the issue's done-when targets.

    python benchmarks/soak.py                  # 10,000 soak requests, every fault phase (~10-15 min)
    python benchmarks/soak.py --quick          # 300 requests, the same phases: a smoke run (~3 min)
    python benchmarks/soak.py --requests 2000 --model /path/to/model --no-write

Phases (one server for 1-6a, fresh ones for 6b and 7):
  1 soak       N mixed requests (chat / completions, streamed or not, short max_tokens) from a few
               concurrent clients, some cutting their stream (or their non-streamed request) short,
               some sending bad input (malformed JSON, bad parameters, unknown model, bad token ids,
               a prompt far over the context); lost = 5xx, transport error, incomplete or error-ended
               stream; hung = no answer within --hang-timeout. Server RSS (front end + engine core)
               after a warm-up that touches the whole KV cache, then every 10% and at the end.
  2 big body   a 10 MB chat body and a 10 MB completions body (400 context_length_exceeded), a 40 MB
               Content-Length (413 before the body), /health polled every 20 ms from another thread.
  3 bomb       a JSON schema of 10,000 properties (400 "too complex" within the grammar budget) while
               /health is polled and small choice / regex requests, each a new grammar, keep coming.
  4 flood      --flood requests at once, far over the admission bound: each refusal must be 429 with
               Retry-After within 1 s; the admitted ones must complete.
  5 KV leak    armserve:kv_cache_used_blocks back to 0 once idle, after all of the above.
  6 kill       6a: kill -9 the engine core with streams in flight: seconds to the server's exit, its
               code, the streams' error events. 6b: the same under --restart-engine-on-failure:
               seconds until /health is 200 again and a request is served.
  7 SIGTERM    a fresh server, streams in flight, SIGTERM: every stream ends with all its tokens and
               [DONE], a late request gets 503, exit code 0.

Client and server share the machine's cores (the server computes on one thread, OMP_NUM_THREADS=1).
Results go to benchmarks/results/soak/<timestamp>/ (result.json, section.md, server logs) and the
"soak" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

RESULTS = os.path.join(HERE, "results", "soak")
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16
MAX_WAITING = 32  # admission bound: 16 running + 32 waiting
KV_GIB = 0.25
BLOCK_SIZE = 32  # the engine's default
# NOTE: one compute thread (OMP_NUM_THREADS=1 below), as tests/server_process.py's ServerProcess: the
# machine is shared. (No `import torch` here: it added ~180 MB to the front end's RSS, which imports
# no torch of its own, and so to the RSS figures of the soak.)
SERVE_CODE = "import sys; from armserve.cli import main; sys.exit(main())"

TOPICS = ["the sea", "a cat", "Paris", "rain", "prime numbers", "tea", "a robot", "winter", "bread", "the moon"]


# ---- the server --------------------------------------------------------------------------------


def start_server(model: str, out_dir: str, name: str, extra: list[str], env: dict[str, str]) -> peers.Server:
    """`armserve serve` on a free loopback port via peers.Server (own session, stopped by pid group).
    `env["SOAK_SOURCE"]`, when set, is the armserve checkout to run (cwd and PYTHONPATH)."""
    port = peers.free_port()
    env = dict(env)
    source = env.pop("SOAK_SOURCE", None)
    # `python -c` puts the working directory first on sys.path: run from the checkout itself.
    where = ["env", "-C", source] if source else []
    cmd = [*where, sys.executable, "-c", SERVE_CODE, "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "soak", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-space", str(KV_GIB),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
           "--grammar-compile-timeout", env.pop("SOAK_GRAMMAR_BUDGET", "10"),
           "--disable-log-stats", "--disable-access-log", "--uvicorn-log-level", "warning", *extra]
    full_env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    if source:
        full_env["PYTHONPATH"] = source
    spec = peers.ServerSpec(f"armserve {name}", cmd, full_env, "1 thread", model, None)
    return peers.Server(spec, port, os.path.join(out_dir, f"server-{name}.log"), startup_timeout_s=300)


def engine_cores(server: peers.Server) -> list[psutil.Process]:
    """The engine-core children (named in their command line; not the grammar-compile workers)."""
    out = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "armserve-engine-core" in cmd:  # (armserve/engine/core_client.py: PROCESS_TAG)
            out.append(p)
    return out


def rss_mb(server: peers.Server) -> dict[str, float]:
    """RSS in MB of the front end, its engine core(s), and every descendant together."""
    front = psutil.Process(server.proc.pid)
    cores = {p.pid for p in engine_cores(server)}
    out = {"front": front.memory_info().rss / 2**20, "engine": 0.0, "all": front.memory_info().rss / 2**20,
           "procs": 1}
    for p in front.children(recursive=True):
        try:
            r = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        out["all"] += r
        out["procs"] += 1
        if p.pid in cores:
            out["engine"] += r
    out["server"] = out["front"] + out["engine"]
    return {k: round(v, 1) for k, v in out.items()}


def metrics(url: str) -> dict[str, float]:
    """`armserve:` samples keyed by name plus labels other than model_name / engine (summed)."""
    import re

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r"^(armserve:[^{ ]+)(\{.*\})? (\S+)$", line)
        if not m:
            continue
        name, labels, value = m.groups()
        extra = [kv for kv in re.findall(r'(\w+="[^"]*")', labels or "")
                 if not kv.startswith(("model_name=", "engine="))]
        key = name + (("{" + ",".join(sorted(extra)) + "}") if extra else "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def wait_idle_blocks(url: str, timeout: float = 15.0) -> tuple[float, float]:
    """(kv_cache_used_blocks once it reaches 0 or at the timeout, seconds waited)."""
    t0 = time.monotonic()
    while True:
        used = metrics(url).get("armserve:kv_cache_used_blocks", -1)
        if used == 0 or time.monotonic() - t0 > timeout:
            return used, round(time.monotonic() - t0, 2)
        time.sleep(0.2)


class HealthPoller:
    """GET /health every `interval` s on its own thread and keep-alive connection, so the client's
    event loop (busy sending a 10 MB body, say) does not add to the latencies it records."""

    def __init__(self, url: str, interval: float = 0.02) -> None:
        self.url, self.interval = url, interval
        self.lat: list[float] = []
        self.spans: list[tuple[float, float]] = []  # (start, end), time.monotonic()
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get(f"{self.url}/health").status_code
                    if status != 200:
                        self.bad.append(str(status))
                except httpx.HTTPError as e:
                    self.bad.append(type(e).__name__)
                t1 = time.monotonic()
                self.lat.append(t1 - t0)
                self.spans.append((t0, t1))
                time.sleep(self.interval)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def summary(self, during: list[tuple[float, float]] | None = None) -> dict[str, Any]:
        """Latency percentiles of every poll, or only of those overlapping one of the `during` windows."""
        lat = self.lat if during is None else [
            b - a for a, b in self.spans if any(a < e and b > s for s, e in during)]
        if not lat:
            return {"n": 0}
        # Coordinated omission: while one poll is stuck, the ones due every `interval` are not sent;
        # count them as HdrHistogram's recordValueWithExpectedInterval does (L - interval, L - 2 x
        # interval, ...), or a 1 s stall weighs as one poll among hundreds.
        ms: list[float] = []
        for x in lat:
            ms.append(x * 1000)
            x -= self.interval
            while x > self.interval:
                ms.append(x * 1000)
                x -= self.interval
        ms.sort()
        return {"n": len(lat), "n_corrected": len(ms), "p50_ms": round(pct(ms, 50), 1), "p99_ms": round(pct(ms, 99), 1),
                "max_ms": round(ms[-1], 1), "not_200": self.bad[:10], "n_not_200": len(self.bad)}


def pct(sorted_xs: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_xs:
        return float("nan")
    k = max(0, min(len(sorted_xs) - 1, int(round(p / 100 * len(sorted_xs) + 0.5)) - 1))
    return sorted_xs[k]


# ---- phase 1: the soak ---------------------------------------------------------------------------

# kind -> weight. ok_*: must end complete; cut_*: the client goes away early; bad_*: a clean 4xx.
KINDS = {
    "ok_chat": 22, "ok_chat_stream": 20, "ok_cmpl": 18, "ok_cmpl_stream": 15,
    "cut_stream": 9, "cut_full": 3,
    "bad_json": 2, "bad_params": 3, "bad_model": 2, "bad_token_ids": 2, "bad_huge": 1, "bad_empty": 3,
}
HUGE = "word " * 60_000  # ~300 kB, ~60k tokens: far over max_model_len


@dataclass
class Outcome:
    kind: str
    result: str  # ok | clean_error | cut | lost | hung
    status: int = 0
    seconds: float = 0.0
    detail: str = ""


def request_for(kind: str, rng: random.Random) -> tuple[str, bytes, bool]:
    """(path, raw body, streamed) of one request of this kind."""
    topic = rng.choice(TOPICS)
    n = rng.randint(1, 12)
    temp = rng.choice([0.0, 0.7])
    chat = {"model": "soak", "messages": [{"role": "user", "content": f"Say something about {topic} ({n})."}],
            "max_tokens": n, "temperature": temp}
    cmpl = {"model": "soak", "prompt": f"A short note about {topic}, number {n}:", "max_tokens": n,
            "temperature": temp}
    stream_opts = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "ok_chat":
        return "/v1/chat/completions", json.dumps(chat).encode(), False
    if kind == "ok_chat_stream":
        return "/v1/chat/completions", json.dumps({**chat, **stream_opts}).encode(), True
    if kind == "ok_cmpl":
        return "/v1/completions", json.dumps(cmpl).encode(), False
    if kind == "ok_cmpl_stream":
        return "/v1/completions", json.dumps({**cmpl, **stream_opts}).encode(), True
    if kind == "cut_stream":  # long enough to be cut mid-stream
        return "/v1/chat/completions", json.dumps({**chat, "max_tokens": 200, "ignore_eos": True,
                                                   **stream_opts}).encode(), True
    if kind == "cut_full":
        return "/v1/completions", json.dumps({**cmpl, "max_tokens": 200, "ignore_eos": True}).encode(), False
    if kind == "bad_json":
        return rng.choice(["/v1/chat/completions", "/v1/completions"]), b'{"model": "soak", "messages": [', False
    if kind == "bad_params":
        bad = rng.choice([{"temperature": -1}, {"max_tokens": -3}, {"top_p": 7}, {"n": 0}, {"messages": "hi"},
                          {"logprobs": True, "top_logprobs": 1000}, {"stop": 42}])
        return "/v1/chat/completions", json.dumps({**chat, **bad}).encode(), False
    if kind == "bad_model":
        return "/v1/chat/completions", json.dumps({**chat, "model": "no-such-model"}).encode(), False
    if kind == "bad_token_ids":
        ids = rng.choice([[10**9], [-5, 3], [1, 2, 2**40]])
        return "/v1/completions", json.dumps({**cmpl, "prompt": ids}).encode(), False
    if kind == "bad_huge":
        return "/v1/chat/completions", json.dumps({**chat, "messages": [{"role": "user", "content": HUGE}]}).encode(), False
    if kind == "bad_empty":
        return "/v1/chat/completions", json.dumps({**chat, "messages": []}).encode(), False
    raise ValueError(kind)


def check_stream(lines: list[str]) -> str:
    """'' if an SSE body ended complete ([DONE] last, a finish_reason, no error event), else why not."""
    if not lines or lines[-1] != "[DONE]":
        return f"no [DONE] (last: {lines[-1][:80] if lines else 'nothing'})"
    finished = False
    for raw in lines[:-1]:
        chunk = json.loads(raw)
        if "error" in chunk:
            return f"error event: {raw[:160]}"
        for c in chunk.get("choices") or []:
            finished |= c.get("finish_reason") in ("stop", "length")
    return "" if finished else "no finish_reason"


async def read_sse(resp: aiohttp.ClientResponse, limit: int | None = None) -> list[str]:
    """The `data:` payloads of an SSE body (at most `limit`)."""
    out: list[str] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            out.append(line[6:])
            if limit is not None and len(out) >= limit:
                break
    return out


async def one_request(session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random,
                      hang_timeout: float) -> Outcome:
    path, body, streamed = request_for(kind, rng)
    t0 = time.monotonic()
    out = Outcome(kind, "lost")

    async def go() -> None:
        if kind == "cut_full":
            # A non-streamed request whose client gives up before the answer (a load balancer's timeout).
            try:
                r = await asyncio.wait_for(session.post(url + path, data=body,
                                                        headers={"Content-Type": "application/json"}),
                                           rng.uniform(0.05, 0.3))
                r.close()
                out.result = "cut"  # answered before we gave up: fine too
            except asyncio.TimeoutError:
                out.result = "cut"
            return
        async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            out.status = r.status
            if kind.startswith("bad_"):
                text = await r.text()
                ok = 400 <= r.status < 500 and r.status != 429 and "error" in json.loads(text)
                out.result = "clean_error" if ok else "lost"
                out.detail = "" if ok else text[:200]
                return
            if r.status != 200:
                out.detail = (await r.text())[:200]
                return
            if kind == "cut_stream":
                got = await read_sse(r, limit=rng.randint(1, 6))
                out.result = "cut" if got else "lost"
                r.close()  # drop the connection mid-stream
                return
            if streamed:
                why = check_stream(await read_sse(r))
                out.result, out.detail = ("ok", "") if not why else ("lost", why)
                return
            data = json.loads(await r.text())
            fin = data["choices"][0].get("finish_reason")
            out.result = "ok" if fin in ("stop", "length") and data.get("usage") else "lost"
            out.detail = "" if out.result == "ok" else json.dumps(data)[:200]

    try:
        await asyncio.wait_for(go(), hang_timeout)
    except asyncio.TimeoutError:
        out.result, out.detail = "hung", f"no answer within {hang_timeout:g} s"
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError, IndexError) as e:
        out.result, out.detail = "lost", f"{type(e).__name__}: {e}"[:200]
    out.seconds = time.monotonic() - t0
    return out


async def run_mix(url: str, n: int, concurrency: int, seed: int, hang_timeout: float,
                  on_progress: Any = None) -> list[Outcome]:
    """`n` requests of KINDS' mix from `concurrency` clients; `on_progress(done)` every n/10."""
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    outcomes: list[Outcome] = []
    nxt = iter(range(n))
    step = max(1, n // 10)
    # A fresh connection per cut stream (close() drops it); the others keep theirs alive.
    conn = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def worker(wid: int) -> None:
            wrng = random.Random(seed * 1000 + wid)
            for i in nxt:
                outcomes.append(await one_request(session, url, kinds[i], wrng, hang_timeout))
                if on_progress and len(outcomes) % step == 0:
                    await asyncio.get_running_loop().run_in_executor(None, on_progress, len(outcomes))

        await asyncio.gather(*[worker(w) for w in range(concurrency)])
    return outcomes


async def fill_kv(url: str, cache_tokens: int) -> None:
    """Warm-up that touches every KV block (the cache is allocated untouched, and freed blocks are
    reused oldest-first), so first-touch pages do not show as RSS growth during the soak."""
    per = cache_tokens // MAX_NUM_SEQS - 2 * BLOCK_SIZE
    rng = random.Random(7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one() -> None:
            ids = [rng.randint(100, 40000) for _ in range(per)]  # random: no prefix-cache hits
            async with s.post(f"{url}/v1/completions", json={"model": "soak", "prompt": ids, "max_tokens": 8,
                                                              "ignore_eos": True}) as r:
                await r.read()

        for _ in range(2):
            await asyncio.gather(*[one() for _ in range(MAX_NUM_SEQS)])


def phase_soak(server: peers.Server, n: int, warmup: int, concurrency: int, hang_timeout: float) -> dict[str, Any]:
    url = server.url
    # The KV gauges are set after each engine step: one request first.
    httpx.post(f"{url}/v1/completions", json={"model": "soak", "prompt": "Hi", "max_tokens": 2}, timeout=120)
    m0 = metrics(url)
    cache_tokens = int(m0["armserve:kv_cache_total_blocks"]) * BLOCK_SIZE
    print(f"[1] warm-up: filling the {cache_tokens}-token KV cache, then {warmup} mixed requests", flush=True)
    asyncio.run(fill_kv(url, cache_tokens))
    asyncio.run(run_mix(url, warmup, concurrency, seed=1, hang_timeout=hang_timeout))
    rss: list[dict[str, Any]] = [{"done": 0, **rss_mb(server)}]
    print(f"[1] soak: {n} requests, {concurrency} clients; RSS at start {rss[0]}", flush=True)
    t0 = time.monotonic()

    def progress(done: int) -> None:
        rss.append({"done": done, **rss_mb(server)})
        print(f"    {done}/{n} in {time.monotonic() - t0:.0f} s, RSS {rss[-1]}", flush=True)

    outcomes = asyncio.run(run_mix(url, n, concurrency, seed=2, hang_timeout=hang_timeout, on_progress=progress))
    took = time.monotonic() - t0
    used, waited = wait_idle_blocks(url)
    m1 = metrics(url)
    by: dict[str, dict[str, int]] = {}
    for o in outcomes:
        by.setdefault(o.kind, {}).setdefault(o.result, 0)
        by[o.kind][o.result] += 1
    bad = [o for o in outcomes if o.result in ("lost", "hung")]
    end = rss_mb(server)
    lat = sorted(o.seconds for o in outcomes if o.result == "ok")
    return {
        "requests": n, "warmup": warmup, "concurrency": concurrency, "seconds": round(took, 1),
        "req_per_s": round(n / took, 1), "by_kind": by,
        "lost": sum(o.result == "lost" for o in outcomes), "hung": sum(o.result == "hung" for o in outcomes),
        "examples": [o.__dict__ for o in bad[:10]],
        "ok_latency_p50_s": round(pct(lat, 50), 3), "ok_latency_p99_s": round(pct(lat, 99), 3),
        "rss_mb": rss + [{"done": "end", **end}],
        "rss_growth_pct": round(100 * (end["server"] / rss[0]["server"] - 1), 2),
        "rss_growth_all_pct": round(100 * (end["all"] / rss[0]["all"] - 1), 2),
        "kv_used_blocks_after": used, "kv_wait_s": waited,
        "server_finished": {k.split("{", 1)[1].rstrip("}"): m1[k] - m0.get(k, 0.0) for k in m1
                            if k.startswith("armserve:request_success_total")},
        "load_after": round(load_average(), 2),
    }


# ---- phase 2: 10 MB bodies -------------------------------------------------------------------


async def raw_headers_only(port: int, length: int) -> tuple[int, float]:
    """Send only the headers of a `length`-byte POST: (status, seconds to the answer)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {length}\r\n\r\n").encode())
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 60)
    writer.close()
    return int(line.split()[1]) if line.startswith(b"HTTP/") else 0, time.monotonic() - t0


def phase_big_body(server: peers.Server, repeats: int = 3) -> dict[str, Any]:
    """10 MB bodies of several shapes, each sent `repeats` times, /health polled throughout; the
    /health figures count the polls that overlapped a body in flight."""
    print("[2] 10 MB bodies with /health polled every 20 ms", flush=True)
    text = "All work and no play makes Jack a dull boy. " * 230_000  # ~10 MB, 4.0 characters per token
    # SmolLM2 tokenizes this at 10.5 characters per token (prose: ~4).
    long_words = "The extraordinarily comprehensive international documentation. " * 160_000
    hi = {"role": "user", "content": "hi"}
    bodies = {
        "chat, one 10 MB message": ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        "completions, 10 MB prompt": ("/v1/completions", {"prompt": text}),
        "completions, 10 MB prompt of long words": ("/v1/completions", {"prompt": long_words}),
        "completions, 10 MB of token ids": ("/v1/completions", {"prompt": [12345] * 1_500_000}),
        "chat, 10 MB of 300k short messages": ("/v1/chat/completions", {"messages": [hi] * 300_000}),
    }
    encoded = {k: (path, json.dumps({"model": "soak", "max_tokens": 4, **b}).encode())
               for k, (path, b) in bodies.items()}
    out: dict[str, Any] = {k: {"bytes": len(b), "runs": []} for k, (_, b) in encoded.items()}
    windows: dict[str, list[tuple[float, float]]] = {k: [] for k in encoded}

    async def send_all() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            for _ in range(repeats):
                for name, (path, body) in encoded.items():
                    t0 = time.monotonic()
                    async with s.post(server.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                        reply = await r.text()
                    windows[name].append((t0, time.monotonic()))
                    try:
                        code = (json.loads(reply).get("error") or {}).get("code")
                    except json.JSONDecodeError:
                        code = reply[:60]
                    out[name]["runs"].append({"status": r.status, "code": code, "seconds": round(windows[name][-1][1] - t0, 3)})
                    await asyncio.sleep(0.2)
        port = int(server.url.rsplit(":", 1)[1])
        status, took = await raw_headers_only(port, 40 * 2**20)
        out["Content-Length 40 MB, headers only"] = {"runs": [{"status": status, "seconds": round(took, 3)}]}

    with HealthPoller(server.url) as hp:
        time.sleep(0.5)
        asyncio.run(send_all())
        time.sleep(0.5)
    for name, w in windows.items():
        out[name]["health"] = hp.summary(during=w)
    out["health"] = hp.summary(during=[x for w in windows.values() for x in w])
    out["health_all_polls"] = hp.summary()
    return out


# ---- phase 3: the grammar bomb ---------------------------------------------------------------


def phase_grammar_bomb(server: peers.Server, budget: float) -> dict[str, Any]:
    print(f"[3] grammar bomb (10,000 properties, budget {budget:g} s) beside small structured requests", flush=True)
    bomb = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
    body = {"model": "soak", "messages": [{"role": "user", "content": "Fill in the form."}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "bomb", "schema": bomb}}}
    res: dict[str, Any] = {"budget_s": budget}
    small: list[dict[str, Any]] = []

    async def structured_loop(s: aiohttp.ClientSession, stop: asyncio.Event, wid: int) -> None:
        i = 0
        while not stop.is_set() or i < 3:
            i += 1
            tag = f"{wid}x{i}"
            # Each spec is new, so each needs its own compile beside the bomb's.
            if i % 2:
                so, check = {"choice": [f"yes-{tag}", f"no-{tag}"]}, (lambda t, tag=tag: t in (f"yes-{tag}", f"no-{tag}"))
            else:
                so, check = {"regex": f"[a-c]{{2,{2 + i % 5}}}-{tag}"}, (lambda t, tag=tag: t.endswith(f"-{tag}"))
            t0 = time.monotonic()
            try:
                async with s.post(f"{server.url}/v1/chat/completions", json={
                        "model": "soak", "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 16,
                        "temperature": 0, "structured_outputs": so}) as r:
                    data = await r.json(content_type=None)
                    text = data["choices"][0]["message"]["content"] if r.status == 200 else ""
                    small.append({"status": r.status, "ok": r.status == 200 and check(text),
                                  "seconds": time.monotonic() - t0, "text": text[:40] if text else str(data)[:120]})
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError) as e:
                small.append({"status": 0, "ok": False, "seconds": time.monotonic() - t0, "text": repr(e)[:120]})

    async def main() -> None:
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=budget + 120)) as s:
            loops = [asyncio.create_task(structured_loop(s, stop, w)) for w in range(2)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            try:
                async with s.post(f"{server.url}/v1/chat/completions", json=body) as r:
                    text = await r.text()
                    res["bomb"] = {"status": r.status, "seconds": round(time.monotonic() - t0, 2),
                                   "message": text[:300]}
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                res["bomb"] = {"status": 0, "seconds": round(time.monotonic() - t0, 2),
                               "message": f"no answer: {type(e).__name__}"}
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*loops)

    rss_before = rss_mb(server)
    with HealthPoller(server.url) as hp:
        asyncio.run(main())
    res["health"] = hp.summary()
    lat = sorted(x["seconds"] for x in small)
    res["structured"] = {"n": len(small), "ok": sum(x["ok"] for x in small), "p50_s": round(pct(lat, 50), 3),
                         "max_s": round(lat[-1], 3) if lat else None,
                         "failures": [x for x in small if not x["ok"]][:5]}
    res["rss_mb_before"], res["rss_mb_after"] = rss_before, rss_mb(server)
    return res


# ---- phase 4: the flood ----------------------------------------------------------------------


def phase_flood(server: peers.Server, n: int) -> dict[str, Any]:
    bound = MAX_NUM_SEQS + MAX_WAITING
    print(f"[4] flood: {n} requests at once against an admission bound of {bound}", flush=True)
    before = metrics(server.url).get('armserve:requests_rejected_total{reason="overloaded"}', 0.0)

    async def one(s: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        t0 = time.monotonic()
        body = {"model": "soak", "messages": [{"role": "user", "content": f"Story {i}."}], "max_tokens": 24,
                "ignore_eos": True}
        try:
            async with s.post(f"{server.url}/v1/chat/completions", json=body) as r:
                first = time.monotonic() - t0
                text = await r.text()
                ok = r.status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "length"
                return {"status": r.status, "t_status": first, "t_end": time.monotonic() - t0, "ok": ok,
                        "retry_after": r.headers.get("Retry-After")}
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return {"status": 0, "t_status": time.monotonic() - t0, "ok": False, "err": type(e).__name__}

    async def main() -> list[dict[str, Any]]:
        conn = aiohttp.TCPConnector(limit=0)  # every request on its own connection, all at once
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
            return await asyncio.gather(*[one(s, i) for i in range(n)])

    rs = asyncio.run(main())
    refused = [r for r in rs if r["status"] == 429]
    served = [r for r in rs if r["status"] == 200]
    other = [r for r in rs if r["status"] not in (200, 429)]
    t429 = sorted(r["t_status"] for r in refused)
    after = metrics(server.url).get('armserve:requests_rejected_total{reason="overloaded"}', 0.0)
    return {
        "sent": n, "bound": bound, "refused_429": len(refused), "served_200": len(served),
        "served_complete": sum(r["ok"] for r in served), "other": len(other),
        "other_examples": other[:5],
        "refusals_with_retry_after": sum(r.get("retry_after") is not None for r in refused),
        "t429_p50_s": round(pct(t429, 50), 3) if t429 else None,
        "t429_max_s": round(t429[-1], 3) if t429 else None,
        "t200_max_s": round(max(r["t_end"] for r in served), 2) if served else None,
        "rejected_counter_delta": after - before,
    }


# ---- phases 6 and 7: faults ------------------------------------------------------------------


class Streams:
    """`k` streamed chat requests on threads; each records its SSE data lines."""

    def __init__(self, url: str, k: int, max_tokens: int) -> None:
        self.outs: list[list[str]] = [[] for _ in range(k)]
        body = {"model": "soak", "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        self.threads = [threading.Thread(target=self._run, args=(f"{url}/v1/chat/completions", body, o), daemon=True)
                        for o in self.outs]
        for t in self.threads:
            t.start()

    @staticmethod
    def _run(url: str, body: dict[str, Any], out: list[str]) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=300) as r:
                out.append(f"status {r.status_code}")
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:])
        except httpx.HTTPError as e:
            out.append(f"transport error {type(e).__name__}")

    def wait_streaming(self, lines: int = 4, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while not all(len(o) >= lines for o in self.outs):
            if time.monotonic() > end:
                raise RuntimeError(f"streams did not start: {[o[:2] for o in self.outs]}")
            time.sleep(0.05)

    def join(self, timeout: float = 300) -> None:
        for t in self.threads:
            t.join(timeout)

    def endings(self) -> list[str]:
        """Per stream: 'complete N tokens', 'error: ...', or what else it ended with."""
        res = []
        for o in self.outs:
            if not o or o[-1] != "[DONE]":
                res.append(f"no [DONE]: {o[-1][:80] if o else 'nothing'}")
                continue
            chunks = [json.loads(x) for x in o[1:-1]]
            err = next((c["error"] for c in chunks if "error" in c), None)
            if err:
                res.append(f"error event: {err.get('message', '')[:100]}")
                continue
            usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), {})
            res.append(f"complete {usage.get('completion_tokens')} tokens")
        return res


def phase_engine_kill(server: peers.Server) -> dict[str, Any]:
    print("[6a] kill -9 of the engine core with 2 streams in flight", flush=True)
    streams = Streams(server.url, 2, MAX_MODEL_LEN - 128)
    streams.wait_streaming()
    cores = engine_cores(server)
    cores[0].kill()
    t0 = time.monotonic()
    try:
        code = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - t0
    streams.join(30)
    return {"engine_cores": len(cores), "exit_code": code, "exit_s": round(took, 2), "streams": streams.endings()}


def phase_engine_restart(model: str, out_dir: str, env: dict[str, str]) -> dict[str, Any]:
    print("[6b] kill -9 of the engine core under --restart-engine-on-failure", flush=True)
    server = start_server(model, out_dir, "restart", ["--restart-engine-on-failure"], env)
    try:
        streams = Streams(server.url, 2, MAX_MODEL_LEN - 128)
        streams.wait_streaming()
        old = engine_cores(server)
        old[0].kill()
        t0 = time.monotonic()
        unhealthy = served = None
        status: int | str = "none"
        # Serving again = a request answered 200 by the new core (/health may still say 200 for the
        # moment before the death is noticed, and says 503 while the new core loads).
        while time.monotonic() - t0 < 120 and server.proc.poll() is None:
            try:
                if unhealthy is None:
                    if httpx.get(f"{server.url}/health", timeout=5).status_code == 503:
                        unhealthy = time.monotonic() - t0
                else:
                    status = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                        json={"model": "soak", "prompt": "Hi", "max_tokens": 4}).status_code
                    if status == 200:
                        served = time.monotonic() - t0
                        break
            except httpx.HTTPError as e:
                status = type(e).__name__
            time.sleep(0.05)
        streams.join(30)
        new = {p.pid for p in engine_cores(server)} - {p.pid for p in old}
        return {"unhealthy_after_s": round(unhealthy, 2) if unhealthy is not None else None,
                "served_again_s": round(served, 2) if served is not None else None, "last_status": status,
                "new_engine_core": bool(new), "server_alive": server.proc.poll() is None,
                "streams": streams.endings()}
    finally:
        server.stop()


def phase_sigterm(model: str, out_dir: str, env: dict[str, str], k: int = 4, max_tokens: int = 300) -> dict[str, Any]:
    print(f"[7] SIGTERM with {k} streams of {max_tokens} tokens in flight", flush=True)
    server = start_server(model, out_dir, "sigterm", ["--shutdown-timeout", "120"], env)
    try:
        streams = Streams(server.url, k, max_tokens)
        streams.wait_streaming()
        server.proc.send_signal(signal.SIGTERM)  # the server process only, as a supervisor would
        t0 = time.monotonic()
        time.sleep(0.3)
        try:
            late = httpx.post(f"{server.url}/v1/completions", json={"model": "soak", "prompt": "Hi", "max_tokens": 2},
                              timeout=30).status_code
        except httpx.HTTPError as e:
            late = type(e).__name__
        try:
            health = httpx.get(f"{server.url}/health", timeout=30).status_code
        except httpx.HTTPError as e:
            health = type(e).__name__
        try:
            code = server.proc.wait(180)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        streams.join(30)
        return {"streams": streams.endings(), "max_tokens": max_tokens, "late_request": late,
                "health_while_draining": health, "exit_code": code, "exit_s": round(took, 2)}
    finally:
        server.stop()


# ---- the report ------------------------------------------------------------------------------


def verdicts(r: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(target, measured, met?) rows."""
    rows: list[tuple[str, str, str]] = []

    def row(target: str, measured: str, ok: bool | None) -> None:
        rows.append((target, measured, "n/a" if ok is None else ("met" if ok else "**missed**")))

    s = r.get("soak")
    if s:
        row("0 requests lost or hung (soak)", f"{s['lost']} lost, {s['hung']} hung of {s['requests']}",
            s["lost"] == 0 and s["hung"] == 0)
        row("RSS growth < 10% (soak)", f"{s['rss_growth_pct']:+.1f}% ({s['rss_mb'][0]['server']:.0f} -> "
            f"{s['rss_mb'][-1]['server']:.0f} MB, front end + engine core)", s["rss_growth_pct"] < 10)
    b = r.get("big_body")
    if b:
        shapes = {k: v["health"] for k, v in b.items() if not k.startswith("health") and v.get("health", {}).get("n")}
        worst = max(shapes, key=lambda k: shapes[k]["p99_ms"])
        h = shapes[worst]
        row("/health p99 < 100 ms during a 10 MB body", f"worst shape ({worst}): p99 {h['p99_ms']:.0f} ms, max "
            f"{h['max_ms']:.0f} ms; all shapes together p99 {b['health']['p99_ms']:.0f} ms",
            all(x["p99_ms"] < 100 and x["n_not_200"] == 0 for x in shapes.values()))
    g = r.get("grammar_bomb")
    if g:
        h, bomb, st = g["health"], g["bomb"], g["structured"]
        row("/health p99 < 100 ms during a grammar bomb", f"p99 {h['p99_ms']:.0f} ms, max {h['max_ms']:.0f} ms "
            f"({h['n']} polls)", h["p99_ms"] < 100 and h["n_not_200"] == 0)
        too_complex = bomb["status"] == 400 and "too complex" in bomb["message"]
        row("grammar bomb: 400 'too complex' within its budget",
            f"{bomb['status']} after {bomb['seconds']:.1f} s (budget {g['budget_s']:g} s)",
            too_complex and bomb["seconds"] < g["budget_s"] + 5)
        row("structured requests served during the bomb", f"{st['ok']} / {st['n']} correct (max {st['max_s']} s)",
            st["n"] > 0 and st["ok"] == st["n"])
    f = r.get("flood")
    if f:
        row("every overload answered 429 within 1 s",
            f"{f['refused_429']} refused, max {f['t429_max_s']} s; {f['other']} other statuses",
            f["refused_429"] > 0 and f["other"] == 0 and (f["t429_max_s"] or 0) < 1.0)
        row("flood: admitted requests complete", f"{f['served_complete']} / {f['served_200']}",
            f["served_complete"] == f["served_200"])
    k = r.get("kv")
    if k:
        row("0 leaked KV blocks", f"{k['used_blocks']:.0f} blocks in use once idle (after soak: "
            f"{s['kv_used_blocks_after']:.0f})" if s else f"{k['used_blocks']:.0f}",
            k["used_blocks"] == 0 and (not s or s["kv_used_blocks_after"] == 0))
    e = r.get("engine_kill")
    if e:
        errs = sum(x.startswith("error event") for x in e["streams"])
        row("engine kill: exit within 5 s", f"exit code {e['exit_code']} after {e['exit_s']:.2f} s; {errs} / "
            f"{len(e['streams'])} streams ended with an error event and [DONE]",
            e["exit_code"] == 1 and e["exit_s"] < 5 and all(x.startswith("error event") for x in e["streams"]))
    e = r.get("engine_restart")
    if e:
        row("engine kill under --restart-engine-on-failure: serving again within 5 s",
            f"/health 503 after {e['unhealthy_after_s']} s, a request served by the new core after "
            f"{e['served_again_s']} s", e["served_again_s"] is not None and e["served_again_s"] < 5)
    t = r.get("sigterm")
    if t:
        ok = all(x == f"complete {t['max_tokens']} tokens" for x in t["streams"])
        row("SIGTERM: streams in flight complete with [DONE], exit 0",
            f"{sum(x.startswith('complete') for x in t['streams'])} / {len(t['streams'])} complete, late request "
            f"{t['late_request']}, exit {t['exit_code']} after {t['exit_s']:.1f} s",
            ok and t["exit_code"] == 0 and t["late_request"] == 503)
    return rows


def section(r: dict[str, Any], cmdline: str) -> str:
    lines = ["## Soak and faults: `armserve serve` under mixed load, hostile input and kills (production hardening)",
             "",
             f"Machine: {r['machine']}. armserve rev `{r['revision']}`. Model: {os.path.basename(r['model'])}, "
             f"1 compute thread (OMP_NUM_THREADS=1), `--max-num-seqs {MAX_NUM_SEQS} --max-waiting-requests "
             f"{MAX_WAITING} --kv-cache-space {KV_GIB} --max-model-len {MAX_MODEL_LEN} --grammar-compile-timeout "
             f"{r['grammar_budget_s']:g}`{' (servers run from a clean clone of that revision)' if r['args'].get('source') else ''}. The client (aiohttp / httpx, one process) "
             f"shares the 2 cores with the server. Load average {r['load_before']:.2f} before, {r['load_after']:.2f} "
             f"after; {r['seconds'] / 60:.0f} min in all.", "",
             "| target | measured | |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in verdicts(r)]
    s = r.get("soak")
    if s:
        mix = ", ".join(f"{k} {sum(v.values())}" for k, v in sorted(s["by_kind"].items()))
        rss = " -> ".join(f"{x['server']:.0f}" for x in s["rss_mb"])
        lines += ["", f"Soak: {s['requests']} requests in {s['seconds']:.0f} s ({s['req_per_s']:.0f} req/s, "
                  f"{s['concurrency']} clients, after {s['warmup']} warm-up requests and two passes that fill the KV "
                  f"cache); completed requests' p50 / p99 {s['ok_latency_p50_s'] * 1000:.0f} / "
                  f"{s['ok_latency_p99_s'] * 1000:.0f} ms. Mix: {mix}. "
                  f"RSS (MB, front end + engine core) every 10%: {rss}; with every descendant "
                  f"{s['rss_growth_all_pct']:+.1f}%."]
    b = r.get("big_body")
    if b:
        parts = []
        for k, v in b.items():
            if not k.startswith("health"):
                runs = v["runs"]
                codes = sorted({f"{x['status']}{' ' + x['code'] if x.get('code') else ''}" for x in runs})
                h = v.get("health")
                parts.append(f"{k}: {' / '.join(codes)} in {max(x['seconds'] for x in runs):.2f} s (slowest of "
                             f"{len(runs)})" + (f", /health p99 / max {h['p99_ms']:.0f} / {h['max_ms']:.0f} ms"
                                                if h and h.get("n") else ""))
        lines += ["", "Big bodies (each sent 3 times; /health polls overlapping that shape's requests): " +
                  "; ".join(parts) + f". /health over all {b['health_all_polls']['n']} polls of the phase: p99 "
                  f"{b['health_all_polls']['p99_ms']:.0f} ms. /health percentiles count the polls a stall held "
                  "back (coordinated omission, as HdrHistogram corrects it)."]
    g = r.get("grammar_bomb")
    if g:
        lines += ["", f"Grammar bomb: `{g['bomb']['message'][:160]}`. Server RSS (all processes) "
                  f"{g['rss_mb_before']['all']:.0f} -> {g['rss_mb_after']['all']:.0f} MB."]
    lines += ["", f"Reproduce: `{' '.join(['python benchmarks/soak.py', cmdline]).strip()}`"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--requests", type=int, default=10_000, help="soak requests (default 10,000)")
    ap.add_argument("--warmup", type=int, default=300, help="mixed requests before the RSS baseline")
    ap.add_argument("--concurrency", type=int, default=8, help="soak clients (below the admission bound)")
    ap.add_argument("--flood", type=int, default=500, help="requests sent at once in the flood phase")
    ap.add_argument("--grammar-budget", type=float, default=10.0, help="--grammar-compile-timeout of the server, s")
    ap.add_argument("--hang-timeout", type=float, default=120.0, help="a request unanswered this long is hung")
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 soak requests, 50 warm-up, flood 200")
    ap.add_argument("--nice", type=int, default=5, help="niceness of the client and servers (shared machine)")
    ap.add_argument("--source", default=None,
                    help="armserve checkout the servers run from (default: this one), e.g. a clean clone of HEAD "
                         "while others edit this working tree")
    ap.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.warmup, args.flood = min(args.requests, 300), 50, 200
    os.nice(args.nice)
    from armserve.model_loader import bundled_model_path

    model = args.model or bundled_model_path()
    out_dir = os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else ""))
    os.makedirs(out_dir, exist_ok=True)
    env = {"SOAK_GRAMMAR_BUDGET": f"{args.grammar_budget:g}"}
    src = os.path.abspath(args.source) if args.source else os.path.dirname(HERE)
    if args.source:
        env["SOAK_SOURCE"] = src
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=src).stdout.strip() or git_revision()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "armserve"], capture_output=True, text=True,
                           cwd=src).stdout.split("\n")
    dirty = [x[3:] for x in dirty if x.strip()]
    r: dict[str, Any] = {"machine": machine_description(), "revision": rev + (f" + uncommitted {', '.join(dirty)}"
                                                                              if dirty else ""),
                         "model": model, "args": vars(args), "grammar_budget_s": args.grammar_budget,
                         "load_before": round(load_average(), 2)}
    t_all = time.monotonic()
    server = start_server(model, out_dir, "main", [], env)
    try:
        r["soak"] = phase_soak(server, args.requests, args.warmup, args.concurrency, args.hang_timeout)
        r["big_body"] = phase_big_body(server)
        r["grammar_bomb"] = phase_grammar_bomb(server, args.grammar_budget)
        r["flood"] = phase_flood(server, args.flood)
        print("[5] KV blocks once idle", flush=True)
        used, waited = wait_idle_blocks(server.url)
        r["kv"] = {"used_blocks": used, "waited_s": waited, "rss_mb_end": rss_mb(server)}
        r["engine_kill"] = phase_engine_kill(server)
    finally:
        server.stop()
    r["engine_restart"] = phase_engine_restart(model, out_dir, env)
    r["sigterm"] = phase_sigterm(model, out_dir, env)
    r["seconds"] = round(time.monotonic() - t_all, 1)
    r["load_after"] = round(load_average(), 2)
    r["verdicts"] = verdicts(r)
    with open(os.path.join(out_dir, "result.json"), "w") as f:
        json.dump(r, f, indent=1, default=str)
    text = section(r, " ".join(sys.argv[1:]))
    with open(os.path.join(out_dir, "section.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    print(f"\nresults: {out_dir}")
    if not args.no_write and not args.quick:
        update_section("soak", text)


if __name__ == "__main__":
    main()
