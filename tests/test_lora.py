"""LoRA adapters (armserve/lora/, layers/lora.py) against PEFT on tiny random Llama and Qwen2 bases:
greedy tokens identical in float32 for several adapters and the base mixed in one batch, logprobs
close; bf16; a w4a8-quantized base; prefix-cache isolation; the LRU; bad folders named."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import CACHE, make_tiny_checkpoint

from armserve import LLM, SamplingParams
from armserve.lora import LoRAError, LoRARequest

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there"]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, out: str, seed: int, r: int = 8, targets=ALL_TARGETS, **cfg) -> str:
    """A PEFT adapter of `base` with random A and B (PEFT starts B at zero: no effect to test)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = f"{out}-{seed}-{r}-{'_'.join(targets)}-{'_'.join(f'{k}{v}' for k, v in sorted(cfg.items()))}"
    if os.path.isfile(os.path.join(out, "adapter_model.safetensors")):
        return out
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=cfg.pop("lora_alpha", 2 * r), target_modules=targets,
                                            init_lora_weights=False, **cfg))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.15)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    peft.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def peft_greedy(base: str, adapter: str | None, prompts: list[str], n: int, merged: bool = False):
    """PEFT's (or the base's) greedy tokens and the logprobs of each chosen token."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
        if merged:
            model = model.merge_and_unload()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            toks, lps = [], []
            for _ in range(n):
                logits = model(ids).logits[0, -1].float()
                t = int(logits.argmax())
                toks.append(t)
                lps.append(float(torch.log_softmax(logits, -1)[t]))
                ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
            out.append((toks, lps))
    return out


@pytest.fixture(scope="module")
def bases(tokenizer_dir) -> dict[str, str]:
    return {
        "llama": make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama"), "LlamaForCausalLM", tokenizer_dir),
        "qwen2": make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen2"), "Qwen2ForCausalLM", tokenizer_dir),
    }


def adapters_of(base: str, family: str) -> list[str]:
    root = os.path.join(CACHE, f"lora-{family}")
    return [make_adapter(base, root, 1, r=8),
            make_adapter(base, root, 2, r=4, targets=["q_proj", "v_proj"], use_rslora=True),
            make_adapter(base, root, 3, r=16, targets=["gate_proj", "down_proj", "o_proj"])]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(bases, family):
    """Three adapters (ranks 8/4/16, rsLoRA, partial targets) and the base in ONE batch: each
    prompt's greedy tokens equal PEFT's unmerged model's, logprobs close; merged PEFT agrees."""
    base = bases[family]
    adapters = adapters_of(base, family)
    n = 6
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, kv_cache_space=0.02)
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts, loras, refs = [], [], []
    for i, adapter in enumerate([None] + adapters):
        req = None if adapter is None else LoRARequest(f"a{i}", i, adapter)
        ref = peft_greedy(base, adapter, PROMPTS, n)
        for p, r in zip(PROMPTS, ref):
            prompts.append(p)
            loras.append(req)
            refs.append(r)
    outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=loras)
    for out, (toks, lps), lora in zip(outs, refs, loras):
        got = out.outputs[0]
        assert list(got.token_ids) == toks, (lora, out.prompt)
        ours = [next(iter(d.values())).logprob for d in got.logprobs]
        assert ours == pytest.approx(lps, abs=2e-3)
    # the adapters change the output at all (else this test could not fail)
    assert len({tuple(o.outputs[0].token_ids) for o in outs[::len(PROMPTS)]}) > 1
    merged = peft_greedy(base, adapters[0], PROMPTS[:1], n, merged=True)[0][0]
    assert list(outs[len(PROMPTS)].outputs[0].token_ids) == merged
