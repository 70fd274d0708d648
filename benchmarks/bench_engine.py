"""Offline engine benchmark: armserve vs plain transformers on the same model, same run.

Measures, per dtype:
  - batch-1 decode tok/s: (N - 1) generated tokens over the time between the first and the last
    token (prefill excluded), greedy, `ignore_eos`, the same prompt for both systems;
  - aggregate tok/s with 16 concurrent requests (armserve: 16 prompts in one `generate`;
    transformers: one left-padded batch of 16 in `generate`), wall time including prefill.
Runs alternate between the systems; each figure is the median of `--runs` runs after a warm-up,
with the spread (min-max) beside it. Writes the "engine" section of docs/benchmarks.md.

    python benchmarks/bench_engine.py            # bundled SmolLM2, float32 and bfloat16, 1 thread
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from report import git_revision, load_average, machine_description, update_section  # noqa: E402

from armserve.benchmarks.timing import (  # noqa: E402
    decode_tok_s_by_difference,
    median_min_max,
    request_decode_tok_s,
    timed,
)

PROMPT = "Write a short story about a robot who learns to paint. Once upon a time"


class Armserve:
    """armserve on the same dense weights as transformers (a GGUF is dequantized)."""

    name = "armserve"
    quantization: str | None = "none"

    def __init__(self, model: str, dtype: str) -> None:
        from armserve import LLM

        self.llm = LLM(model, dtype=dtype, kv_cache_space=1, max_model_len=2048, quantization=self.quantization)


    def decode_tps(self, n: int) -> float:
        from armserve import SamplingParams

        return request_decode_tok_s(self.llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0])

    def batch_tps(self, n: int, batch: int) -> float:
        from armserve import SamplingParams

        prompts = [f"{PROMPT} (story {i})" for i in range(batch)]
        outs, dt = timed(lambda: self.llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False))
        return sum(len(o.outputs[0].token_ids) for o in outs) / dt


class ArmserveNative(Armserve):
    """armserve's default for a GGUF: its quantized blocks run as w4a8/w8a8 (not like for like)."""

    name = "armserve (GGUF kept quantized)"
    quantization = None


class Transformers:
    name = "transformers"

    def __init__(self, model: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        folder, name = (os.path.split(model) if model.endswith(".gguf") else (model, None))
        kw = {"gguf_file": name} if name else {}
        self.tok = AutoTokenizer.from_pretrained(folder, **kw)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
        self.model = m.to(getattr(torch, dtype)).eval()

    def _gen(self, prompts: list[str], n: int) -> float:
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            return timed(lambda: self.model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                     pad_token_id=self.tok.pad_token_id))[1]

    def decode_tps(self, n: int) -> float:
        # Prefill excluded by difference: time(n tokens) - time(1 token) covers n - 1 decode steps.
        return decode_tok_s_by_difference(lambda k: self._gen([PROMPT], k), n - 1)

    def batch_tps(self, n: int, batch: int) -> float:
        prompts = [f"{PROMPT} (story {i})" for i in range(batch)]
        return batch * n / self._gen(prompts, n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: bundled SmolLM2)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md alone")
    args = ap.parse_args()

    from armserve.model_loader import bundled_model_path

    model = args.model or bundled_model_path()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes.split(","):
        systems = [Armserve(model, dtype), Transformers(model, dtype)]
        if model.endswith(".gguf"):
            systems.append(ArmserveNative(model, dtype))
        for s in systems:  # warm-up
            s.decode_tps(8)
            s.batch_tps(8, 2)
        dec: dict[str, list[float]] = {s.name: [] for s in systems}
        bat: dict[str, list[float]] = {s.name: [] for s in systems}
        loads = []
        for _ in range(args.runs):
            for s in systems:  # alternate systems run by run
                loads.append(load_average())
                dec[s.name].append(s.decode_tps(args.tokens))
                bat[s.name].append(s.batch_tps(args.tokens, args.batch))
        for s in systems:
            d, b = median_min_max(dec[s.name]), median_min_max(bat[s.name])
            rows.append((dtype, s.name, d, b))
            print(f"{dtype:9s} {s.name:13s} batch-1 decode {d[0]:7.1f} tok/s ({d[1]:.1f}-{d[2]:.1f})   "
                  f"{args.batch} concurrent {b[0]:7.1f} tok/s ({b[1]:.1f}-{b[2]:.1f})", flush=True)
        del systems

    by = {(r[0], r[1]): r for r in rows}
    lines = [
        "## Engine: armserve vs transformers, offline (issue: engine core)",
        "",
        f"Machine: {machine_description()}. Model: `{os.path.basename(model)}`. "
        f"{args.threads} thread(s) for both systems, greedy, {args.tokens} tokens, `ignore_eos`; "
        f"median of {args.runs} alternating runs after a warm-up (min-max in brackets); "
        f"load average during the runs {min(loads):.2f}-{max(loads):.2f}. armserve rev `{git_revision()}`.",
        "",
        "armserve and transformers run the same dense weights (the GGUF dequantized); the extra armserve row "
        "is its default for a GGUF (blocks kept quantized, int8 activations), shown for reference only. "
        "Batch-1 decode excludes prefill (armserve: first-to-last token time; transformers: time of N tokens minus "
        f"time of 1). {args.batch} concurrent is wall time including prefill (armserve: {args.batch} prompts in one "
        f"`LLM.generate`; transformers: one left-padded batch in `generate`).",
        "",
        f"| dtype | system | batch-1 decode tok/s | {args.batch} concurrent tok/s | concurrent / own batch-1 |",
        "|---|---|---|---|---|",
    ]
    for dtype, name, d, b in rows:
        lines.append(f"| {dtype} | {name} | {d[0]:.1f} ({d[1]:.1f}-{d[2]:.1f}) | {b[0]:.1f} ({b[1]:.1f}-{b[2]:.1f}) "
                     f"| {b[0] / d[0]:.1f}x |")
    lines += ["", "| dtype | batch-1 ratio armserve / transformers | concurrent ratio armserve / transformers |",
              "|---|---|---|"]
    for dtype in args.dtypes.split(","):
        a, t = by[(dtype, "armserve")], by[(dtype, "transformers")]
        lines.append(f"| {dtype} | {a[2][0] / t[2][0]:.2f}x | {a[3][0] / t[3][0]:.2f}x |")
    cmd = "python benchmarks/bench_engine.py" + (f" --model {args.model}" if args.model else "") + (
        f" --dtypes {args.dtypes}" if args.dtypes != "float32,bfloat16" else "") + (
        f" --threads {args.threads}" if args.threads != 1 else "")
    lines += ["", f"Reproduce: `{cmd}`"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("engine", text)


if __name__ == "__main__":
    main()
