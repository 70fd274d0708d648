"""Mixture-of-Experts: routing and the expert pass against the PyTorch reference (float32,
bfloat16 on the dense kernels, w4a8 experts), and the MoE families against transformers in
batches, with prefix caching, chunked prefill and w4a8 experts from `armserve quantize`."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from armserve import LLM, SamplingParams
from armserve.kernels.reference import fused_moe_ref
from armserve.layers.fused_moe import fused_experts, kernel_experts, select_experts
from armserve.quantization import QuantizedLinear, kernel_scales, quantize_weight, quantize_weight_int8
from armserve.models.llama import LlamaMLP
from conftest import CACHE, assert_next_token_logprobs_close, hf_model, make_tiny_checkpoint

H, I, E = 64, 96, 6


def make_experts(dtype: torch.dtype, w4: bool = False, w8: bool = False, split: bool = False, w5: bool = False,
                 w6: bool = False) -> tuple[torch.nn.ModuleList, torch.Tensor, torch.Tensor]:
    """E gated MLPs with random weights, and their stacked weights as the reference sees them;
    quantized to w4, w8, w5 (GGUF Q5_0 blocks) or w6 (GGUF Q6_K blocks: hidden and intermediate
    sizes of 256) (`split`: gate and up as two shards of the fused layer, as a checkpoint with
    separate gate_proj / up_proj loads them)."""
    torch.manual_seed(0)
    hidden, inter = (256, 256) if w6 else (H, I)
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    w13 = torch.randn(E, 2 * inter, hidden) / hidden**0.5
    w2 = torch.randn(E, hidden, inter) / inter**0.5
    experts = torch.nn.ModuleList()
    for e in range(E):
        m = LlamaMLP(cfg)
        if w4 or w8 or w5 or w6:
            for name, w in (("gate_up_proj", w13[e]), ("down_proj", w2[e])):
                halves = split and name == "gate_up_proj"
                shards = [("g", I), ("u", I)] if halves else [("all", w.shape[0])]
                q = QuantizedLinear(w.shape[1], w.shape[0], False, shards)
                deq = []
                for (shard, rows), ws in zip(shards, w.split([r for _, r in shards])):
                    qt = (quantize_weight(ws, 32, symmetric=False) if w4 else q5_0(ws) if w5 else q6_k(ws) if w6
                          else quantize_weight_int8(ws))
                    q.load_shard(shard, qt)
                    # the reference gets the weights the kernels use
                    deq.append(kernel_scales(qt).dequantize())
                setattr(m, name, q)
                (w13 if name == "gate_up_proj" else w2)[e] = torch.cat(deq)
        else:
            m.gate_up_proj.weight.data.copy_(w13[e])
            m.down_proj.weight.data.copy_(w2[e])
        experts.append(m.to(dtype))
    for m in experts.modules():
        if hasattr(m, "finalize"):
            m.finalize()
    return experts, w13.to(dtype), w2.to(dtype)


def q6_k(w: torch.Tensor):
    """w rounded to GGUF Q6_K blocks (the tests' writer: the gguf package cannot), as the loader
    converts them (w6)."""
    from armserve.quantization.gguf import convert
    from test_quantized import q6_k_blocks

    return convert("Q6_K", q6_k_blocks(w.float().numpy()))


def q5_0(w: torch.Tensor):
    """w rounded to GGUF Q5_0 blocks by the gguf package, as the loader converts them (w5)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from armserve.quantization.gguf import convert

    return convert("Q5_0", quantize(w.float().numpy(), GGMLQuantizationType.Q5_0))


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
def test_fused_experts_matches_reference(isa, kind, routing):
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


EXPERT_KINDS = {"bfloat16": dict(), "w4a8": dict(w4=True), "w4a8-split": dict(w4=True, split=True),
                "w8a8": dict(w8=True), "w4a8-bf16": dict(w4=True), "w5a8": dict(w5=True), "w6a8": dict(w6=True)}


@pytest.mark.parametrize("routing", ["random", "one_expert", "one_token", "prefill"])
@pytest.mark.parametrize("kind", list(EXPERT_KINDS))
def test_fused_moe_kernel_equals_expert_by_expert(isa, kind, routing):
    """The one-call kernel (csrc/moe_impl.h) against the expert-by-expert path on the same layers:
    the same GEMM tiles and SiLU rows, so the same bits; and against the fp32 reference. Top-3 of
    6 with the same expert twice for a token (`one_expert`), idle experts, 1 to 300 tokens."""
    dtype = torch.bfloat16 if kind in ("bfloat16", "w4a8-bf16") else torch.float32
    experts, w13, w2 = make_experts(dtype, **EXPERT_KINDS[kind])
    ke = kernel_experts(experts)
    assert ke is not None and ke.fmt == {"bfloat16": "bf16", "w8a8": "w8", "w5a8": "w5", "w6a8": "w6"}.get(kind, "w4")
    g = torch.Generator().manual_seed(7)
    tokens = {"one_token": 1, "prefill": 300}.get(routing, 13)
    x = torch.randn(tokens, w13.shape[2], generator=g).to(dtype)
    weights = torch.rand(tokens, 3, generator=g)
    if routing == "one_expert":
        ids = torch.tensor([[3, 3, 1]] * tokens)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(tokens)])
    got = fused_experts(x, weights, ids, experts)
    # (the w8 prefill rows of a bf16 layer take the dequantizing dense GEMM expert by expert)
    if not (kind == "w4a8-bf16" and routing == "prefill"):
        torch.testing.assert_close(got, fused_experts(x, weights, ids, experts, use_kernel=False), atol=0, rtol=0)
    want = fused_moe_ref(x, weights, ids, w13, w2)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    # a token's result does not depend on which other tokens were routed with it (batch invariance)
    torch.testing.assert_close(fused_experts(x[:1], weights[:1], ids[:1], experts), got[:1], atol=0, rtol=0)


def test_fused_moe_kernel_declines_what_it_cannot_read():
    """float32 weights (PyTorch's GEMM), a GELU expert: expert by expert."""
    experts, _, _ = make_experts(torch.float32)
    assert kernel_experts(experts) is None
    cfg = SimpleNamespace(hidden_size=H, intermediate_size=I, hidden_act="gelu_pytorch_tanh")
    gelu = torch.nn.ModuleList(LlamaMLP(cfg).to(torch.bfloat16) for _ in range(2))
    for m in gelu.modules():
        if hasattr(m, "finalize"):
            m.finalize()
    assert kernel_experts(gelu) is None


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away",
           "1, 2, 3, 4, 5, 6, 7,"]
N = 32


def hf_greedy(folder: str, ids: list[int]) -> list[int]:
    model = hf_model(folder)
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
    from armserve.quantization.quantize import quantize_model

    out = tmp_path / "q"
    quantize_model(tiny_checkpoints["mixtral"], str(out), group_size=32, progress=False)
    q = LLM(str(out), dtype="float32", kv_cache_space=0.02)
    moe = q.llm_engine.model.layers[0].mlp
    assert all(isinstance(m.gate_up_proj, QuantizedLinear) and isinstance(m.down_proj, QuantizedLinear)
               for m in moe.experts)
    assert not isinstance(moe.gate, QuantizedLinear)
    deq = LLM(str(out), dtype="float32", kv_cache_space=0.02, quantization="none")
    assert_next_token_logprobs_close(q, deq, "the cat sat on the mat", 0.15)  # int8 activations only


def write_moe_gguf(hf_folder: str, path: str, expert_type: str = "F32") -> None:
    """A GGUF file of a tiny HF MoE checkpoint as llama.cpp's converter lays it out: Mixtral as a
    `llama` file (q/k rows permuted for its rotary, an expert count), Qwen2-MoE as `qwen2moe`,
    Qwen3-MoE as `qwen3moe` (head width as key/value length, q/k norms as `attn_{q,k}_norm`);
    experts stacked per layer in `ffn_{gate,up,down}_exps` (F32 or Q8_0 blocks), the shared
    expert's gate as a vector. No tokenizer (the test passes the HF folder's)."""
    import json
    import os

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_folder, "config.json")))
    sd = load_file(os.path.join(hf_folder, "model.safetensors"))
    mixtral = cfg["model_type"] == "mixtral"
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg["model_type"]]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    experts = cfg.get("num_local_experts") or cfg["num_experts"]  # (transformers 5 names Qwen3-MoE's as Mixtral's)
    w = GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    w.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{arch}.attention.head_count", n_head)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_kv)
    w.add_float32(f"{arch}.rope.freq_base", float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    w.add_uint32(f"{arch}.expert_count", experts)
    w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
    if not mixtral:
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    if arch == "qwen3moe":
        w.add_uint32(f"{arch}.attention.key_length", cfg["head_dim"])
        w.add_uint32(f"{arch}.attention.value_length", cfg["head_dim"])

    def permute(t: torch.Tensor, heads: int) -> torch.Tensor:  # llama.cpp's rotary row order
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    def add(name: str, t: torch.Tensor, quantized: bool = False) -> None:
        a = t.float().numpy()
        if quantized and expert_type == "Q8_0":
            w.add_tensor(name, quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(a))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        add("output.weight", sd["lm_head.weight"])
    moe = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for short, hf in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("output", "o_proj")):
            t = sd[p + f"self_attn.{hf}.weight"]
            if mixtral and short in ("q", "k"):
                t = permute(t, n_head if short == "q" else n_kv)
            add(f"blk.{i}.attn_{short}.weight", t)
            if p + f"self_attn.{hf}.bias" in sd:
                add(f"blk.{i}.attn_{short}.bias", sd[p + f"self_attn.{hf}.bias"])
        for short in ("q", "k"):
            if p + f"self_attn.{short}_norm.weight" in sd:
                add(f"blk.{i}.attn_{short}_norm.weight", sd[p + f"self_attn.{short}_norm.weight"])
        add(f"blk.{i}.ffn_gate_inp.weight", sd[p + f"{moe}.gate.weight"])
        for gg, hf in zip(("gate", "up", "down"), names):
            stacked = torch.stack([sd[p + f"{moe}.experts.{e}.{hf}.weight"] for e in range(experts)])
            add(f"blk.{i}.ffn_{gg}_exps.weight", stacked, quantized=True)
        if arch == "qwen2moe":
            add(f"blk.{i}.ffn_gate_inp_shexp.weight", sd[p + "mlp.shared_expert_gate.weight"][0])
            for gg in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{gg}_shexp.weight", sd[p + f"mlp.shared_expert.{gg}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_gguf_stacked_experts(tiny_checkpoints, tokenizer_dir, tmp_path, name):
    """A GGUF file with stacked experts loads as the right family (Mixtral from a `llama` file
    with an expert count; Qwen2-/Qwen3-MoE with their expert widths, Qwen3's head width and
    top-k renormalisation from the file) and gives transformers' greedy tokens; Q8_0 experts
    stay quantized (w8a8) and stay close."""
    from armserve.quantization import QuantizedLinear

    folder = tiny_checkpoints[name]
    if name == "mixtral":  # llama.cpp's Mixtral files carry no sliding window: one without
        folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-mixtral-nowindow"), "MixtralForCausalLM",
                                      tokenizer_dir, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3_moe":  # llama.cpp's qwen3moe has every layer sparse (no mlp_only_layers)
        folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3-moe-allsparse"), "Qwen3MoeForCausalLM",
                                      tokenizer_dir, perturb_norms=True, head_dim=32, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                      decoder_sparse_step=1)  # (64: Q8_0 blocks of 32 along every row)
    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    write_moe_gguf(folder, f32)
    write_moe_gguf(folder, q8, expert_type="Q8_0")
    llm = LLM(f32, tokenizer=folder, dtype="float32", kv_cache_space=0.05, max_model_len=256)
    assert type(llm.llm_engine.model).__name__ == {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                                                    "qwen3_moe": "Qwen3MoeForCausalLM"}[name]
    params = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, o.prompt_token_ids) for o in outs]

    q = LLM(q8, tokenizer=folder, dtype="float32", kv_cache_space=0.05, max_model_len=256)
    experts = q.llm_engine.model.layers[0].mlp.experts
    # (Q8_0 as w8h where a row holds an even number of blocks, else w8)
    assert all(isinstance(m.gate_up_proj, QuantizedLinear)
               and [p.fmt for p in m.down_proj.parts] == ["w8h" if m.down_proj.in_features % 64 == 0 else "w8"]
               for m in experts)
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = q.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    b = llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(a) & set(b)
    assert len(common) >= 3 and max(abs(a[t].logprob - b[t].logprob) for t in common) < 0.1
