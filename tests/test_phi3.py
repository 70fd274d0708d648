"""Phi-3 / Phi-4 (`Phi3ForCausalLM`, armserve/models/phi3.py) against transformers: tiny random
checkpoints made with transformers (plain RoPE with a sliding window; LongRoPE on 3/4 of each head,
long or short factors), from their HF folders, from GGUF files laid out as llama.cpp's converter
writes them, and through `armserve quantize`."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from armserve import LLM, SamplingParams
from armserve.quantization import QuantizedLinear
from conftest import CACHE, assert_next_token_logprobs_close, make_tiny_checkpoint
from test_models import NUM_TOKENS, PROMPTS, assert_matches_hf
from test_moe import hf_greedy

ORIGINAL = 4  # LongRoPE's original context: every prompt is longer, so transformers turns it all long


def _longrope(seed: int, **extra) -> dict:
    """LongRoPE on 3/4 of each head (TINY: 4 heads of 16): 6 short and 6 long factors in [1, 8)."""
    g = torch.Generator().manual_seed(seed)
    short, long = (1.0 + 7.0 * torch.rand(2, 6, generator=g)).tolist()
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "short_factor": short,
            "long_factor": long, **extra}


@pytest.fixture(scope="module")
def phi3(tokenizer_dir) -> dict[str, str]:
    return {
        "default": make_tiny_checkpoint(os.path.join(CACHE, "tiny-phi3"), "Phi3ForCausalLM", tokenizer_dir,
                                        perturb_norms=True, sliding_window=8),
        # a context longer than the original one: the long factors, cos/sin scaled by
        # sqrt(1 + ln(512 / 4) / ln 4); tied embeddings, as Phi-4-mini
        "longrope": make_tiny_checkpoint(os.path.join(CACHE, "tiny-phi3-longrope"), "Phi3ForCausalLM",
                                         tokenizer_dir, perturb_norms=True, tie_word_embeddings=True,
                                         original_max_position_embeddings=ORIGINAL, rope_parameters=_longrope(1)),
        # the original context is the whole context: the short factors, scaled by attention_factor
        "longrope-short": make_tiny_checkpoint(
            os.path.join(CACHE, "tiny-phi3-longrope-short"), "Phi3ForCausalLM", tokenizer_dir, perturb_norms=True,
            original_max_position_embeddings=512, rope_parameters=_longrope(2, attention_factor=1.25)),
    }


def tiny(model: str, **kw) -> LLM:
    return LLM(model, dtype="float32", kv_cache_space=0.05, max_model_len=512, block_size=16, **kw)


@pytest.mark.parametrize("name", ["default", "longrope", "longrope-short"])
def test_phi3_matches_transformers(phi3, name):
    """Greedy tokens and per-step log-probabilities equal transformers' (the fused qkv_proj and
    gate_up_proj split into Llama's shards; RoPE on 3/4 of each head for LongRoPE)."""
    llm = tiny(phi3[name])
    assert llm.llm_engine.model.layers[0].self_attn.rotary_emb.rotary_dim == (16 if name == "default" else 12)
    if name == "default":
        assert all(a.sliding_window == 8 for a in llm.llm_engine.model.attention_layers())
    if name == "longrope":  # (transformers uses the long factors only past the original context)
        assert min(len(llm.get_tokenizer()(p)["input_ids"]) for p in PROMPTS) > ORIGINAL
    for prompt in PROMPTS:
        assert_matches_hf(phi3[name], llm, prompt, atol=1e-4)


def write_phi3_gguf(hf_folder: str, path: str, q8: bool = False) -> None:
    """A GGUF file of a tiny HF Phi-3 checkpoint as llama.cpp's converter lays it out: arch `phi3`,
    q/k/v fused in attn_qkv (not permuted), gate and up fused in ffn_up, the rotary width as
    rope.dimension_count, LongRoPE's factors as the tensors rope_factors_long/short with the
    original context and attention factor in the header, the sliding window (0: none). F32, or
    with `q8` every matrix but the embedding in Q8_0 blocks; no tokenizer (the test passes the HF
    folder's)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_folder, "config.json")))
    sd = load_file(os.path.join(hf_folder, "model.safetensors"))
    rope = cfg["rope_parameters"]
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w = GGUFWriter(path, "phi3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    w.add_vocab_size(cfg["vocab_size"])

    def add(name: str, t) -> None:
        a = np.ascontiguousarray(torch.as_tensor(t).float().numpy())
        if q8 and a.ndim == 2 and name != "token_embd.weight":
            w.add_tensor(name, quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    if rope["rope_type"] == "longrope":
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        add("rope_factors_long.weight", rope["long_factor"])
        add("rope_factors_short.weight", rope["short_factor"])
    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        add("output.weight", sd["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for gg, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                       ("attn_qkv", "self_attn.qkv_proj"), ("attn_output", "self_attn.o_proj"),
                       ("ffn_up", "mlp.gate_up_proj"), ("ffn_down", "mlp.down_proj")):
            add(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["default", "longrope"])
def test_phi3_gguf_matches_transformers(phi3, tmp_path, name):
    """A `phi3` GGUF: its config completed from the header (rotary width, LongRoPE factors and
    original context, sliding window) gives transformers' greedy tokens; in Q8_0 blocks the fused
    projections stay int8 (q/k/v and gate/up as shards of Llama's fused layers) and stay close."""
    from armserve.layers.rotary_embedding import rope_parameters
    from armserve.model_loader import load_config, resolve_model_path

    folder = phi3[name]
    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    write_phi3_gguf(folder, f32)
    write_phi3_gguf(folder, q8, q8=True)
    got, want = load_config(resolve_model_path(f32)), load_config(resolve_model_path(folder))
    assert got.architectures == ["Phi3ForCausalLM"] and got.sliding_window == want.sliding_window
    rg, rw = rope_parameters(got), rope_parameters(want)
    for key in ("rope_type", "partial_rotary_factor", "original_max_position_embeddings", "rope_theta"):
        assert rg.get(key) == rw.get(key), key
    for key in ("short_factor", "long_factor"):  # (float32 in the file)
        assert rg.get(key) == (None if key not in rw else pytest.approx(rw[key], rel=1e-6)), key
    llm = tiny(f32, tokenizer=folder)
    assert type(llm.llm_engine.model).__name__ == "Phi3ForCausalLM"
    # the untied token table is read where the file is mapped (quantization/embedding.py), not copied
    table = llm.llm_engine.model.embed_tokens.table
    assert (type(table).__name__ == "MappedEmbedding") == (name == "default")
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, o.prompt_token_ids) for o in outs]

    q = tiny(q8, tokenizer=folder)
    layer = q.llm_engine.model.layers[0]
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        # (Q8_0 as w8h where a row holds an even number of blocks, else w8)
        assert isinstance(m, QuantizedLinear)
        assert {p.fmt for p in m.parts} == {"w8h" if m.in_features % 64 == 0 else "w8"}
    for prompt in PROMPTS[:2]:
        assert_next_token_logprobs_close(llm, q, prompt, 0.15)  # int8 weights and activations


def test_quantize_phi3(phi3, tmp_path):
    """`armserve quantize` makes the fused qkv_proj and gate_up_proj int4 too; the folder loads
    them as Llama's shards and stays close to its own dequantized weights."""
    from armserve.quantization.quantize import quantize_model

    out = tmp_path / "q"
    quantize_model(phi3["longrope"], str(out), group_size=32, progress=False)
    q = tiny(str(out))
    layer = q.llm_engine.model.layers[1]
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(m, QuantizedLinear) and {p.fmt for p in m.parts} == {"w4"}
    deq = tiny(str(out), quantization="none")
    assert_next_token_logprobs_close(q, deq, PROMPTS[0], 0.15)  # int8 activations only
