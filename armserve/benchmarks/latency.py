"""`armserve bench latency`: batch-1 TTFT and decode speed of the offline engine, over prompt lengths.

For each prompt length: one random prompt of exactly that many tokens, greedy, `ignore_eos`, run
`--num-iters` times after `--num-iters-warmup`; TTFT is arrival to first token, decode speed is
(N - 1) tokens over first-to-last token time (prefill excluded). Each decode speed is also shown
as a percentage of this machine's bandwidth limit (weight bytes per step / copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from armserve.engine_args import add_engine_args

    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: bundled SmolLM2)")
    p.add_argument("--input-lens", default="32,128,512", help="comma-separated prompt lengths in tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false", help="skip the bandwidth measurement")
    p.add_argument("--output-json", default=None, help="write the results here")
    add_engine_args(p)


def random_token_prompt(tokenizer, n: int, seed: int) -> list[int]:
    """`n` token ids of random words (token ids go to the engine as they are, so the length is exact)."""
    from armserve.benchmarks.datasets import random_requests

    text = random_requests(tokenizer, 1, n, 1, seed=seed)[0].prompt
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def main(args: argparse.Namespace) -> int:
    import torch

    from armserve.benchmarks import roofline as rl
    from armserve.benchmarks.timing import median_min_max, request_decode_tok_s
    from armserve.engine_args import engine_kwargs
    from armserve.llm import LLM
    from armserve.model_loader import bundled_model_path
    from armserve.sampling_params import SamplingParams

    if args.threads:
        # the engine keeps its own thread count unless OMP_NUM_THREADS names one (cpu.init_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    input_lens = [int(x) for x in args.input_lens.split(",") if x.strip()]
    if not input_lens or min(input_lens) < 1:
        raise ValueError(f"--input-lens must be positive integers, got {args.input_lens!r}")
    if args.output_len < 2:
        raise ValueError("--output-len must be >= 2 (decode speed needs two tokens)")
    if args.num_iters < 1:
        raise ValueError("--num-iters must be >= 1")
    model = args.model or bundled_model_path()
    llm = LLM(model, **engine_kwargs(args))
    roof = rl.measure_roofline(torch.get_num_threads()) if args.roofline else None  # the engine's threads
    wbytes = rl.module_weight_bytes(llm.llm_engine.model)
    limit = rl.bandwidth_limit(wbytes, roof) if roof else None
    if roof:
        print(f"Roofline: {rl.describe(roof)}; weights {wbytes / 1e6:.1f} MB per step -> "
              f"bandwidth limit {limit:.1f} tok/s at batch 1", flush=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    print(f"{'input':>6} {'TTFT ms (min-max)':>24} {'decode tok/s (min-max)':>26} {'% bw limit':>10}", flush=True)
    for n in input_lens:
        prompt = random_token_prompt(llm.get_tokenizer(), n, seed=n)
        ttfts, speeds = [], []
        for i in range(args.num_iters_warmup + args.num_iters):
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            m = out.metrics
            if i < args.num_iters_warmup:
                continue
            ttfts.append((m.first_token_time - m.arrival_time) * 1000)
            speeds.append(request_decode_tok_s(out))
        row = {"input_len": n, "output_len": args.output_len,
               "ttft_ms": dict(zip(("median", "min", "max"), median_min_max(ttfts))),
               "decode_tok_s": dict(zip(("median", "min", "max"), median_min_max(speeds)))}
        pct = 100 * row["decode_tok_s"]["median"] / limit if limit else None
        row["decode_pct_of_bw_limit"] = pct
        rows.append(row)
        t, d = row["ttft_ms"], row["decode_tok_s"]
        print(f"{n:>6} {t['median']:>9.1f} ({t['min']:.1f}-{t['max']:.1f}) {d['median']:>11.1f} "
              f"({d['min']:.1f}-{d['max']:.1f}) {(f'{pct:.1f} %' if pct is not None else 'n/a'):>10}", flush=True)
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "dtype": str(llm.llm_engine.dtype), "threads": torch.get_num_threads(),
                       "weight_bytes": wbytes, "roofline": roof, "results": rows}, f, indent=1)
    return 0
