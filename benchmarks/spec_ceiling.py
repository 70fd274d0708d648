"""The most any prompt-lookup drafter could gain on bench_spec's batch-1 prompts, on this CPU.

    python benchmarks/spec_ceiling.py [--model smollm2|qwen]   # ARMSERVE_ISA=avx2 for the AVX2 kernels

What can be drafted depends on the greedy answer the model writes on this CPU's kernels (near-ties
resolve differently on other ones). For each prompt this prints:
- the answer's tokens and how many verification steps an oracle lookup drafter needs: at each step
  it drafts the longest continuation (up to 16 tokens) that the context's last 2-5 tokens have
  anywhere earlier in the prompt or the answer, and every drafted token that matches is accepted;
  tokens / steps is the ceiling with verification free;
- the same with each step costing what a step of that many rows costs here: decode and verify
  steps timed by row count while the engine runs the prompts with suffix decoding (rows it never
  verified are interpolated linearly between the nearest timed ones). That ceiling is what the
  kernels' cost of a verify row allows, whatever the drafter.
One process, 1 thread, the GGUF kept quantized, as bench_spec.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_spec  # noqa: E402
import peer_models  # noqa: E402

MAX_DRAFT = 16  # (num_speculative_tokens allows 16; suffix decoding drafts up to 12 a step at its default depth)


def oracle_steps(context: list[int], answer: list[int]) -> list[int]:
    """Rows of each verification step (1 + accepted drafts) of the oracle lookup drafter."""
    steps, i = [], 0
    full = context + answer  # (at each step only its first len(context) + i tokens are known)
    while i < len(answer):
        known = len(context) + i
        best = 0
        for n in range(5, 1, -1):
            tail = full[known - n:known]
            for s in range(known - n):
                if full[s:s + n] == tail:
                    m = 0
                    while m < MAX_DRAFT and i + m < len(answer) and full[s + n + m] == answer[i + m]:
                        m += 1
                    best = max(best, m)
            if best:
                break
        steps.append(min(best + 1, len(answer) - i))
        i += best + 1
    return steps


def row_costs(times: dict[int, list[float]], most: int) -> dict[int, float]:
    """Median step time by row count, relative to one row; missing counts interpolated."""
    med = {n: statistics.median(v) for n, v in times.items() if v and n <= most}
    base = med[1]
    known = sorted(med)
    out = {}
    for n in range(1, most + 1):
        if n in med:
            out[n] = med[n] / base
            continue
        lo = max((k for k in known if k < n), default=1)
        hi = min((k for k in known if k > n), default=None)
        if hi is None:  # beyond the longest verify timed: the last extra row's cost, extended
            prev = max((k for k in known if k < lo), default=1)
            slope = (med[lo] - med[prev]) / max(lo - prev, 1)
            out[n] = (med[lo] + slope * (n - lo)) / base
        else:
            out[n] = (med[lo] + (med[hi] - med[lo]) * (n - lo) / (hi - lo)) / base
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["smollm2", "qwen"], default="qwen")
    p.add_argument("--edit-max-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args()
    from armserve import LLM, SamplingParams, kernels

    path = peer_models.smollm2_gguf() if args.model == "smollm2" else peer_models.qwen_gguf(install=False)
    if not path:
        print("the Qwen2.5-Coder GGUF is not installed (benchmarks/peer_models.py)", file=sys.stderr)
        return 1
    llm = LLM(path, max_model_len=2048, kv_cache_space=1, enable_prefix_caching=False,
              speculative_config=bench_spec.SUFFIX)
    llm.llm_engine.backend.warm_up()
    bench_spec.batch1(llm, "Say hello.", 8)
    runner = llm.llm_engine.backend.runner
    times: dict[int, list[float]] = collections.defaultdict(list)
    execute = runner.execute

    def timed(out):
        t = time.perf_counter()
        r = execute(out)
        times[sum(s.num_new_tokens for s in out.scheduled)].append(time.perf_counter() - t)
        return r

    runner.execute = timed
    answers = {}
    for kind, prompt in bench_spec.PROMPTS.items():
        mt = args.edit_max_tokens if kind == "code editing" else args.max_tokens
        out = llm.chat([{"role": "user", "content": prompt}], SamplingParams(temperature=0, max_tokens=mt),
                       use_tqdm=False)[0]
        answers[kind] = (list(out.prompt_token_ids), list(out.outputs[0].token_ids))
    cost = row_costs(times, MAX_DRAFT + 1)
    print(f"{os.path.basename(path)}, kernels {kernels.isa()}: a step of n rows costs, in one-row steps: "
          + ", ".join(f"{n}: {c:.2f}" for n, c in cost.items())
          + f" (timed: {', '.join(str(n) for n in sorted(times) if n <= MAX_DRAFT + 1)})")
    for kind, (context, answer) in answers.items():
        steps = oracle_steps(context, answer)
        free = len(answer) / len(steps)
        costed = len(answer) / sum(cost[n] for n in steps)
        print(f"{kind}: {len(answer)} tokens, {len(steps)} steps with an oracle lookup drafter: ceiling "
              f"{free:.2f}x with verification free, {costed:.2f}x at this CPU's verify-row costs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
