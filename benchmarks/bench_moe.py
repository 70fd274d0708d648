"""Mixture-of-Experts decode speed: Mixtral-8x7B- and DeepSeek-V2-Lite-shaped models with random
weights, full width and every expert, depth cut (the layer count is stated), in bfloat16 and in
w4a8 (`armserve quantize`), and the fused expert kernel against the expert-by-expert path.

    python benchmarks/bench_moe.py                       # both shapes
    python benchmarks/bench_moe.py --shapes deepseek --threads 1 2

Decode tok/s at batch 1 and 8 concurrent sequences (greedy, `ignore_eos`, 16-token prompts),
prefill excluded: the time of N + 1 output tokens minus the time of 1, median of 3 after a
warm-up, each configuration in a process of its own (the models take GBs). Writes the "moe"
section of docs/benchmarks.md.

Peers, in the same run at one compute thread (benchmarks/peers.py installs them): vLLM CPU on the
same bf16 folder, measured by the same worker through its offline `LLM.generate`; llama.cpp on a
GGUF of the same weights (llama.cpp's own `convert_hf_to_gguf.py`, then `llama-quantize` to Q4_0,
the format of armserve's w4a8: int4 in blocks of 32 with a scale), `llama-bench` at batch 1 and
`llama-batched-bench` at 8 sequences; armserve also runs that Q4_0 file itself (kept quantized).

Checkpoints are written straight from the architecture's parameter names and shapes (transformers
on the meta device) with random values, into ~/.cache/armserve-peers/models: speed does not depend
on the values. The vocabulary is SmolLM2's (49152 tokens) so that the tokenizer is a real one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peer_models as pm  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

from armserve.benchmarks import timing  # noqa: E402

SHAPES = {
    # Mixtral-8x7B: 8 experts of 14336, top-2; 2 of its 32 layers.
    "mixtral": dict(title="Mixtral-8x7B shape, 2 of 32 layers", arch="MixtralForCausalLM", config=dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)),
    # DeepSeek-V2-Lite: MLA (kv_lora_rank 512), 64 routed experts of 1408 (top-6) + 2 shared, the
    # first layer dense (10944); 4 of its 27 layers (1 dense + 3 MoE).
    "deepseek": dict(title="DeepSeek-V2-Lite shape, 4 of 27 layers", arch="DeepseekV2ForCausalLM", config=dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False)),
}

# The measurement both engines' workers run (either LLM class: vLLM's and armserve's generate
# take the same prompts and SamplingParams), printed as one JSON line. timing.py is run by path:
# vLLM's interpreter has no armserve to import it from.
DECODE = f"""
import json, runpy

timing = runpy.run_path({timing.__file__!r})
""" + r"""

def decode_tok_s(llm, SamplingParams, n, batch):
    vocab = llm.get_tokenizer().vocab_size
    prompts = [{"prompt_token_ids": [(97 * i + 7919 * j) % (vocab - 200) + 100 for i in range(16)]} for j in range(batch)]
    def run(tokens):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return timing["timed"](lambda: llm.generate(prompts, params, use_tqdm=False))[1]
    run(4)
    samples = [timing["decode_tok_s_by_difference"](run, n, batch) for _ in range(3)]
    tok_s, lo, hi = timing["median_min_max"](samples)
    print(json.dumps({"tok_s": tok_s, "min": lo, "max": hi}))
"""

WORKER = DECODE + r"""
import sys
import torch
threads, model, n, batch, fused = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
torch.set_num_threads(threads)
import armserve.layers.fused_moe as fm
if not fused:  # every layer expert by expert
    fm.kernel_experts = lambda experts: None
from armserve import LLM, SamplingParams
decode_tok_s(LLM(model, dtype="bfloat16", kv_cache_space=1, max_model_len=512, max_num_seqs=max(batch, 1)),
             SamplingParams, n, batch)
"""


# llama.cpp tells DeepSeek-V2-Lite (no query LoRA) from V2 by the layer count alone.
LITE_NOTE = (": llama.cpp's loader recognises DeepSeek-V2-Lite, the variant without a query LoRA, by its 26 or 27 "
             "layers only (src/models/deepseek2.cpp), so a depth-cut Lite does not load there")

VLLM_WORKER = DECODE + r"""
import sys


def main():
    model, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from vllm import LLM, SamplingParams
    decode_tok_s(LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=max(batch, 1)), SamplingParams,
                 n, batch)


if __name__ == "__main__":  # vLLM's engine core is a child process that re-imports this module
    main()
"""


def checkpoint(name: str) -> str:
    """The shape's bf16 HF folder with random weights (made once)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    spec = SHAPES[name]
    out = os.path.join(pm.CACHE, f"{name}-shape-random-hf")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    tok_dir = pm.smollm2_hf()
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    cfg_cls = {"MixtralForCausalLM": transformers.MixtralConfig, "DeepseekV2ForCausalLM": transformers.DeepseekV2Config}
    config = cfg_cls[spec["arch"]](**spec["config"], vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                   eos_token_id=tok.eos_token_id, torch_dtype="bfloat16",
                                   architectures=[spec["arch"]])
    with torch.device("meta"):
        model = getattr(transformers, spec["arch"])(config)
    print(f"writing {out} ...", flush=True)

    def save(tmp: str) -> None:
        os.makedirs(tmp)
        g = torch.Generator().manual_seed(0)
        shard, size, index, n = {}, 0, {}, 0
        mixtral = spec["arch"] == "MixtralForCausalLM"
        names = []
        # transformers keeps each layer's experts stacked (mlp.experts.gate_up_proj [E, 2I, H],
        # down_proj [E, H, I]); checkpoints name them one by one (Mixtral: block_sparse_moe w1 / w3 / w2).
        for key, v in model.state_dict().items():
            if ".mlp.experts." not in key:
                names.append((key.replace(".mlp.gate.", ".block_sparse_moe.gate.") if mixtral else key, v.shape))
                continue
            pre = key[: key.index(".mlp.experts.")] + (".block_sparse_moe.experts" if mixtral else ".mlp.experts")
            gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            for e in range(v.shape[0]):
                if key.endswith("gate_up_proj"):
                    half = (v.shape[1] // 2, v.shape[2])
                    names += [(f"{pre}.{e}.{gate}.weight", half), (f"{pre}.{e}.{up}.weight", half)]
                else:
                    names.append((f"{pre}.{e}.{down}.weight", tuple(v.shape[1:])))
        for key, shape in names:
            if key.endswith("norm.weight") or key.endswith("layernorm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            elif key.endswith("e_score_correction_bias"):
                t = torch.zeros(shape, dtype=torch.float32)
            else:
                fan_in = shape[-1] if len(shape) > 1 else 1
                t = (torch.randn(shape, generator=g) / fan_in**0.5).to(torch.bfloat16)
            shard[key] = t
            size += t.numel() * t.element_size()
            if size > (2 << 30):
                fname = f"model-{n:05d}.safetensors"
                save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
                index.update({k: fname for k in shard})
                shard, size, n = {}, 0, n + 1
        if shard:
            fname = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(tmp, fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
        json.dump({"metadata": {}, "weight_map": index}, open(os.path.join(tmp, "model.safetensors.index.json"), "w"))
        config.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return pm._save_atomically(out, save)


def quantized(name: str, folder: str) -> str:
    """`armserve quantize` of the folder: int4 experts and projections (group 32), made once."""
    from armserve.quantization.quantize import quantize_model

    out = os.path.join(pm.CACHE, f"{name}-shape-random-w4a8")
    if not os.path.isfile(os.path.join(out, "config.json")):
        print(f"quantizing {folder} -> {out} ...", flush=True)
        pm._save_atomically(out, lambda tmp: quantize_model(folder, tmp, group_size=32, progress=False))
    return out


def llama_cpp_ggufs(name: str, folder: str) -> tuple[str, str]:
    """The folder as GGUF by llama.cpp's own converter (bf16), and that file quantized to Q4_0 by
    llama-quantize (its default for Q4_0: the output matrix Q6_K), both made once."""
    import glob

    import peers

    bin_dir = os.path.dirname(peers.install_llama_server())
    src = glob.glob(os.path.join(peers.PEERS_DIR, "llama.cpp", "src", "*", "vendor", "llama.cpp"))[0]
    bf16 = os.path.join(pm.CACHE, f"{name}-shape-random-bf16.gguf")
    q4 = os.path.join(pm.CACHE, f"{name}-shape-random-q4_0.gguf")
    log = os.path.join(peers.PEERS_DIR, f"{name}-gguf.log")
    if not os.path.isfile(bf16):
        print(f"converting {folder} -> {bf16} ...", flush=True)
        peers._run_logged([peers.NICE + [sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), folder,
                                         "--outtype", "bf16", "--outfile", bf16 + ".tmp"]], log)
        os.replace(bf16 + ".tmp", bf16)
    if not os.path.isfile(q4):
        peers._run_logged([peers.NICE + [os.path.join(bin_dir, "llama-quantize"), bf16, q4 + ".tmp", "Q4_0"]], log)
        os.replace(q4 + ".tmp", q4)
    return bf16, q4


def llama_cpp_decode(gguf: str, n: int, batch: int) -> dict:
    """llama.cpp's decode tok/s at one thread: llama-bench (batch 1, 3 runs) or llama-batched-bench
    (`batch` sequences of a 16-token prompt, n tokens each; median of 3 invocations)."""
    import statistics

    import peers

    bin_dir = os.path.dirname(peers.install_llama_server())
    if batch == 1:
        out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-p", "0", "-n", str(n), "-t", "1",
                              "-r", "3", "-o", "json"], capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench: {out.stderr[-2000:]}")
        r = json.loads(out.stdout)[0]
        return {"tok_s": float(r["avg_ts"]), "min": min(r["samples_ts"]), "max": max(r["samples_ts"])}
    exe = os.path.join(bin_dir, "llama-batched-bench")
    if not os.path.isfile(exe):
        peers._run_logged([peers.NICE + ["cmake", "--build", os.path.dirname(bin_dir), "-j", "2", "--target",
                                         "llama-batched-bench"]], os.path.join(peers.PEERS_DIR, "llamacpp-install.log"))
    samples = []
    for _ in range(3):
        out = subprocess.run([exe, "-m", gguf, "-t", "1", "-tb", "1", "-c", str(batch * (16 + n + 8)), "-b", "512",
                              "-ub", "512", "-npp", "16", "-ntg", str(n), "-npl", str(batch), "--output-format", "jsonl"],
                             capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"llama-batched-bench: {out.stderr[-2000:]}")
        rows = [json.loads(line) for line in (out.stdout + out.stderr).splitlines() if line.startswith("{")]
        samples.append(float(rows[-1]["speed_tg"]))
    return {"tok_s": statistics.median(samples), "min": min(samples), "max": max(samples)}


def vllm_decode(model: str, n: int, batch: int) -> dict:
    """vLLM CPU's decode tok/s on the bf16 folder (its default binding: one compute thread on 2 cores)."""
    import tempfile

    import peers

    py = peers.install_vllm()
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VLLM_WORKER)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([py, f.name, model, str(n), str(batch)], env=env, capture_output=True, text=True,
                              timeout=3600)
    finally:
        os.unlink(f.name)
    # NOTE: vLLM's engine-core and worker processes outlive the script by seconds and spin while they
    # go; a measurement started meanwhile ran ~30% slow here. Wait until they are gone.
    import time

    deadline = time.monotonic() + 120
    while subprocess.run(["pgrep", "-f", "VLLM::"], capture_output=True).returncode == 0 and time.monotonic() < deadline:
        time.sleep(1)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm {model} batch {batch}: {proc.stderr[-3000:]}")
    return _result(proc.stdout)


def measure(threads: int, model: str, n: int, batch: int, fused: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", WORKER, str(threads), model, str(n), str(batch), "1" if fused else "0"],
                          env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} batch {batch}: {proc.stderr[-3000:]}")
    return _result(proc.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mixtral,deepseek")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--peers", default="vllm,llama.cpp", help="comma-separated, or 'none'")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    peer_names = [] if args.peers == "none" else args.peers.split(",")
    lines = []
    for name in args.shapes.split(","):
        bf16 = checkpoint(name)
        w4 = quantized(name, bf16)
        q4_gguf, notes = None, []
        if "llama.cpp" in peer_names:
            import peers

            try:
                q4_gguf = llama_cpp_ggufs(name, bf16)[1]
            except peers.PeerUnavailable as e:
                why = [line for line in str(e).splitlines() if "failed to quantize:" in line or "Error" in line]
                notes.append(f"- llama.cpp: no GGUF of this model ({(why or ['conversion failed'])[-1].strip()})"
                             + (LITE_NOTE if "q_lora_rank" in str(e) else ""))
        rows = []
        for threads in args.threads:
            for batch in (1, 8):
                load = load_average()
                systems = [("bf16", lambda: measure(threads, bf16, args.tokens, batch, True)),
                           ("w4a8", lambda: measure(threads, w4, args.tokens, batch, True)),
                           ("w4a8 one by one", lambda: measure(threads, w4, args.tokens, batch, False))]
                if threads == 1:  # the peers' figures: one compute thread each (vLLM last: see vllm_decode)
                    if q4_gguf:
                        systems += [("gguf", lambda: measure(threads, q4_gguf, args.tokens, batch, True)),
                                    ("llama.cpp", lambda: llama_cpp_decode(q4_gguf, args.tokens, batch))]
                    if "vllm" in peer_names:
                        systems.append(("vllm", lambda: vllm_decode(bf16, args.tokens, batch)))
                r = {}
                for key, run in systems:
                    try:
                        r[key] = run()
                    except RuntimeError as e:  # a peer that cannot run this model is reported, not fatal
                        print(f"{name} {key} batch {batch} failed: {e}", flush=True)
                        last = str(e).strip().splitlines()
                        r[key] = {"error": last[-1][:200] if last else "failed"}
                print(name, threads, batch, {k: round(v["tok_s"], 2) for k, v in r.items() if "tok_s" in v}, flush=True)
                rows.append((threads, batch, r, load))
        lines += [f"### {SHAPES[name]['title']}", "",
                  "| threads | sequences | bf16 tok/s | w4a8 tok/s | w4a8 / bf16 | w4a8, experts one by one | "
                  "fused / one by one | vLLM bf16 | bf16 / vLLM | w4a8 / vLLM | armserve Q4_0 GGUF | llama.cpp Q4_0 "
                  "GGUF | armserve / llama.cpp (Q4_0) | load avg before |", "|" + "---|" * 14]
        for threads, batch, r, load in rows:
            g = r.get
            lines.append(" | ".join([
                f"| {threads}", str(batch), _cell(g("bf16")), _cell(g("w4a8")), _ratio(g("w4a8"), g("bf16")),
                _cell(g("w4a8 one by one")), _ratio(g("w4a8"), g("w4a8 one by one")), _cell(g("vllm")),
                _ratio(g("bf16"), g("vllm")), _ratio(g("w4a8"), g("vllm")), _cell(g("gguf")), _cell(g("llama.cpp")),
                _ratio(g("gguf"), g("llama.cpp")), f"{load:.2f} |"]))
        failures = sorted({f"{k}: {v['error']}" for _, _, r, _ in rows for k, v in r.items() if "error" in v})
        notes += [f"- failed, {f}" for f in failures]
        lines += [""] + notes + ([""] if notes else [])
    text = "\n".join([
        "## Mixture-of-Experts decode: bf16 vs w4a8, fused expert kernel, vs vLLM and llama.cpp (issue 14)", "",
        f"Machine: {machine_description()}. armserve rev `{git_revision()}`. Random weights, full layer width and "
        f"every expert, depth cut as stated; SmolLM2's 49152-token vocabulary. Decode tok/s (aggregate over the "
        f"sequences), greedy, {args.tokens} tokens after a 16-token prompt, prefill excluded (time of N + 1 tokens "
        "minus time of 1), median of 3 (min-max) after a warm-up, one process per configuration. w4a8 is "
        "`armserve quantize` (int4 experts and projections, group 32, LM head int8); \"experts one by one\" is the "
        "same w4a8 model with the fused kernel turned off (each active expert's GEMMs called from Python). Peers at "
        "one compute thread: vLLM CPU (its offline `LLM.generate`, the same worker, the same bf16 folder, its default "
        "binding); llama.cpp on a GGUF of the same weights made by its own `convert_hf_to_gguf.py` and "
        "`llama-quantize ... Q4_0` (int4 in blocks of 32, output matrix Q6_K), `llama-bench -p 0 -n N -t 1` at one "
        "sequence and `llama-batched-bench -npp 16 -ntg N -npl 8 -t 1` at 8; armserve runs that same Q4_0 file "
        "(kept quantized: w4a8).", "",
        *lines,
        "Reproduce: `python benchmarks/bench_moe.py`"])
    print(text)
    if not args.no_write:
        update_section("moe", text)


def _result(stdout: str) -> dict:
    """The worker's JSON line (vLLM also logs to stdout)."""
    return json.loads([line for line in stdout.splitlines() if line.startswith('{"tok_s"')][-1])


def _cell(v: dict | None) -> str:
    if v is None:
        return "-"
    return f"{v['tok_s']:.2f} ({v['min']:.2f}-{v['max']:.2f})" if "tok_s" in v else "failed"


def _ratio(a: dict | None, b: dict | None) -> str:
    return f"{a['tok_s'] / b['tok_s']:.2f}x" if a and b and "tok_s" in a and "tok_s" in b else "-"


if __name__ == "__main__":
    main()
