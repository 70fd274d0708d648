"""Serving comparison: armserve against vLLM CPU, llama.cpp's llama-server and transformers' own
server, the same `armserve bench serve` sweep against each, one after another, in one run.

    python benchmarks/compare.py                       # both models, every system (installs peers)
    python benchmarks/compare.py --models smollm2 --systems armserve,llama.cpp-bf16

Peers install on first use under ~/.cache/armserve-peers (see peers.py); models are made once
under ~/.cache/armserve-peers/models (see peer_models.py). Every server gets the same model
weights, listens on loopback, computes with `--threads` threads (the client runs on the other
core), and sees the same prompts: random words of exactly `--input-len` tokens, greedy,
`ignore_eos` with exactly `--output-len` tokens out. Results go to benchmarks/results/serve/,
plots to docs/, and the "serving" section of docs/benchmarks.md gets tables of ratios
armserve / peer, the settings of every system and what differs between them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import peer_models as pm  # noqa: E402
import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

RESULTS = os.path.join(HERE, "results", "serve")
DOCS = os.path.join(REPO, "docs")

# Per model: what the systems load, and a sweep sized to finish in minutes on 1 core per server.
MODELS: dict[str, dict[str, Any]] = {
    "smollm2": dict(title="SmolLM2-135M-Instruct", hf=pm.smollm2_hf,
                    ggufs={"llama.cpp-bf16": pm.smollm2_bf16_gguf, "llama.cpp-q4_1": pm.smollm2_gguf},
                    num_prompts=32, input_len=128, output_len=64, rates=[1.0, 2.0, 4.0], concurrency=8),
    "tinyllama": dict(title="TinyLlama-1.1B-shaped Llama, random weights", hf=pm.tinyllama_hf,
                      ggufs={"llama.cpp-bf16": pm.tinyllama_gguf},
                      num_prompts=12, input_len=128, output_len=32, rates=[0.25, 0.5, 1.0], concurrency=4),
}
SYSTEMS = ["armserve", "vllm", "llama.cpp-bf16", "llama.cpp-q4_1", "transformers"]
MAX_MODEL_LEN = 512
LLAMA_SLOTS = 16  # llama-server's parallel sequences; each gets MAX_MODEL_LEN of context


def server_spec(system: str, model: str, hf: str, threads: int, port: int) -> peers.ServerSpec:
    """Install the system if needed and say how to start it on `port` for `model`."""
    common = dict(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if system == "armserve":
        import armserve

        return peers.ServerSpec(
            "armserve",
            [sys.executable, "-m", "armserve.cli", "serve", hf, "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-space", "1",
             "--disable-log-stats", "--disable-access-log", "--uvicorn-log-level", "warning"],
            common, f"bfloat16, {threads} thread(s) (OMP_NUM_THREADS), max-model-len {MAX_MODEL_LEN}, "
                    "KV cache 1 GiB, max-num-seqs 256 (default), prefix caching on (default)",
            hf, "bfloat16", served_model=hf, version=f"armserve {armserve.__version__} rev {git_revision()}")
    if system == "vllm":
        py = peers.install_vllm()
        return peers.ServerSpec(
            "vllm",
            [py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--dtype", "bfloat16",
             "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
             "--disable-uvicorn-access-log"],
            dict(common, VLLM_CPU_KVCACHE_SPACE="1"),
            f"bfloat16, max-model-len {MAX_MODEL_LEN}, VLLM_CPU_KVCACHE_SPACE=1 (GiB), its own thread binding "
            "(on 2 cores it computes on 1 and keeps 1 for its front end), default scheduler limits, "
            "prefix caching on (default)",
            hf, "bfloat16", served_model=hf, version=f"vllm-cpu {peers.version_of(py, 'vllm')}")
    if system.startswith("llama.cpp"):
        exe = peers.install_llama_server()
        gguf = MODELS[model]["ggufs"][system]()
        quant = "Q4_1 as shipped (some Q8_0/F32 tensors)" if system.endswith("q4_1") else "BF16 (norms F32)"
        extra = ["--no-repack"] if system.endswith("q4_1") else []  # Q8_0 repack segfaults in AMX here
        return peers.ServerSpec(
            system,
            [exe, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", str(LLAMA_SLOTS),
             "-c", str(LLAMA_SLOTS * MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port), *extra],
            common, f"GGUF {quant}, {threads} thread(s) (-t/-tb), {LLAMA_SLOTS} parallel slots (-np) of "
                    f"{MAX_MODEL_LEN} tokens (-c {LLAMA_SLOTS * MAX_MODEL_LEN}), prompt cache on (default)"
                    + (", --no-repack" if extra else ""),
            gguf, None, version="llama.cpp from llama-cpp-python sdist " + _sdist_version())
    if system == "transformers":
        py = peers.install_transformers()
        exe = os.path.join(os.path.dirname(py), "transformers")
        return peers.ServerSpec(
            "transformers",
            [exe, "serve", hf, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
             "--device", "cpu", "--log-level", "warning"],
            common, f"`transformers serve`, bfloat16, {threads} thread(s), no continuous batching "
                    "(its default: one request generates at a time), eager attention default",
            hf, "bfloat16", served_model=hf, ignore_eos_field=False,
            version=f"transformers {peers.version_of(py, 'transformers')}",
            notes=["rejects the `ignore_eos` field; the client sends a `generation_config` with "
                   "`min_new_tokens` = `max_new_tokens` = the output length instead, so it generates as many tokens"])
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def _sdist_version() -> str:
    found = sorted(glob.glob(os.path.join(peers.PEERS_DIR, "llama.cpp", "src", "llama_cpp_python-*.tar.gz")))
    return os.path.basename(found[-1])[len("llama_cpp_python-"):-len(".tar.gz")] if found else "?"


def run_sweep(spec: peers.ServerSpec, url: str, tokenizer: str, cfg: dict[str, Any], out_dir: str,
              roofline_file: str) -> list[str]:
    """Run the Poisson sweep and the fixed-concurrency run with `armserve bench serve`; return the JSONs."""
    base = [sys.executable, "-m", "armserve.cli", "bench", "serve", "--base-url", url, "--tokenizer", tokenizer,
            "--num-prompts", str(cfg["num_prompts"]), "--input-len", str(cfg["input_len"]),
            "--output-len", str(cfg["output_len"]), "--label", spec.label, "--save-result",
            "--result-dir", out_dir, "--roofline-file", roofline_file, "--weights", spec.weights,
            "--disable-tqdm", "--seed", "0"]
    if spec.weight_dtype:
        base += ["--weight-dtype", spec.weight_dtype]
    if spec.served_model:
        base += ["--model", spec.served_model]
    if spec.ignore_eos_field:
        base += ["--ignore-eos"]
    else:
        # transformers serve reads no `ignore_eos`; a generation_config with min_new_tokens pins the length.
        base += ["--extra-body", json.dumps({"generation_config": json.dumps(
            {"do_sample": False, "min_new_tokens": cfg["output_len"], "max_new_tokens": cfg["output_len"]})})]
    runs = [["--request-rate", *[f"{r:g}" for r in cfg["rates"]]],
            ["--request-rate", "inf", "--max-concurrency", str(cfg["concurrency"])]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for extra in runs:
        cmd = base + extra
        print("$ " + shlex.join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=env)
    return sorted(glob.glob(os.path.join(out_dir, f"{spec.label}-rate*.json")))


# ---- the document --------------------------------------------------------------------------------


def _point(d: dict[str, Any]) -> str:
    if d.get("max_concurrency"):
        return f"concurrency {d['max_concurrency']}"
    return f"{float(d['request_rate']):g} req/s"


def _ratio(a: float, b: float) -> str:
    if not b > 0:
        return "n/a"
    r = a / b
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"  # keep two significant digits of small ratios


def _complete(d: dict[str, Any]) -> bool:
    return d["failed"] == 0 and d["completed"] == d["num_prompts"]


def model_section(model: str, cfg: dict[str, Any], specs: dict[str, peers.ServerSpec],
                  results: dict[str, list[dict[str, Any]]], failures: dict[str, str], loads: dict[str, float],
                  plot_rel: str | None) -> list[str]:
    lines = [f"### {cfg['title']}", ""]
    lines += [f"Sweep: {cfg['num_prompts']} requests per point, {cfg['input_len']} prompt tokens, "
              f"{cfg['output_len']} output tokens (`ignore_eos`), greedy; Poisson arrivals at "
              f"{', '.join(f'{r:g}' for r in cfg['rates'])} req/s, then all at once under a cap of "
              f"{cfg['concurrency']} in flight.", ""]
    lines += ["| system | version | weights loaded | settings | load avg before |", "|---|---|---|---|---|"]
    for name, spec in specs.items():
        lines.append(f"| {name} | {spec.version} | `{os.path.basename(spec.weights.rstrip('/'))}` | {spec.settings}"
                     + ("; " + "; ".join(spec.notes) if spec.notes else "") + f" | {loads.get(name, float('nan')):.2f} |")
    for name, why in failures.items():
        lines.append(f"| {name} | - | - | **not measured**: {why} | - |")
    lines.append("")
    arm = {(_point(d)): d for d in results.get("armserve", [])}
    checks = []
    for name, ds in results.items():
        for d in ds:
            want, want_in = d["num_prompts"] * cfg["output_len"], d["num_prompts"] * cfg["input_len"]
            if d["completed"] != d["num_prompts"] or d["total_output_tokens"] != want \
                    or d["total_input_tokens"] != want_in:
                checks.append(f"{name} at {_point(d)}: {d['completed']}/{d['num_prompts']} completed, "
                              f"{d['total_output_tokens']} of {want} output tokens, "
                              f"{d['total_input_tokens']} of {want_in} prompt tokens (the server's count)")
    if arm:
        order = sorted(arm, key=lambda p: (p.startswith("concurrency"), float(p.split()[0]) if not
                                           p.startswith("concurrency") else 0))
        peers_done = [n for n in results if n != "armserve"]
        if peers_done:
            lines += ["Ratios armserve / peer, same point of the same sweep: output throughput (above 1: armserve "
                      "serves more), mean TTFT and mean TPOT (below 1: armserve answers sooner).", ""]
            head = "| point | " + " | ".join(f"{p}: tok/s | {p}: TTFT | {p}: TPOT" for p in peers_done) + " |"
            lines += [head, "|---|" + "---|" * (3 * len(peers_done))]
            for point in order:
                a = arm[point]
                cells = []
                for p in peers_done:
                    b = {_point(d): d for d in results[p]}.get(point)
                    if b is None or not _complete(a) or not _complete(b):  # failed requests: not like for like
                        cells += ["-", "-", "-"]
                    else:
                        cells += [_ratio(a["output_throughput"], b["output_throughput"]),
                                  _ratio(a["mean_ttft_ms"], b["mean_ttft_ms"]),
                                  _ratio(a["mean_tpot_ms"], b["mean_tpot_ms"])]
                lines.append(f"| {point} | " + " | ".join(cells) + " |")
            lines.append("")
    # Roofline: each system's median TPOT against the bandwidth-limited step time of its own weights.
    lines += ["Decode against this machine's bandwidth limit: the bandwidth-limited step time (weight bytes per "
              "step / the higher of read and copy bandwidth) as a share of the median TPOT; 100 % = every step "
              "costs no more than streaming the weights once:", "",
              "| system | weight bytes per step | " + " | ".join(f"{p}" for p in (sorted(arm) if arm else [])) + " |",
              "|---|---|" + "---|" * len(arm)]
    for name, ds in results.items():
        by = {_point(d): d for d in ds}
        roof = (ds[0].get("roofline") or {}) if ds else {}
        cells = []
        for p in sorted(arm):
            pct = ((by.get(p) or {}).get("roofline") or {}).get("decode_pct_of_bw_limit")
            cells.append(f"{pct:.1f} %" if pct is not None else "-")
        wb = roof.get("weight_bytes")
        lines.append(f"| {name} | {wb / 1e6:.0f} MB |" if wb else f"| {name} | - |")
        lines[-1] += " " + " | ".join(cells) + " |"
    lines.append("")
    if checks:
        lines += ["Runs that did not deliver what was asked (left out of the ratio table, shown as -):", ""]
        lines += [f"- {c}" for c in checks] + [""]
    if plot_rel:
        lines += [f"![{cfg['title']}: throughput against TTFT and TPOT]({plot_rel})", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated: {', '.join(SYSTEMS)}")
    ap.add_argument("--threads", type=int, default=1, help="compute threads for every server")
    ap.add_argument("--num-prompts", type=int, default=None, help="override every model's sweep")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--request-rates", default=None, help="comma-separated req/s, override every model's")
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--no-write", action="store_true", help="leave docs/ (section and plots) alone")
    args = ap.parse_args()

    models = [m for m in args.models.split(",") if m]
    systems = [s for s in args.systems.split(",") if s]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    if "armserve" not in systems:
        raise SystemExit("armserve must be among --systems: every figure is a ratio against it")

    os.makedirs(RESULTS, exist_ok=True)
    roofline_file = os.path.join(RESULTS, "roofline.json")
    if os.path.exists(roofline_file):
        os.remove(roofline_file)  # measured once per run, by the first client
    from armserve.benchmarks import roofline as rl

    roof = rl.load_or_measure(roofline_file, threads=args.threads)
    print(f"roofline ({args.threads} thread(s)): {rl.describe(roof)}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    cmd_base = "python benchmarks/compare.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if v is not None and k not in ("no_write", "models") and not (k == "systems" and v == ",".join(SYSTEMS))
        and not (k == "threads" and v == 1))
    body = [
        "## Serving: armserve vs vLLM CPU, llama.cpp and transformers (issue 5)", "",
        f"Machine: {machine_description()}. Each model's section below comes from one run of "
        "`benchmarks/compare.py`, which measures the roofline (memory bandwidth, matmul peak) once at its start.", "",
        "Every server ran alone on loopback with the same weights (the llama.cpp rows load a GGUF of them), "
        f"computing on {args.threads} thread(s); the client, `armserve bench serve` (vLLM's `bench serve` "
        "metrics: TTFT to the first text chunk, TPOT = (E2EL - TTFT) / (output tokens - 1)), ran on the other "
        "core and sent every system the same prompts as text. The machine is shared with other work: the load "
        "average before each server started is in its row, and single points can be off by the noise that "
        "implies. Each figure below is a ratio of two systems measured in the same run.", "",
        f"Reproduce everything: `{cmd_base}` (add `--models smollm2` or `--models tinyllama` for one model).",
    ]
    if not args.no_write:
        update_section("serving", "\n".join(body))
    for model in models:
        cfg = dict(MODELS[model])
        for key, val in (("num_prompts", args.num_prompts), ("input_len", args.input_len),
                         ("output_len", args.output_len), ("concurrency", args.concurrency)):
            if val is not None:
                cfg[key] = val
        if args.request_rates:
            cfg["rates"] = [float(r) for r in args.request_rates.split(",")]
        hf = cfg["hf"]()
        out_dir = os.path.join(RESULTS, model)
        os.makedirs(out_dir, exist_ok=True)
        for old in glob.glob(os.path.join(out_dir, "*.json")):
            os.remove(old)
        specs: dict[str, peers.ServerSpec] = {}
        results: dict[str, list[dict[str, Any]]] = {}
        failures: dict[str, str] = {}
        loads: dict[str, float] = {}
        for system in systems:
            if system.startswith("llama.cpp") and system not in cfg["ggufs"]:
                continue
            port = peers.free_port()
            try:
                spec = server_spec(system, model, hf, args.threads, port)
            except peers.PeerUnavailable as e:
                failures[system] = f"install failed: {str(e).splitlines()[0]}"
                print(f"!! {system}: {e}", flush=True)
                continue
            log = os.path.join(peers.PEERS_DIR, f"server-{model}-{system}.log")
            loads[system] = load_average()
            print(f"== {model} / {system}: starting (load average {loads[system]:.2f}) ...", flush=True)
            t = time.monotonic()
            try:
                server = peers.Server(spec, port, log)
            except peers.PeerUnavailable as e:
                failures[system] = f"server did not start (log `{log}`): {str(e).splitlines()[0]}"
                print(f"!! {e}", flush=True)
                continue
            print(f"   ready after {time.monotonic() - t:.0f} s", flush=True)
            try:
                files = run_sweep(spec, server.url, hf, cfg, out_dir, roofline_file)
                specs[system] = spec
                results[system] = [json.load(open(f)) for f in files]
            except subprocess.CalledProcessError as e:
                failures[system] = f"the sweep failed ({e}); server log tail: {server.log_tail(300)!r}"
                print(f"!! {system}: {failures[system]}", flush=True)
            finally:
                server.stop()
        plot_rel = None
        files = sorted(glob.glob(os.path.join(out_dir, "*-rate*.json")))
        if files and not args.no_write:
            from armserve.benchmarks.plot import load_results, plot_results

            png = os.path.join(DOCS, f"bench-serve-{model}.png")
            plot_results(load_results(files), png, f"{cfg['title']}: {cfg['input_len']} in / {cfg['output_len']} "
                                                   f"out, {args.threads} thread(s) per server, same machine and run")
            plot_rel = os.path.basename(png)
        lines = model_section(model, cfg, specs, results, failures, loads, plot_rel)
        lines += [f"Run {started}, armserve rev `{git_revision()}`, roofline of this run: {rl.describe(roof)}. "
                  f"JSON results: `benchmarks/results/serve/{model}/`. Reproduce: `{cmd_base} --models {model}`", ""]
        text = "\n".join(lines)
        print(text, flush=True)
        if not args.no_write:
            update_section(f"serving-{model}", text)



if __name__ == "__main__":
    main()
