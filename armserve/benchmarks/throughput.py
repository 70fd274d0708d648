"""`armserve bench throughput`: offline throughput of the engine on N prompts at once.

All prompts go into one `LLM.generate` (the engine batches them under its own limits); the wall
time covers prefill and decode. Prompts are random words of set lengths (or a prompt file), sent
as token ids so their length is exact. Besides request, total and output tok/s, the mean
per-request decode speed is shown as a percentage of the machine's bandwidth limit: a batched
step reads the weights once, so no request can decode faster than that limit.
"""

from __future__ import annotations

import argparse
import json
import os


def add_cli_args(p: argparse.ArgumentParser) -> None:
    from armserve.engine_args import add_engine_args

    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: bundled SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from len * [1 - r, 1 + r]")
    p.add_argument("--dataset-path", default=None, help="prompt file instead of random prompts")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false", help="skip the bandwidth measurement")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)


def main(args: argparse.Namespace) -> int:
    import torch

    from armserve.benchmarks import roofline as rl
    from armserve.benchmarks.datasets import file_requests, random_requests
    from armserve.benchmarks.timing import request_decode_tok_s, timed
    from armserve.engine_args import engine_kwargs
    from armserve.llm import LLM
    from armserve.model_loader import bundled_model_path
    from armserve.sampling_params import SamplingParams

    if args.threads:
        # the engine keeps its own thread count unless OMP_NUM_THREADS names one (cpu.init_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    model = args.model or bundled_model_path()
    llm = LLM(model, **engine_kwargs(args))
    tok = llm.get_tokenizer()
    seed = llm.llm_engine.config.seed  # (--seed, or the engine's default)
    if args.dataset_path:
        reqs = file_requests(tok, args.dataset_path, args.num_prompts, args.output_len, args.input_len)
    else:
        reqs = random_requests(tok, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                               seed=seed)
    prompts = [{"prompt_token_ids": tok.encode(r.prompt, add_special_tokens=False)} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:1], params[0].clone(max_tokens=2), use_tqdm=False)  # warm-up
    outs, elapsed = timed(lambda: llm.generate(prompts, params, use_tqdm=True))
    n_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    speeds = [s for s in map(request_decode_tok_s, outs) if s is not None]
    mean_decode = sum(speeds) / len(speeds) if speeds else 0.0
    res = {"model": model, "num_prompts": len(reqs), "elapsed_s": elapsed, "total_input_tokens": n_in,
           "total_output_tokens": n_out, "requests_per_s": len(reqs) / elapsed,
           "total_tokens_per_s": (n_in + n_out) / elapsed, "output_tokens_per_s": n_out / elapsed,
           "mean_request_decode_tok_s": mean_decode}
    print(f"Throughput: {res['requests_per_s']:.2f} requests/s, {res['total_tokens_per_s']:.2f} total tokens/s, "
          f"{res['output_tokens_per_s']:.2f} output tokens/s ({len(reqs)} prompts, {n_in} in, {n_out} out, "
          f"{elapsed:.1f} s)")
    if args.roofline:
        roof = rl.measure_roofline(torch.get_num_threads())  # with the threads the engine used
        wbytes = rl.module_weight_bytes(llm.llm_engine.model)
        limit = rl.bandwidth_limit(wbytes, roof)
        res.update(roofline=roof, weight_bytes=wbytes, bw_limit_tok_s=limit,
                   decode_pct_of_bw_limit=100 * mean_decode / limit)
        print(f"Roofline: {rl.describe(roof)}; weights {wbytes / 1e6:.1f} MB per step -> one request decodes "
              f"at most {limit:.1f} tok/s; mean per-request decode {mean_decode:.1f} tok/s = "
              f"{res['decode_pct_of_bw_limit']:.1f} % of it")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
