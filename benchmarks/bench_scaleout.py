"""Scale-out on one machine (issue 16): one engine computing on every core against data-parallel
engines (one per core) and, where the build has it, tensor parallel ranks (one per core), measured
by vLLM's own `bench serve` client on the same bf16 weights.

    python benchmarks/bench_scaleout.py                       # SmolLM2 and Qwen2.5-Coder-0.5B, 1 and 32 in flight
    python benchmarks/bench_scaleout.py --models smollm2 --concurrency 1 32 64

Per model and layout: random 128-token prompts, 64 output tokens (`ignore_eos`), greedy, at each
concurrency. The client shares the machine's cores with the server here (every layout uses all of
them), so the absolute figures carry its cost; the ratios between layouts are what this measures.
Results go to benchmarks/results/scaleout/ and the "scaleout" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peers  # noqa: E402
from bench_batched import MAX_MODEL_LEN, MODELS, SERVED, run_client  # noqa: E402
from report import git_revision, machine_description, update_section  # noqa: E402

RESULTS = os.path.join(HERE, "results", "scaleout")


def cores() -> list[int]:
    sys.path.insert(0, os.path.dirname(HERE))
    from armserve.cpu import physical_cores

    return physical_cores()


def has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "armserve.cli", "serve", "--help"], capture_output=True, text=True)
    return flag in out.stdout


def layouts() -> dict[str, tuple[list[str], dict[str, str], str]]:
    """layout -> (extra serve flags, environment, description)."""
    cs = cores()
    all_cores = ",".join(map(str, cs))
    out = {
        "1 engine": ([], {"ARMSERVE_THREADS_BIND": all_cores},
                     f"one engine, {len(cs)} threads pinned to cores {all_cores}"),
        "DP": (["--data-parallel-size", str(len(cs))], {"ARMSERVE_THREADS_BIND": "|".join(map(str, cs))},
               f"{len(cs)} data-parallel engines, 1 thread each, one core each"),
    }
    if has_flag("--tensor-parallel-size"):
        out["TP"] = (["--tensor-parallel-size", str(len(cs))], {"ARMSERVE_THREADS_BIND": "|".join(map(str, cs))},
                     f"{len(cs)} tensor-parallel ranks, 1 thread each, one core each")
    return out


def run(models: list[str], concurrency: list[int], out_dir: str) -> dict[str, Any]:
    client_py = peers.install_vllm()
    results: dict[str, Any] = {}
    for model in models:
        hf = MODELS[model]["hf"]()
        results[model] = {}
        for name, (flags, env, desc) in layouts().items():
            port = peers.free_port()
            spec = peers.ServerSpec(
                f"armserve {name}",
                [sys.executable, "-m", "armserve.cli", "serve", hf, "--host", "127.0.0.1", "--port", str(port),
                 "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-space", "1",
                 "--served-model-name", SERVED, "--disable-log-stats", "--disable-access-log",
                 "--uvicorn-log-level", "warning", *flags],
                dict(env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"), desc, hf, None)
            res: dict[str, Any] = {"desc": desc, "runs": {}}
            results[model][name] = res
            print(f"== {model} / {name}: starting server", flush=True)
            try:
                server = peers.Server(spec, port, os.path.join(out_dir, f"{model}-{name.replace(' ', '_')}.log"))
            except peers.PeerUnavailable as e:
                res["error"] = str(e)[-400:]
                print(res["error"], flush=True)
                continue
            try:
                tag = f"{model}-{name.replace(' ', '_')}"
                run_client(client_py, hf, server.url, out_dir, f"{tag}-warmup", 128, 16, 4, 4)
                for c in concurrency:
                    n = max(16, 2 * c) if c > 1 else 12
                    res["runs"][f"c{c}"] = run_client(client_py, hf, server.url, out_dir, f"{tag}-c{c}", 128, 64, n, c)
            except subprocess.CalledProcessError as e:
                res["error"] = f"client failed: {e}"
            finally:
                server.stop()
    return results


def section(results: dict[str, Any], concurrency: list[int], cmdline: str) -> str:
    lines = ["## Scale-out on one machine: one engine vs data-parallel engines (issue 16)", "",
             f"Machine: {machine_description()}. armserve rev `{git_revision()}`. Client: vLLM's "
             "`vllm.benchmarks.serve` (random 128-token prompts, 64 output tokens, `ignore_eos`, greedy), sharing the "
             "cores with the server (every layout computes on all of them). Figures: output tok/s (median TTFT / TPOT "
             "ms, load average before the run).", ""]
    for model, per_layout in results.items():
        names = list(per_layout)
        lines += [f"### {MODELS[model]['title']}", ""]
        lines += ["| layout | settings |", "|---|---|"] + [f"| {n} | {per_layout[n]['desc']} |" for n in names] + [""]
        lines += ["| concurrency | " + " | ".join(names) + " | " + " | ".join(f"{n} / 1 engine" for n in names[1:]) + " |",
                  "|---|" + "---|" * (2 * len(names) - 1)]
        for c in concurrency:
            cells, tps = [], {}
            for n in names:
                d = per_layout[n]["runs"].get(f"c{c}")
                if d is None:
                    cells.append("failed" if "error" in per_layout[n] else "n/a")
                    continue
                tps[n] = d["output_throughput"]
                cells.append(f"{d['output_throughput']:.0f} ({d['median_ttft_ms']:.0f} / {d['median_tpot_ms']:.1f}, "
                             f"{d['load_before']:.2f})")
            base = tps.get(names[0])
            ratios = [f"{tps[n] / base:.2f}x" if base and n in tps else "n/a" for n in names[1:]]
            lines.append(f"| {c} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        for n in names:
            if "error" in per_layout[n]:
                lines += ["", f"{n}: {per_layout[n]['error'][-300:]}"]
        lines.append("")
    lines += [f"Reproduce: `python benchmarks/bench_scaleout.py {cmdline}`"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    out_dir = os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    results = run(args.models.split(","), args.concurrency, out_dir)
    text = section(results, args.concurrency, " ".join(sys.argv[1:]))
    print(text)
    with open(os.path.join(out_dir, "section.md"), "w") as f:
        f.write(text)
    if not args.no_write:
        update_section("scaleout", text)


if __name__ == "__main__":
    main()
