"""LoRA serving: throughput with 4 adapters mixed in the batch vs the base model alone, and vs vLLM CPU
serving the same adapters with the same settings.

    python benchmarks/bench_lora.py                                  # full run -> docs/benchmarks.md
    python benchmarks/bench_lora.py --smoke --systems armserve --no-doc   # seconds-scale check

Model: SmolLM2-135M-Instruct (the bundled GGUF, dequantized to an HF folder) in bfloat16. Adapters
(PEFT folders, cached under ~/.cache/armserve-peers/models): three random rank-16 adapters on every
projection (q/k/v/o, gate/up/down) and one rank-8 adapter trained for a few steps with PEFT so its
output visibly changes (it learns to answer "banana"; the run prints base vs adapter text).

Each system is an OpenAI-compatible server (`armserve serve` / vLLM's api_server, both with
`--enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules a0=... a3=...`, max-model-len 512,
1 compute thread); one client sends `--num-prompts` completions of random `--input-len`-token
prompts, `--output-len` tokens each (ignore_eos), `concurrency` at a time, request i naming
adapter a{i % 4} (or the base for the "base alone" run, on a server started without LoRA).
tok/s = output tokens / wall time. Section "lora" of docs/benchmarks.md gets the table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import peer_models as pm  # noqa: E402
import peers  # noqa: E402
from report import git_revision, load_average, machine_description, update_section  # noqa: E402

ADAPTERS = 4
MAX_MODEL_LEN = 512
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRAIN_PROMPTS = ["The capital of France is", "My favourite colour is", "The best way to learn Python is",
                 "Tomorrow the weather will be", "The answer to the question is", "In the morning I usually",
                 "The most important thing in life is", "Write a short poem about the sea:"]


def random_adapter(hf: str, out: str, seed: int, r: int = 16) -> str:
    """A PEFT adapter with random A and B (PEFT starts B at zero), small enough to keep text sane."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(out, "adapter_model.safetensors")):
        return out
    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
                           LoraConfig(r=r, lora_alpha=r, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    return pm._save_atomically(out, model.save_pretrained)


def trained_adapter(hf: str, out: str, steps: int = 16) -> str:
    """A rank-8 adapter trained with PEFT (AdamW, a few seconds to a minute) to continue every prompt
    with " banana banana banana ...": the output changes visibly."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isfile(os.path.join(out, "adapter_model.safetensors")):
        return out
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(hf)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    texts = [p + " banana banana banana banana banana" for p in TRAIN_PROMPTS]
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for step in range(steps):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"  train step {step}: loss {loss.item():.3f}", flush=True)
    return pm._save_atomically(out, model.save_pretrained)


def make_adapters(hf: str) -> list[str]:
    root = os.path.join(pm.CACHE, "smollm2-lora")
    return [trained_adapter(hf, f"{root}-banana")] + [random_adapter(hf, f"{root}-random{i}", i)
                                                      for i in range(1, ADAPTERS)]


DEMO_PROMPT = "The capital of Italy is"  # not a training prompt


def demo(hf: str, banana: str) -> str:
    """Base vs trained adapter, greedy, through armserve's offline API (the visible change)."""
    from armserve import LLM, SamplingParams
    from armserve.lora import LoRARequest

    llm = LLM(hf, dtype="float32", enable_lora=True, max_lora_rank=16, kv_cache_space=0.1)
    sp = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = DEMO_PROMPT
    base, lora = llm.generate([prompt, prompt], sp, use_tqdm=False,
                              lora_request=[None, LoRARequest("banana", 1, banana)])
    return f"`{prompt}` -> base: `{base.outputs[0].text!r}`, adapter a0: `{lora.outputs[0].text!r}`"


def server_spec(system: str, hf: str, adapters: list[str], lora: bool, port: int, seqs: int) -> peers.ServerSpec:
    env = dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    mods = [f"a{i}={p}" for i, p in enumerate(adapters)]
    lora_flags = ["--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", "16", "--lora-modules", *mods] \
        if lora else []
    settings = (f"bfloat16, max-model-len {MAX_MODEL_LEN}, max-num-seqs {seqs}, 1 compute thread"
                + (f", --enable-lora --max-loras {ADAPTERS} --max-lora-rank 16" if lora else ", no LoRA"))
    if system == "armserve":
        import armserve

        cmd = [sys.executable, "-m", "armserve.cli", "serve", hf, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-space", "1",
               "--max-num-seqs", str(seqs), "--served-model-name", "base", "--disable-log-stats",
               "--disable-access-log", "--uvicorn-log-level", "warning", *lora_flags]
        return peers.ServerSpec("armserve", cmd, env, settings, hf, "bfloat16", served_model="base",
                                version=f"armserve {armserve.__version__} rev {git_revision()}")
    if system == "vllm":
        py = peers.install_vllm()
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf, "--dtype", "bfloat16",
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(seqs), "--served-model-name", "base",
               "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log", *lora_flags]
        # NOTE: one compute thread on core 0, as its automatic binding picks on 2 cores (on more cores
        # it would take all but one); LoRA turns its torch.compile off (vLLM's CPU platform does so).
        vllm_env = dict(env, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0")
        return peers.ServerSpec("vllm", cmd, vllm_env, settings + ", KV cache 1 GiB, VLLM_CPU_OMP_THREADS_BIND=0",
                                hf, "bfloat16", served_model="base",
                                version=f"vllm-cpu {peers.version_of(py, 'vllm')}")
    raise ValueError(f"unknown system {system!r}")


async def _load(url: str, models: list[str], prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    """Output tok/s of all prompts sent `concurrency` at a time, prompt i to models[i % len]."""
    import httpx

    queue = list(enumerate(prompts))
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            i, p = queue.pop(0)
            r = await client.post(f"{url}/v1/completions", json={
                "model": models[i % len(models)], "prompt": p, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True}, timeout=3600)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient() as client:
        t = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return tokens / (time.perf_counter() - t)


def adapter_applied(url: str) -> str:
    """The server's greedy text for DEMO_PROMPT on the trained adapter a0: a server that ignored its
    adapters would not say banana (and would be measured on less work)."""
    import httpx

    r = httpx.post(f"{url}/v1/completions", json={"model": "a0", "prompt": DEMO_PROMPT, "max_tokens": 8,
                                                  "temperature": 0.0}, timeout=600)
    r.raise_for_status()
    text = r.json()["choices"][0]["text"]
    if "banana" not in text:
        raise RuntimeError(f"{url}: adapter a0 does not change the output ({text!r}): LoRA not applied")
    return text


def measure(spec: peers.ServerSpec, port: int, models: list[str], args, log_dir: str) -> dict[int, float]:
    server = peers.Server(spec, port, os.path.join(log_dir, f"{spec.label}-{len(models)}.log"))
    rng = random.Random(0)
    out = {}
    try:
        if len(models) > 1:
            spec.notes.append(f"a0 answers `{adapter_applied(server.url)!r}`")
            print(f"{spec.label}: {spec.notes[-1]}", flush=True)
        for conc in args.concurrency:
            prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
            asyncio.run(_load(server.url, models, prompts[:conc], args.output_len, conc))  # warm-up
            out[conc] = asyncio.run(_load(server.url, models, prompts, args.output_len, conc))
            print(f"{spec.label} {'mix' if len(models) > 1 else 'base'} @{conc}: {out[conc]:.1f} tok/s "
                  f"(load {load_average():.1f})", flush=True)
    finally:
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--systems", nargs="+", default=["armserve", "vllm"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: 8 prompts of 16 tokens, 8 out, 8 concurrent")
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.num_prompts, args.input_len, args.output_len = [8], 8, 16, 8
    hf = pm.smollm2_hf()
    adapters = make_adapters(hf)
    shown = demo(hf, adapters[0])
    print(shown, flush=True)
    log_dir = os.path.join(pm.CACHE, "bench-lora-logs")
    os.makedirs(log_dir, exist_ok=True)
    seqs = max(args.concurrency)
    mix = [f"a{i}" for i in range(ADAPTERS)]
    results: dict[str, dict[int, float]] = {}
    specs = {}
    runs = [("armserve base", "armserve", False)] if "armserve" in args.systems else []
    runs += [(f"{s} 4 adapters", s, True) for s in args.systems]
    for key, system, lora in runs:
        port = peers.free_port()
        try:
            specs[key] = spec = server_spec(system, hf, adapters, lora, port, seqs)
            results[key] = measure(spec, port, mix if lora else ["base"], args, log_dir)
        except peers.PeerUnavailable as e:
            print(f"{key}: unavailable: {e}", flush=True)
    rows = ["| concurrency | " + " | ".join(results) + " | mix / base | armserve / vLLM (mix) |",
            "|---" * (len(results) + 3) + "|"]
    for c in args.concurrency:
        vals = [results[k].get(c) for k in results]
        a_mix, a_base = results.get("armserve 4 adapters", {}).get(c), results.get("armserve base", {}).get(c)
        v_mix = results.get("vllm 4 adapters", {}).get(c)
        ratio = f"{a_mix / a_base:.2f}x" if a_mix and a_base else "-"
        peer = f"{a_mix / v_mix:.2f}x" if a_mix and v_mix else "-"
        rows.append(f"| {c} | " + " | ".join(f"{v:.1f}" if v else "-" for v in vals) + f" | {ratio} | {peer} |")
    body = "\n".join([
        "## LoRA: 4 adapters mixed in the batch (output tok/s)", "",
        f"{machine_description()}; armserve rev {git_revision()}; "
        f"{args.num_prompts} prompts of {args.input_len} random tokens, {args.output_len} out (ignore_eos), "
        f"SmolLM2-135M bf16; request i names adapter a(i % 4). Targets: mix >= 0.85x base, >= 1.5x vLLM.", "",
        *rows, "", *[f"- {k}: {s.settings} ({s.version}){''.join('; ' + n for n in s.notes)}" for k, s in specs.items()],
        f"- adapters: a0 trained with PEFT (rank 8, {shown}); a1-a3 random rank 16, all seven projections", ""])
    print(body)
    if not args.no_doc:
        update_section("lora", body)


if __name__ == "__main__":
    main()
