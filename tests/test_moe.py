"""Mixture-of-Experts: routing and the expert pass against the PyTorch reference (float32,
bfloat16 on the dense kernels, w4a8 experts), and the MoE families against transformers in
batches, with prefix caching, chunked prefill and w4a8 experts from `armserve quantize`."""

from __future__ import annotations

import pytest
import torch
from types import SimpleNamespace

from armserve import LLM, SamplingParams
from armserve.layers.fused_moe import fused_experts, fused_moe_ref, select_experts
from armserve.layers.quantized_linear import QuantizedLinear, kernel_scales, quantize_weight
from armserve.models.llama import LlamaMLP

H, I, E = 64, 96, 6


def make_experts(dtype: torch.dtype, w4: bool = False) -> tuple[torch.nn.ModuleList, torch.Tensor, torch.Tensor]:
    """E gated MLPs with random weights, and their stacked weights as the reference sees them."""
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, hidden_act="silu")
    w13 = torch.randn(E, 2 * I, H) / H**0.5
    w2 = torch.randn(E, H, I) / I**0.5
    experts = torch.nn.ModuleList()
    for e in range(E):
        m = LlamaMLP(cfg)
        if w4:
            for name, w in (("gate_up_proj", w13[e]), ("down_proj", w2[e])):
                q = QuantizedLinear(w.shape[1], w.shape[0], False, [("all", w.shape[0])])
                qt = quantize_weight(w, 32, symmetric=False)
                q.load_shard("all", qt)
                setattr(m, name, q)
                # the reference gets the weights the kernels use
                (w13 if name == "gate_up_proj" else w2)[e] = kernel_scales(qt).dequantize()
        else:
            m.gate_up_proj.weight.data.copy_(w13[e])
            m.down_proj.weight.data.copy_(w2[e])
        experts.append(m.to(dtype))
    for m in experts.modules():
        if hasattr(m, "finalize"):
            m.finalize()
    return experts, w13.to(dtype), w2.to(dtype)


def test_select_experts_matches_softmax_topk():
    torch.manual_seed(1)
    logits = torch.randn(7, E)
    w, ids = select_experts(logits, 2, renormalize=False)
    p = torch.softmax(logits, dim=-1)
    for t in range(7):
        want = sorted(range(E), key=lambda e: -p[t, e].item())[:2]
        assert ids[t].tolist() == want
        torch.testing.assert_close(w[t], p[t, want])
    w, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w.sum(dim=-1), torch.ones(7))


@pytest.mark.parametrize("routing", ["random", "one_expert", "one_token"])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "w4a8"])
def test_fused_experts_matches_reference(kind, routing):
    """Every expert's tokens gathered, one pass per active expert, the weighted sum scattered
    back; experts that receive nothing (all of them but one with `one_expert`) are skipped."""
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    experts, w13, w2 = make_experts(dtype, w4=kind == "w4a8")
    tokens = 1 if routing == "one_token" else 37
    x = torch.randn(tokens, H).to(dtype)
    weights = torch.rand(tokens, 2)
    if routing == "one_expert":
        ids = torch.tensor([[3, 3]] * tokens)
    else:
        ids = torch.stack([torch.randperm(E)[:2] for _ in range(tokens)])
    got = fused_experts(x, weights, ids, experts)
    want = fused_moe_ref(x, weights, ids, w13, w2)
    # bf16: products of bf16 weights rounded at each layer; w4a8: int8 activations
    tol = {"float32": 1e-4, "bfloat16": 3e-2, "w4a8": 5e-2}[kind]
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away",
           "1, 2, 3, 4, 5, 6, 7,"]
N = 32


def hf_greedy(folder: str, ids: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_families_batched_match_transformers(tiny_checkpoints, name):
    """4 prompts x 32 greedy tokens equal transformers', in one batch, with prefix caching on and
    off and with a token budget of 8 that splits every prompt's prefill into chunks."""
    folder = tiny_checkpoints[name]
    params = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)
    want = None
    for kw in (dict(enable_prefix_caching=True), dict(enable_prefix_caching=False),
               dict(max_num_batched_tokens=8, enable_prefix_caching=True)):
        llm = LLM(folder, dtype="float32", kv_cache_space=0.05, max_model_len=256, block_size=16, **kw)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if want is None:
            want = [hf_greedy(folder, o.prompt_token_ids) for o in outs]
        assert [o.outputs[0].token_ids for o in outs] == want, kw


def test_quantize_moe_experts(tiny_checkpoints, tmp_path):
    """`armserve quantize` turns every expert (Mixtral's w1/w2/w3 too) into int4 and leaves the
    router in float; the folder runs on the w4a8 kernels and stays close to its own dequantized
    weights."""
    from armserve.quantize import quantize_model

    out = tmp_path / "q"
    quantize_model(tiny_checkpoints["mixtral"], str(out), group_size=32, progress=False)
    q = LLM(str(out), dtype="float32", kv_cache_space=0.02)
    moe = q.llm_engine.model.layers[0].mlp
    assert all(isinstance(m.gate_up_proj, QuantizedLinear) and isinstance(m.down_proj, QuantizedLinear)
               for m in moe.experts)
    assert not isinstance(moe.gate, QuantizedLinear)
    deq = LLM(str(out), dtype="float32", kv_cache_space=0.02, quantization="none")
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = q.generate(["the cat sat on the mat"], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    b = deq.generate(["the cat sat on the mat"], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(a) & set(b)
    assert len(common) >= 3
    assert max(abs(a[t].logprob - b[t].logprob) for t in common) < 0.15  # int8 activations only
