"""Tensor parallelism (armserve/distributed.py, layers/linear.py): TP=2 on this 2-core machine (one
core per rank) gives TP=1's greedy float32 tokens for Llama, Qwen2 and an MoE, and for quantized
checkpoints (w4a8, GGUF blocks), which stay quantized; the parallel layers' parts add up to the
whole layer; chunked prefill, prefix caching and preemption still work; the shared-memory
all-reduce equals torch.distributed's gloo; a rank that dies fails the step instead of hanging it."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch

from armserve import LLM, SamplingParams
from armserve import cpu
from armserve.cpu import core_groups
from armserve.distributed import CommSpec, ShmGroup, TPError, make_comm_spec
from armserve.layers.linear import Linear, ParallelContext, parallel_context
from armserve.quantization import QuantizedLinear, quantize_weight, quantize_weight_int8

from test_engine import BLOCK_BYTES_TINY, GREEDY, mixed_prompts, tiny, token_lists


def tp_pair(folder: str, **kw) -> tuple[LLM, LLM]:
    return tiny(folder, **kw), tiny(folder, tensor_parallel_size=2, **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2_moe"])
def test_tp2_equals_tp1(tiny_checkpoints, arch):
    """Same greedy tokens, and logprobs / prompt logprobs (the gathered vocabulary) within float32
    rounding; the model really is split: half the heads, half the KV cache heads, half the vocabulary."""
    one, two = tp_pair(tiny_checkpoints[arch])
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(one.get_tokenizer())]
    assert token_lists(two.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_lists(one.generate(prompts, GREEDY, use_tqdm=False))

    e1, e2 = one.llm_engine, two.llm_engine
    a1, a2 = e1.model.layers[0].self_attn, e2.model.layers[0].self_attn
    assert (a2.num_heads, a2.attn.num_kv_heads) == (a1.num_heads // 2, a1.attn.num_kv_heads // 2)
    assert e2.runner.kv_cache.shape[3] == e1.runner.kv_cache.shape[3] // 2
    assert e2.model.embed_tokens.weight.shape[0] == e1.model.embed_tokens.weight.shape[0] // 2
    assert e2.kv.num_blocks == 2 * e1.kv.num_blocks  # kv_cache_space is per rank

    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    r1, r2 = (llm.generate(prompts[:3], params, use_tqdm=False) for llm in (one, two))
    for o1, o2 in zip(r1, r2):
        assert o1.outputs[0].token_ids == o2.outputs[0].token_ids
        for s1, s2 in zip(o1.outputs[0].logprobs, o2.outputs[0].logprobs):
            assert s1.keys() == s2.keys()
            assert all(abs(s1[t].logprob - s2[t].logprob) < 1e-4 for t in s1)
        for s1, s2 in zip(o1.prompt_logprobs[1:], o2.prompt_logprobs[1:]):
            assert all(abs(s1[t].logprob - s2[t].logprob) < 1e-4 for t in s1 if t in s2)


def test_tp2_uneven_split(tokenizer_dir):
    """SmolLM2's shape (9 query heads in 3 KV groups, which 2 ranks cannot halve) splits by whole
    KV groups, 1 and 2, and an intermediate width of 200 as 100 + 100, odd vocabulary shards
    padded: the same greedy tokens as TP=1."""
    from conftest import CACHE, make_tiny_checkpoint

    folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama-9h3kv"), "LlamaForCausalLM", tokenizer_dir,
                                  hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
                                  intermediate_size=200)
    one, two = tp_pair(folder)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(one.get_tokenizer())]
    assert token_lists(two.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_lists(one.generate(prompts, GREEDY, use_tqdm=False))
    attn = two.llm_engine.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (3, 1)  # rank 0's share; rank 1 holds 6 and 2
    assert two.llm_engine.runner.kv_cache.shape[3] == 1


def test_tp2_phi3_equals_tp1(tokenizer_dir):
    """A family added in one file (models/phi3.py, whose checkpoint fuses q/k/v and gate/up) splits
    over ranks with no tensor-parallel code of its own: the same greedy tokens as TP=1, with LongRoPE
    on part of each head and a tied head split by vocabulary."""
    from conftest import CACHE, make_tiny_checkpoint
    from test_phi3 import ORIGINAL, _longrope

    folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-phi3-longrope"), "Phi3ForCausalLM", tokenizer_dir,
                                  perturb_norms=True, tie_word_embeddings=True,
                                  original_max_position_embeddings=ORIGINAL, rope_parameters=_longrope(1))
    one, two = tp_pair(folder)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(one.get_tokenizer())]
    assert token_lists(two.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_lists(one.generate(prompts, GREEDY, use_tqdm=False))
    a1, a2 = one.llm_engine.model.layers[0].self_attn, two.llm_engine.model.layers[0].self_attn
    assert a2.num_heads == a1.num_heads // 2


def test_tp2_gemma3_equals_tp1(tokenizer_dir):
    """Gemma 3 (scaled embedding split by vocabulary, (1 + w) q/k norms per head, sliding and global
    layers, GELU-tanh MLP split by width): the same greedy tokens as TP=1, one KV head per rank."""
    from conftest import CACHE, make_tiny_checkpoint

    folder = make_tiny_checkpoint(
        os.path.join(CACHE, "tiny-gemma3-2kv"), "Gemma3ForCausalLM", tokenizer_dir, perturb_norms=True,
        num_hidden_layers=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    one, two = tp_pair(folder)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(one.get_tokenizer())]
    assert token_lists(two.generate(prompts, GREEDY, use_tqdm=False)) == \
        token_lists(one.generate(prompts, GREEDY, use_tqdm=False))
    assert two.llm_engine.model.layers[0].self_attn.num_kv_heads == 1


def test_tp2_chunked_prefill_preemption_and_prefix_caching(tiny_llama):
    """Under TP=2: prompts chunked into 16-token steps through a 10-block cache (preempting)
    give the tokens each prompt gets alone at TP=1; prefix-cache hits change nothing either, nor
    an idle trim between steps (`release_idle_memory`, which reaches rank 1 too)."""
    ref = tiny(tiny_llama, enable_prefix_caching=False)
    prompts = mixed_prompts(ref.get_tokenizer())
    alone = [ref.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    # one rank's block holds half the KV heads: half the bytes
    small = tiny(tiny_llama, tensor_parallel_size=2, max_num_batched_tokens=16,
                 kv_cache_space=10 * BLOCK_BYTES_TINY / 2 / 2**30)
    engine = small.llm_engine
    assert engine.kv.num_blocks == 10
    outs = small.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert token_lists(outs) == alone
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    del small

    shared = prompts[-1]
    variants = [{"prompt_token_ids": shared + p[:5]} for p in prompts]
    want = token_lists(ref.generate(variants, GREEDY, use_tqdm=False))
    on = tiny(tiny_llama, tensor_parallel_size=2)
    on.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False)
    # Idle between the two: rank 0 hands back its step scratch and tells rank 1 to trim its heap
    # (a message between steps, which the rank must not take for a step); nothing else changes.
    on.llm_engine.release_idle_memory()
    outs = on.generate(variants, GREEDY, use_tqdm=False)
    assert token_lists(outs) == want
    assert all(o.num_cached_tokens >= 16 for o in outs)
    assert all(p.is_alive() for p in on.llm_engine.tp_workers.procs)


def assert_same_greedy(one: LLM, two: LLM, prompts: list, atol: float) -> None:
    """`two` picks `one`'s greedy tokens, their log-probabilities (and the runner-up's) within
    `atol`, except at a tie (`one`'s top two within `atol`), which either may break: there the
    two sequences may part."""
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    for a, b in zip(one.generate(prompts, params, use_tqdm=False), two.generate(prompts, params, use_tqdm=False)):
        a, b = a.outputs[0], b.outputs[0]
        for x, y, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            assert all(abs(la[t].logprob - lb[t].logprob) < atol for t in la.keys() & lb.keys()), (la, lb)
            if x != y:
                assert y in la and la[x].logprob - la[y].logprob < atol, (x, y, la, lb)
                break


def linear_kinds(llm: LLM) -> dict[str, str]:
    """Each linear layer of rank 0's model: its name -> float Linear or QuantizedLinear."""
    return {n: type(m).__name__ for n, m in llm.llm_engine.model.named_modules()
            if isinstance(m, (Linear, QuantizedLinear))}


def write_llama_gguf(hf_folder: str, path: str, f32: bool = False, q5_0: bool = False, q6_k: bool = False) -> None:
    """A tiny Llama checkpoint as llama.cpp lays out a `llama` GGUF (q/k rows permuted for its
    rotary), its types mixed as K-quant files mix them: q and the MLP in Q4_0 blocks, v, the
    output projection and down in Q8_0, k in F32 (int8 beside its quantized q and v), the token
    table in Q8_0 and no `output` tensor (the LM head is the table, as a quantized GEMM).
    `f32`: a faithful copy instead: every tensor in F32, and the checkpoint's own LM head.
    `q5_0`: Q5_0 where Q4_0 is and for the token table (Q4_K_M's fallback for rows of 896).
    `q6_k`: Q6_K where Q8_0 is (v, the output projection, down and the token table), as Q4_K_M
    stores down and the LM head, where rows are whole 256-value blocks."""
    import json

    import numpy as np
    from gguf import GGMLQuantizationType as Q, GGUFWriter
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_folder, "config.json")))
    sd = load_file(os.path.join(hf_folder, "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(path, "llama")
    for key, value in (("context_length", cfg["max_position_embeddings"]), ("embedding_length", cfg["hidden_size"]),
                       ("block_count", cfg["num_hidden_layers"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", n_head), ("attention.head_count_kv", n_kv),
                       ("vocab_size", cfg["vocab_size"])):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])

    def add(name: str, t: torch.Tensor, qtype: Q = Q.F32, heads: int = 0) -> None:
        if heads:  # llama.cpp's rotary row order
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        a = np.ascontiguousarray(t.float().numpy())
        qtype = Q.F32 if f32 else (Q.Q5_0 if q5_0 and (qtype == Q.Q4_0 or "token_embd" in name) else qtype)
        if q6_k and qtype == Q.Q8_0 and a.shape[1] % 256 == 0:
            from test_quantized import q6_k_blocks  # (the gguf package cannot write K-quants)

            w.add_tensor(name, q6_k_blocks(a), raw_dtype=Q.Q6_K)
            return
        w.add_tensor(name, a if qtype == Q.F32 else quantize(a, qtype), raw_dtype=None if qtype == Q.F32 else qtype)

    add("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    add("output_norm.weight", sd["model.norm.weight"])
    if f32 and "lm_head.weight" in sd:
        add("output.weight", sd["lm_head.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        add(f"blk.{i}.attn_q.weight", sd[p + "self_attn.q_proj.weight"], Q.Q4_0, n_head)
        add(f"blk.{i}.attn_k.weight", sd[p + "self_attn.k_proj.weight"], Q.F32, n_kv)
        add(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"], Q.Q8_0)
        add(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"], Q.Q8_0)
        add(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"], Q.Q4_0)
        add(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"], Q.Q4_0)
        add(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"], Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["w4a8", "gguf", "moe_gguf"])
def test_tp2_quantized_equals_tp1(tiny_llama, tiny_checkpoints, tmp_path, kind):
    """The same quantized weights at TP=2 and TP=1 give the same greedy tokens (logits within
    float32 rounding, ties allowed), and stay quantized: every layer quantized at TP=1 is a
    QuantizedLinear at TP=2 too, holding half of it. `armserve quantize` w4a8 (group 32, the LM
    head int8); a Llama GGUF mixing Q4_0, Q8_0 and a float k beside them, its LM head the Q8_0
    token table; a Qwen2-MoE GGUF with Q8_0 experts."""
    from armserve.quantization.quantize import quantize_model

    tokenizer = None
    if kind == "w4a8":
        path = str(tmp_path / "w4a8")
        quantize_model(tiny_llama, path, group_size=32, progress=False)
    elif kind == "gguf":
        path, tokenizer = str(tmp_path / "llama.gguf"), tiny_llama
        write_llama_gguf(tiny_llama, path)
    else:
        from test_moe import write_moe_gguf

        path, tokenizer = str(tmp_path / "moe.gguf"), tiny_checkpoints["qwen2_moe"]
        write_moe_gguf(tokenizer, path, expert_type="Q8_0")
    one, two = (tiny(path, tokenizer=tokenizer, tensor_parallel_size=tp, max_model_len=256) for tp in (1, 2))
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(one.get_tokenizer())]
    assert_same_greedy(one, two, prompts, atol=1e-4)

    kinds = linear_kinds(one)
    assert linear_kinds(two) == kinds
    quantized = [n for n, k in kinds.items() if k == "QuantizedLinear"]
    if kind == "moe_gguf":  # (the file's attention, routers, shared expert and LM head are float)
        assert quantized == [n for n in kinds if ".experts." in n] and len(quantized) == 2 * 6 * 2
    else:
        assert quantized == list(kinds) and "lm_head" in quantized
    m1, m2 = one.llm_engine.model, two.llm_engine.model
    for name in quantized:
        a, b = m1.get_submodule(name), m2.get_submodule(name)
        row_parallel = name.endswith(("o_proj", "down_proj"))
        half = (a.in_features // 2, a.out_features) if row_parallel else (a.in_features, a.out_features // 2)
        assert (b.in_features, b.out_features) == half, name


def test_tp2_with_shared_weights_equals_tp1(tiny_llama, tmp_path, monkeypatch):
    """Tensor-parallel ranks map their shares of the weights from a file each (share_weights) and give
    TP=1's greedy tokens; the ranks' group (its shared-memory all-reduce buffer, at an address the
    group keeps) is not a weight and stays where it is."""
    from armserve.model_loader import weight_cache

    monkeypatch.setenv("ARMSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_BYTES", 4096)  # (rank 0's every packed weight; rank 1 keeps 1 MiB)
    path = str(tmp_path / "llama.gguf")
    write_llama_gguf(tiny_llama, path)
    one = tiny(path, tokenizer=tiny_llama, max_model_len=256)
    two = tiny(path, tokenizer=tiny_llama, tensor_parallel_size=2, max_model_len=256, share_weights=True)
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts(one.get_tokenizer())]
    assert_same_greedy(one, two, prompts, atol=1e-4)
    files = sorted(f for f in os.listdir(tmp_path / "cache" / "weights") if f.endswith(".bin"))
    assert len(files) == 2, files  # one per rank
    mapped = {weight_cache.mapped_file(p.packed) for p in two.llm_engine.model.layers[0].mlp.down_proj.parts}
    assert mapped == {str(tmp_path / "cache" / "weights" / f) for f in files} & mapped and None not in mapped


class _PartialSums:
    """A collective that leaves each rank's partial sum (a test adds them up itself) and keeps what
    a rank sends to a gather."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor) -> None:
        self.sent.append(x)


def _tiny_llama_rank(world: int, rank: int, weights: list, **cfg):
    """A one-layer Llama (4 heads of 16, one KV head) built as `rank` of `world`, filled with
    `weights`, its quantized layers packed."""
    from types import SimpleNamespace

    from armserve.models.llama import LlamaForCausalLM

    config = SimpleNamespace(**{**dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                       rms_norm_eps=1e-6, vocab_size=31, hidden_act="silu", rope_theta=10000.0), **cfg})
    with parallel_context(ParallelContext(rank, world, _PartialSums())):
        model = LlamaForCausalLM(config)
    model.load_weights(weights)
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.finalize()
    return model


def _sums_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal but for the order of float32 sums."""
    return bool((got - want).norm() / want.norm() < 1e-6)


def test_quantized_parallel_layers_add_up_to_the_whole():
    """Two ranks' w4 / int8 layers hold half of each weight, still quantized, and their parts add
    up to one rank's layer: q heads split and the one KV head shared (column-parallel), o_proj
    and down_proj by input columns (row-parallel, partial sums), gate_up by width, an int8 LM head
    of 31 rows as 16 + 15, its logits gathered zero-padded to equal widths and cut back to 31."""
    torch.manual_seed(0)
    p = "model.layers.0."
    shapes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (16, 64), "self_attn.v_proj": (16, 64),
              "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
              "mlp.down_proj": (64, 128)}
    weights = [(p + n + ".weight", quantize_weight(torch.randn(*shape), 32, symmetric=False))
               for n, shape in shapes.items()]
    weights.append(("lm_head.weight", quantize_weight_int8(torch.randn(31, 64))))
    whole, r0, r1 = _tiny_llama_rank(1, 0, weights), _tiny_llama_rank(2, 0, weights), _tiny_llama_rank(2, 1, weights)
    assert not any(isinstance(m, Linear) for model in (r0, r1) for m in model.modules())
    x = torch.randn(5, 64)

    a, a0, a1 = (m.layers[0].self_attn for m in (whole, r0, r1))
    assert (a0.num_heads, a0.num_kv_heads, a1.num_heads, a1.num_kv_heads) == (2, 1, 2, 1)
    qkv, qkv0, qkv1 = a.qkv_proj(x), a0.qkv_proj(x), a1.qkv_proj(x)
    torch.testing.assert_close(torch.cat([qkv0[:, :32], qkv1[:, :32]], dim=1), qkv[:, :64], rtol=0, atol=0)
    torch.testing.assert_close(qkv0[:, 32:], qkv[:, 64:], rtol=0, atol=0)
    torch.testing.assert_close(qkv1[:, 32:], qkv[:, 64:], rtol=0, atol=0)
    h = torch.randn(5, 64)
    assert _sums_close(a0.o_proj(h[:, :32]) + a1.o_proj(h[:, 32:]), a.o_proj(h))
    mlp, mlp0, mlp1 = (m.layers[0].mlp for m in (whole, r0, r1))
    assert (mlp0.gate_up_proj.out_features, mlp0.down_proj.in_features) == (128, 64)
    assert _sums_close(mlp0(x) + mlp1(x), mlp(x))
    head0, head1 = r0.lm_head(x), r1.lm_head(x)
    assert head0.shape == (5, 16) and head1.shape == (5, 15)
    torch.testing.assert_close(torch.cat([head0, head1], dim=1), whole.lm_head(x), rtol=0, atol=0)
    assert r1.compute_logits(x) is None  # rank 1 sends its share, zero-padded to rank 0's width
    torch.testing.assert_close(r1.tp.group.sent[0], torch.cat([head1, torch.zeros(5, 1)], dim=1), rtol=0, atol=0)


def test_quantized_split_inside_a_group_is_refused():
    """A row-parallel split that would cut a quantization group (o_proj's 64 input columns in
    one group of 64, split at 32) is a clear error naming the weight, not a wrong answer."""
    w = quantize_weight(torch.randn(64, 64), 64, symmetric=True)
    with pytest.raises(ValueError, match=r"o_proj.weight cannot be split at input columns 0\.\.32 of 64.*groups of 64"):
        _tiny_llama_rank(2, 0, [("model.layers.0.self_attn.o_proj.weight", w)])


def test_mla_refuses_tensor_parallelism(tiny_checkpoints):
    from armserve import model_loader
    from armserve.models.deepseek import DeepseekV2ForCausalLM

    config = model_loader.load_config(model_loader.resolve_model_path(tiny_checkpoints["deepseek_v2"]))
    with parallel_context(ParallelContext(0, 2, _PartialSums())), \
            pytest.raises(ValueError, match="DeepseekV2ForCausalLM cannot be split for tensor parallelism"):
        DeepseekV2ForCausalLM(config)


def _collective_rank(rank: int, shm: CommSpec, init_method: str, results) -> None:
    torch.set_num_threads(1)
    group = shm.join(rank)
    gloo = CommSpec("gloo", 2, init_method=init_method).join(rank)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 7, 64):
            g = torch.Generator().manual_seed(1000 * rank + rows)
            x = torch.randn(rows, 576, generator=g).to(dtype)
            a, b = group.all_reduce(x.clone()), gloo.all_reduce(x.clone())
            out[(str(dtype), rows)] = (a, b)
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(rank))
    out["gather"] = (group.gather(logits), gloo.gather(logits))
    results.put((rank, pickle.dumps(out)))  # by value: this process exits before the test reads it


def test_shm_all_reduce_equals_gloo():
    """Two processes: the shared-memory all-reduce (in pieces: a 4 KiB slot) equals gloo's, bit for
    bit, in float32 and bfloat16, on both ranks; the logits gather equals gloo's all-gather."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    shm = make_comm_spec(2, 4096, kind="shm")
    init = make_comm_spec(2, 0, kind="gloo").init_method
    procs = [ctx.Process(target=_collective_rank, args=(r, shm, init, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = {rank: pickle.loads(data) for rank, data in (results.get(timeout=120) for _ in procs)}
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for key, (a, b) in got[0].items():
        if key == "gather":
            assert got[1][key][0] is None and a.shape == (5, 600)
            assert torch.equal(a, b)
            continue
        assert torch.equal(a, b), key
        assert torch.equal(a, got[1][key][0]), key  # both ranks hold the same sum
        dtype, rows = key
        assert a.shape == (rows, 576)
    # and it is the sum: rank 0's input plus rank 1's
    x0 = torch.randn(7, 576, generator=torch.Generator().manual_seed(7))
    x1 = torch.randn(7, 576, generator=torch.Generator().manual_seed(1007))
    assert torch.equal(got[0][("torch.float32", 7)][0], x0 + x1)


def test_a_dead_rank_fails_the_step(tiny_llama):
    llm = tiny(tiny_llama, tensor_parallel_size=2)
    workers = llm.llm_engine.tp_workers
    workers.procs[0].kill()
    box: list = []

    def run() -> None:
        try:
            llm.generate(["hello"], GREEDY, use_tqdm=False)
            box.append("finished")
        except Exception as e:  # noqa: BLE001
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the step hung"
    assert isinstance(box[0], TPError), box


def test_core_groups_per_rank(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("ARMSERVE_THREADS_BIND", "0|1")
    assert core_groups(2) == ["0", "1"]
    with pytest.raises(ValueError, match="tensor_parallel_size 4 needs one per rank"):
        core_groups(4)
    monkeypatch.setenv("ARMSERVE_THREADS_BIND", "")  # unbound: the allowed cores split evenly
    monkeypatch.setattr(cpu, "allowed_cpus", lambda: [4, 5, 6, 7, 8])
    monkeypatch.setattr(cpu, "physical_cores", lambda cpus=None: [4, 5, 6, 7, 8])
    assert core_groups(2) == ["4,5", "6,7"]


def test_cli_generate_with_tensor_parallel(tiny_llama):
    out = subprocess.run([sys.executable, "-m", "armserve.cli", "generate", "--model", tiny_llama, "--tensor-parallel-size", "2",
                          "--dtype", "float32", "--kv-cache-space", "0.02", "--max-tokens", "5", "--temperature", "0",
                          "--json", "--prompt", "hello there"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    ref = tiny(tiny_llama, kv_cache_space=0.02).generate(["hello there"], SamplingParams(max_tokens=5, temperature=0),
                                                         use_tqdm=False)
    import json

    assert json.loads(out.stdout.splitlines()[-1])["token_ids"] == ref[0].outputs[0].token_ids
