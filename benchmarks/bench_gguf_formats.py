"""GGUF weight formats: Q6_K and Q8_0 held at their file sizes (W6, W8H) against the int8 tiles with
float32 scales they were held in before (W8), on the same file.

Qwen2.5-Coder-0.5B-Instruct Q4_K_M (MODELS.md; its 12 Q6_K down projections and its tied Q8_0 LM
head), 1 thread: the packed bytes of each format's layers, and greedy decode tok/s at 1 and 4
sequences (prefill excluded: the time of 65 tokens minus that of 1, the median of 3). Each
configuration runs in its own process; rounds alternate the order. The "before" configuration
loads the file with Q6_K / Q8_0 converted to W8, as armserve did up to rev a0f8fd8 (the same
codes and scales: the outputs are the same bits). Writes the "gguf-formats" section of
docs/benchmarks.md.

    python benchmarks/bench_gguf_formats.py [--rounds 4] [--no-write]
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

from peer_models import qwen_gguf  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

BATCHES = (1, 4)
NEW_TOKENS = 64

# One configuration in a fresh process: prints {"bytes": {fmt: packed bytes}, "tok_s": {batch: tok/s}}.
CHILD = r'''
import json, sys, time
from armserve import LLM, SamplingParams
from armserve.quantization import QuantizedLinear, gguf

if sys.argv[1] == "before":  # Q6_K and Q8_0 as W8 tiles with float32 scales (the same codes and scales)
    q6, q8 = gguf._q6_k, gguf._q8_0
    gguf._CONVERTERS["Q6_K"] = lambda d: q6(d).as_w8()
    gguf._CONVERTERS["Q8_0"] = lambda d: q8(d).as_w8()
llm = LLM(sys.argv[2], max_model_len=2048, kv_cache_space=0.1)
nbytes = {}
for m in llm.llm_engine.model.modules():
    if isinstance(m, QuantizedLinear):
        for p in m.parts:
            nbytes[p.fmt] = nbytes.get(p.fmt, 0) + p.packed.numel()
new = int(sys.argv[3])
tok_s = {}
for bs in json.loads(sys.argv[4]):
    prompts = [{"prompt_token_ids": list(range(100 + i, 116 + i))} for i in range(bs)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True)
    llm.generate(prompts, full, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, full, use_tqdm=False)
        t2 = time.perf_counter()
        runs.append(new * bs / ((t2 - t1) - (t1 - t0)))
    tok_s[bs] = sorted(runs)[1]
print(json.dumps({"bytes": nbytes, "tok_s": tok_s}))
'''


def run(kind: str, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, model, str(NEW_TOKENS), json.dumps(BATCHES)],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--no-write", action="store_true", help="print the section instead of writing the doc")
    args = ap.parse_args()
    model = qwen_gguf()
    load_before = load_average()
    got: dict[str, list[dict]] = {"now": [], "before": []}
    for r in range(args.rounds):
        for kind in ("now", "before") if r % 2 == 0 else ("before", "now"):
            got[kind].append(run(kind, model))
            print(kind, got[kind][-1], flush=True)
    mib = {k: {f: b / 2**20 for f, b in got[k][0]["bytes"].items()} for k in got}
    speed = {k: {bs: statistics.median(g["tok_s"][str(bs)] for g in got[k]) for bs in BATCHES} for k in got}
    rows = ["| configuration | quantized layers' packed MiB (by format) | total MiB | "
            + " | ".join(f"decode tok/s, {bs} seq" for bs in BATCHES) + " |",
            "|---|---|---|" + "---|" * len(BATCHES)]
    for k, label in (("now", "Q6_K as W6, Q8_0 as W8H (file sizes)"), ("before", "Q6_K, Q8_0 as W8 (float32 scales)")):
        by = ", ".join(f"{f} {v:.1f}" for f, v in sorted(mib[k].items()))
        rows.append(f"| {label} | {by} | {sum(mib[k].values()):.1f} | "
                    + " | ".join(f"{speed[k][bs]:.1f}" for bs in BATCHES) + " |")
    ratios = ", ".join(f"{bs} seq {speed['now'][bs] / speed['before'][bs]:.3f}x" for bs in BATCHES)
    body = "\n".join([
        "## GGUF weight formats: Q6_K and Q8_0 at their file sizes (issue 35)",
        "",
        f"Machine: {machine_description()}. Load average {load_before:.2f} before / {load_average():.2f} after. "
        f"armserve rev `{git_revision()}`. Qwen2.5-Coder-0.5B-Instruct Q4_K_M, 1 thread, greedy decode of "
        f"{NEW_TOKENS} tokens after 16 (prefill excluded), median of 3 per process, median over {args.rounds} "
        "processes per configuration in alternating order. \"Before\" loads the same file with Q6_K / Q8_0 as "
        "the W8 tiles armserve held them in up to rev a0f8fd8 (same codes and scales, same output bits).",
        "",
        *rows,
        "",
        f"Decode speed, file sizes against W8: {ratios}.",
        "",
        "Command: `python benchmarks/bench_gguf_formats.py`.",
    ])
    if args.no_write:
        print(body)
    else:
        update_section("gguf-formats", body)
        print(body)


if __name__ == "__main__":
    main()
