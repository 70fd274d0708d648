"""Batch-1 decode before and after the C++ kernels, against this machine's bandwidth roofline.

For SmolLM2-135M (bundled GGUF) and a TinyLlama-1.1B-shaped random checkpoint, bfloat16:
armserve on the PyTorch path (`ARMSERVE_ISA=torch`, "before") and with the kernels ("after"),
each in its own process, alternating, median of `--runs`. The roofline is weight bytes read per
token divided by the measured read bandwidth (a large tensor sum, which only reads) — decode
cannot beat it. Writes the "decode" section of docs/benchmarks.md.

    python benchmarks/bench_decode.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from report import git_revision, load_average, machine_description, update_section  # noqa: E402

from armserve.benchmarks.roofline import measure_bandwidth, weight_bytes_per_token  # noqa: E402
from armserve.benchmarks.timing import request_decode_tok_s  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time"


def worker(model: str, dtype: str, tokens: int, runs: int) -> None:
    """Runs inside the measured process: prints one JSON line of decode tok/s samples."""
    import torch

    from armserve import LLM, SamplingParams, kernels

    # quantization="none": the dense path, whose non-GEMM work the kernels replace (the bundled
    # GGUF would otherwise run as w4a8, see bench_quant.py)
    llm = LLM(model, dtype=dtype, kv_cache_space=1, max_model_len=1024, quantization="none")
    p = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)
    samples = [request_decode_tok_s(llm.generate([PROMPT], p, use_tqdm=False)[0]) for _ in range(runs)]
    # (from the checkpoint: the engine keeps prepacked GEMM weights as buffers, not parameters)
    weight_bytes = weight_bytes_per_token(model, dtype)
    print(json.dumps({"samples": samples, "weight_bytes": weight_bytes, "isa": kernels.isa(),
                      "threads": torch.get_num_threads()}), flush=True)


def measure(model: str, dtype: str, isa: str | None, threads: int, tokens: int, runs: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("ARMSERVE_ISA", None)
    if isa:
        env["ARMSERVE_ISA"] = isa
    out = subprocess.run(
        [sys.executable, __file__, "--worker", model, "--dtype", dtype, "--tokens", str(tokens), "--runs", str(runs)],
        capture_output=True, text=True, env=env, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3, help="timed generations per process")
    ap.add_argument("--rounds", type=int, default=2, help="before/after process pairs, alternating")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dtype, args.tokens, args.runs)
        return

    from peer_models import smollm2_gguf, tinyllama_hf

    models = [("SmolLM2-135M (GGUF, dequantized)", smollm2_gguf()), ("TinyLlama-1.1B shape (random)", tinyllama_hf())]
    load0 = load_average()
    # over 1 GiB, median of 5
    bw = measure_bandwidth("read", 2**30, reps=5, threads=args.threads)
    copy_bw = measure_bandwidth("copy", 2**30, reps=5, threads=args.threads)
    rows = []
    for label, path in models:
        res: dict[str, list[float]] = {"torch": [], "kernels": []}
        info = {}
        for _ in range(args.rounds):
            for name, isa in (("torch", "torch"), ("kernels", None)):
                r = measure(path, args.dtype, isa, args.threads, args.tokens, args.runs)
                res[name] += r["samples"]
                info[name] = r
        wb = info["kernels"]["weight_bytes"]
        limit = bw * 1e9 / wb
        before, after = statistics.median(res["torch"]), statistics.median(res["kernels"])
        rows.append((label, wb, before, after, limit, info["kernels"]["isa"], min(res["kernels"]), max(res["kernels"])))
        print(f"{label}: before {before:.1f} tok/s, after {after:.1f} tok/s ({info['kernels']['isa']}), "
              f"roofline {limit:.1f} tok/s -> {after / limit:.0%}", flush=True)

    lines = [
        "## Decode: before and after the kernels, against the bandwidth roofline (issue: CPU kernels)",
        "",
        f"Machine: {machine_description()}. {args.threads} thread(s), {args.dtype}, batch 1, greedy, "
        f"{args.tokens} tokens, prefill excluded; median of {args.rounds * args.runs} generations in {args.rounds} "
        f"alternating process pairs; load average {load0:.2f} before / {load_average():.2f} after. "
        f"Read bandwidth (sum over 1 GiB, {args.threads} threads): **{bw:.1f} GB/s**; copy bandwidth (1 GiB "
        f"tensor copy, bytes read + written): {copy_bw:.1f} GB/s. armserve rev `{git_revision()}`.",
        "",
        "Roofline = read bandwidth / weight bytes per token (every weight is read once per token, counted "
        "from the checkpoint in the compute dtype; an untied input embedding only by the row a step reads; "
        "the KV cache is negligible at this length). The read bandwidth is the stricter of the two: decode only reads "
        "weights, and a plain read streams faster than a copy here. Before = `ARMSERVE_ISA=torch` (PyTorch path: oneDNN matmuls, "
        "gather + SDPA attention), after = C++ kernels (attention, norms, RoPE, activations, and the skinny "
        "bf16 matmul for decode), with decode steps replayed from step graphs (engine/step_graph.py). "
        "Weights dense bfloat16 (the GGUF dequantized).",
        "",
        "| model | weights | before tok/s | after tok/s (min-max) | kernels | roofline tok/s | after / roofline |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, wb, before, after, limit, isa, lo, hi in rows:
        lines.append(f"| {label} | {wb / 2**20:.0f} MiB | {before:.1f} | {after:.1f} ({lo:.1f}-{hi:.1f}) | {isa} "
                     f"| {limit:.1f} | {after / limit:.0%} |")
    lines += ["", f"Reproduce: `python benchmarks/bench_decode.py --threads {args.threads}`"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("decode", text)


if __name__ == "__main__":
    main()
