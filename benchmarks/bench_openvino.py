"""The OpenVINO backend against armserve's own (torch) backend: TTFT and output tok/s at 1, 8 and 32
concurrent streams, the same model, dtype, threads and request shapes (`armserve bench serve`).

    nice -n 19 python benchmarks/bench_openvino.py MODEL_FOLDER --threads 1 --out results/openvino

Each backend is served in turn by `armserve serve MODEL --backend B`; the table is printed and
written to OUT/table.md (docs/benchmarks.md quotes it). vLLM CPU is left to benchmarks/peers.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, backend: str, dtype: str, threads: int, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), ARMSERVE_LOG_STATS_INTERVAL="60")
    cmd = [sys.executable, "-m", "armserve.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--backend", backend, "--dtype", dtype, "--kv-cache-space", "1", "--disable-access-log"]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{backend} server exited; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"{backend} server did not come up; see {log}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a Hugging Face folder (exported to OpenVINO IR on first use)")
    p.add_argument("--backends", nargs="+", default=["openvino", "torch"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/openvino")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for backend in args.backends:
        proc, url = serve(args.model, backend, args.dtype, args.threads, os.path.join(args.out, f"{backend}.log"))
        try:
            for conc in args.concurrency:
                name = f"{backend}-c{conc}.json"
                subprocess.run([sys.executable, "-m", "armserve.cli", "bench", "serve", "--base-url", url,
                                "--tokenizer", args.model, "--model", args.model, "--dataset-name", "random",
                                "--num-prompts", str(max(4, 2 * conc)), "--input-len", str(args.input_len),
                                "--output-len", str(args.output_len), "--ignore-eos", "--request-rate", "inf",
                                "--max-concurrency", str(conc), "--save-result", "--result-dir", args.out,
                                "--result-filename", name, "--disable-tqdm", "--seed", "0"],
                               check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(args.out, name)) as f:
                    m = json.load(f)
                rows.append((backend, conc, m["mean_ttft_ms"], m["median_ttft_ms"], m["output_throughput"]))
        finally:
            proc.terminate()
            proc.wait(30)
    lines = [f"{os.path.basename(args.model.rstrip('/'))}, {args.dtype}, {args.threads} thread(s), "
             f"{args.input_len} in / {args.output_len} out tokens, random prompts, all at once under the cap",
             "", "| backend | concurrent | mean TTFT (ms) | median TTFT (ms) | output tok/s |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {b} | {c} | {mt:.0f} | {md:.0f} | {tp:.1f} |" for b, c, mt, md, tp in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
