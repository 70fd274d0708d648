"""DeepSeek-V2/V3: Multi-head Latent Attention over the latent KV cache and DeepSeekMoE routing,
against transformers (routers, YaRN, greedy tokens through every engine path), absorbed decode
against the expanded reference, the cache's size, the int8 latent cache, GGUF files in
llama.cpp's `deepseek2` layout and `armserve quantize`."""

from __future__ import annotations

import json
import logging
import math
import os

import pytest
import torch

from armserve import LLM, SamplingParams
from armserve.layers.fused_moe import select_experts
from armserve.layers.mla import MLAAttention, mla_attention_ref
from conftest import TINY_MLA, assert_next_token_logprobs_close
from test_moe import N, PROMPTS, hf_greedy

R, P = TINY_MLA["kv_lora_rank"], TINY_MLA["qk_rope_head_dim"]
LAYERS = TINY_MLA["num_hidden_layers"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, min_tokens=N)


def tiny(folder: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_space", 0.02)
    kw.setdefault("block_size", 16)
    kw.setdefault("max_model_len", 256)
    return LLM(folder, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---- routing and rope against transformers' modules ------------------------------------------


@pytest.mark.parametrize("case", ["v2_greedy", "v2_group_limited", "v3"])
def test_deepseek_routing_matches_transformers_router(case):
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    kw = dict(hidden_size=32, n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=1.7)
    if case == "v3":
        router = DeepseekV3TopkRouter(DeepseekV3Config(**kw, n_group=4, topk_group=2, norm_topk_prob=True))
        router.e_score_correction_bias.copy_(0.2 * torch.randn(8))
    else:
        method = "greedy" if case == "v2_greedy" else "group_limited_greedy"
        router = DeepseekV2TopkRouter(DeepseekV2Config(**kw, n_group=4, topk_group=2, topk_method=method))
    router.weight.data.normal_()
    x = torch.randn(50, 32)
    _, want_w, want_ids = router(x)
    v3 = case == "v3"
    groups = 1 if case == "v2_greedy" else 4
    w, ids = select_experts(x @ router.weight.T, 3, renormalize=v3, scoring="sigmoid" if v3 else "softmax",
                            correction_bias=router.e_score_correction_bias if v3 else None,
                            num_groups=groups, topk_groups=2, routed_scale=1.7)
    order_got, order_want = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(w.gather(1, order_got.indices), want_w.gather(1, order_want.indices))


def test_yarn_rope_matches_transformers():
    """YaRN's frequencies and its cos/sin factor as transformers computes them for DeepSeek."""
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from armserve.layers.rotary_embedding import _inv_freq, rope_attention_factor, rope_parameters

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
              "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.8}
    cfg = DeepseekV2Config(qk_rope_head_dim=64, rope_parameters=params)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    got = rope_parameters(cfg)
    torch.testing.assert_close(_inv_freq(64, got), want_freq)
    assert rope_attention_factor(got) == pytest.approx(want_factor)
    assert want_factor != 1.0  # mscale != mscale_all_dim: the factor is really exercised


# ---- MLA: absorbed decode against the expanded reference -------------------------------------


def random_mla(seed: int = 0, heads: int = 4, nope: int = 32, v: int = 24) -> tuple[MLAAttention, torch.Tensor]:
    torch.manual_seed(seed)
    w_kv_b = torch.randn(heads * (nope + v), R) / R**0.5
    attn = MLAAttention(heads, R, P, nope, v, scale=(nope + P) ** -0.5)
    attn.set_kv_b(w_kv_b)
    return attn, w_kv_b


def test_absorbed_decode_equals_expanded_reference():
    """Decode with W_UK absorbed into the query and W_UV into the output, over latent rows shared
    by every head (padded contexts of different lengths), equals per-head attention over the
    up-projected keys and values; so does the expanded (prefill) form, causal and masked."""
    attn, w_kv_b = random_mla()
    H = attn.num_heads
    lens = [5, 17, 9]
    L = max(lens)
    kv = torch.randn(len(lens), L, R + P)
    q_nope, q_pe = torch.randn(len(lens), H, attn.nope_dim), torch.randn(len(lens), H, P)
    mask = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None])[:, None, :]
    got = attn.absorbed(q_nope, q_pe, kv, mask)
    for b, n in enumerate(lens):
        want = mla_attention_ref(q_nope[b:b + 1], q_pe[b:b + 1], kv[b, :n], w_kv_b, R, attn.scale,
                                 torch.tensor([n - 1]))
        torch.testing.assert_close(got[b], want[0], atol=1e-5, rtol=1e-4)
        # the expanded form on the same query, as a one-token chunk over a cached context
        exp = attn.expanded(q_nope[b:b + 1], q_pe[b:b + 1], kv[b, :n], torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(exp[0], want[0], atol=1e-5, rtol=1e-4)
    # a fresh prefill of 7 tokens (causal)
    q_nope, q_pe, ctx = torch.randn(7, H, attn.nope_dim), torch.randn(7, H, P), torch.randn(7, R + P)
    torch.testing.assert_close(attn.expanded(q_nope, q_pe, ctx, None),
                               mla_attention_ref(q_nope, q_pe, ctx, w_kv_b, R, attn.scale, torch.arange(7)),
                               atol=1e-5, rtol=1e-4)


def test_mla_layer_step_mixes_decodes_and_chunks():
    """One step through the paged cache: two decodes and a chunk with a cached prefix; each row
    equals the reference over what the cache holds, and the step's rows land at their slots."""
    from armserve.layers.attention import AttentionMetadata, PrefillChunk, set_attention_metadata

    attn, w_kv_b = random_mla(1)
    H, bs, nb = attn.num_heads, 16, 8
    attn.kv_cache = torch.randn(nb, bs, R + P)  # earlier tokens' rows: whatever is there
    blocks = {0: [3, 5], 1: [1], 2: [6, 0]}  # request -> its blocks
    ctx = {0: 20, 1: 9, 2: 25}  # tokens after this step; 0 and 1 decode one, 2 computes its last 6

    def slots(r: int, n: int) -> torch.Tensor:
        p = torch.arange(n)
        return torch.tensor(blocks[r])[p // bs] * bs + p % bs

    new = {0: slots(0, 20)[-1:], 1: slots(1, 9)[-1:], 2: slots(2, 25)[-6:]}
    T = 8
    q_nope, q_pe = torch.randn(T, H, attn.nope_dim), torch.randn(T, H, P)
    latent, k_pe = torch.randn(T, R), torch.randn(T, P)
    md = AttentionMetadata(slot_mapping=torch.cat([new[0], new[1], new[2]]), num_decodes=2)
    md.decode_slots = torch.zeros(2, 20, dtype=torch.long)
    md.decode_slots[0] = slots(0, 20)
    md.decode_slots[1, :9] = slots(1, 9)
    md.decode_context_lens = torch.tensor([20, 9])
    md.prefills.append(PrefillChunk(q_start=2, q_len=6, context_len=25, slots=slots(2, 25),
                                    positions=torch.arange(19, 25), fresh=False))
    set_attention_metadata(md)
    try:
        out = attn(q_nope, q_pe, latent, k_pe).view(T, H, -1)
    finally:
        set_attention_metadata(None)
    flat = attn.kv_cache.view(-1, R + P)
    assert torch.equal(flat[md.slot_mapping], torch.cat([latent, k_pe], dim=-1))
    rows = {0: slice(0, 1), 1: slice(1, 2), 2: slice(2, 8)}
    for r in range(3):
        pos = torch.arange(ctx[r] - (rows[r].stop - rows[r].start), ctx[r])
        want = mla_attention_ref(q_nope[rows[r]], q_pe[rows[r]], flat[slots(r, ctx[r])], w_kv_b, R, attn.scale, pos)
        torch.testing.assert_close(out[rows[r]], want, atol=1e-5, rtol=1e-4)


# ---- the models against transformers -----------------------------------------------------------


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def deepseek(request, tiny_checkpoints):
    """(folder, each prompt's greedy tokens from transformers)."""
    folder = tiny_checkpoints[request.param]
    tok = tiny(folder).get_tokenizer()
    return folder, [hf_greedy(folder, tok.encode(p)) for p in PROMPTS]


def test_deepseek_matches_transformers_on_every_path(deepseek):
    """4 prompts x 32 greedy tokens equal transformers': each alone, in a batch of 4 with prefix
    caching on and off, with a token budget of 8 (chunked prefill over the cached latent rows), and
    in a cache of 6 blocks that forces preemption and recompute."""
    folder, want = deepseek
    llm = tiny(folder)
    assert [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS] == want  # alone
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want  # batched, prefix caching on
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # the same prompts: prefix cache hits
    assert tokens(again) == want and llm.llm_engine.kv.prefix_hits > 0
    assert tokens(tiny(folder, enable_prefix_caching=False).generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    chunked = tiny(folder, max_num_batched_tokens=8)
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    block = 16 * LAYERS * (R + P) * 4  # 16 tokens x 3 layers x one latent row of float32
    small = tiny(folder, kv_cache_space=6 * block / 2**30)
    assert small.llm_engine.kv.num_blocks == 6
    assert tokens(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert small.llm_engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_bfloat16_tracks_transformers_bfloat16(tiny_checkpoints, name):
    """In bfloat16 (packed dense kernels, MLA in bf16) the next-token log-probs stay within 0.1 of
    transformers' own bfloat16 run (as test_models' bf16 check); both differ from float32 by more here."""
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoints[name]
    llm = tiny(folder, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for out in llm.generate(PROMPTS, p, use_tqdm=False):
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([out.prompt_token_ids])).logits[0, -1].float(), dim=-1)
        got = out.outputs[0].logprobs[0]
        assert max(abs(lp.logprob - want[t].item()) for t, lp in got.items()) < 0.1  # (measured <= 0.06)


def test_latent_cache_holds_one_row_per_token_per_layer(tiny_checkpoints, caplog):
    """The cache is (kv_lora_rank + qk_rope_head_dim) values per token per layer, no per-head K/V;
    the block count, the start-up log's tokens-that-fit and `armserve info --model` agree."""
    folder = tiny_checkpoints["deepseek_v3"]
    with caplog.at_level(logging.INFO, logger="armserve"):
        llm = tiny(folder, kv_cache_space=0.01)
    runner, kv = llm.llm_engine.runner, llm.llm_engine.kv
    assert runner.kv_cache.shape == (LAYERS, kv.num_blocks + 1, 16, R + P) and runner.kv_scales is None
    assert kv.num_blocks == int(0.01 * 2**30) // (16 * LAYERS * (R + P) * 4)
    assert all(a.kv_cache.shape == (kv.num_blocks + 1, 16, R + P) for a in llm.llm_engine.model.attention_layers())
    assert f"= {kv.num_blocks * 16} tokens" in caplog.text
    assert f"{LAYERS * (R + P) * 4} bytes per token" in caplog.text

    q8 = tiny(folder, kv_cache_space=0.01, kv_cache_dtype="int8")
    r8 = q8.llm_engine.runner
    assert r8.kv_cache.dtype == torch.int8 and r8.kv_cache.shape[-1] == R + P
    assert r8.kv_scales.shape == (LAYERS, q8.llm_engine.kv.num_blocks + 1, 16, 2)  # latent's and rope's scale
    assert q8.llm_engine.kv.num_blocks == int(0.01 * 2**30) // (16 * LAYERS * (R + P + 8))


def test_armserve_info_reports_latent_cache(tiny_checkpoints, capsys):
    from armserve.cli import main

    folder = tiny_checkpoints["deepseek_v2"]
    assert main(["info", "--json", "--model", folder, "--dtype", "float32", "--kv-cache-space", "0.01",
                 "--block-size", "16"]) == 0
    kv = json.loads(capsys.readouterr().out)["kv_cache"]
    assert (kv["rows_per_token_per_layer"], kv["values_per_row"]) == (1, R + P)
    assert kv["bytes_per_token"] == LAYERS * (R + P) * 4
    assert kv["tokens"] == int(0.01 * 2**30) // (16 * LAYERS * (R + P) * 4) * 16


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_int8_latent_cache_close_to_float(tiny_checkpoints, name):
    """int8 latent rows, teacher-forced on the float cache's greedy continuations: the log-prob of
    each token moves little (median < 0.04) and int8's argmax is the float model's greedy token at
    >= 85% of the generated positions. Batching, chunking and prefix hits change nothing.

    NOTE: not "the same 32 tokens": a router at a near tie flips to another expert on a 0.03 move
    of its logit, and a tiny random MoE then says something else entirely from there on."""
    folder = tiny_checkpoints[name]
    f, q8 = tiny(folder), tiny(folder, kv_cache_dtype="int8")
    gen = f.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in gen]
    tf = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    ref, got = (llm.generate([{"prompt_token_ids": s} for s in seqs], tf, use_tqdm=False) for llm in (f, q8))
    deltas, agree = [], []
    for s, o, a, b in zip(seqs, gen, ref, got):
        for i in range(1, len(s)):
            deltas.append(abs(a.prompt_logprobs[i][s[i]].logprob - b.prompt_logprobs[i][s[i]].logprob))
            if i >= len(o.prompt_token_ids):  # a generated position: float's token is its argmax
                agree.append(next(t for t, lp in b.prompt_logprobs[i].items() if lp.rank == 1) == s[i])
    deltas.sort()
    # (measured: median 0.024 / 0.011, argmax agreement 95% / 92% for V2 / V3)
    assert 0 < deltas[len(deltas) // 2] < 0.04, deltas[len(deltas) // 2]  # (0: int8 changed nothing?)
    assert sum(agree) / len(agree) >= 0.85, sum(agree) / len(agree)
    alone = [tokens(q8.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert tokens(q8.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone  # batched, prefix hits
    chunked = tiny(folder, kv_cache_dtype="int8", max_num_batched_tokens=8)
    assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == alone


# ---- GGUF (llama.cpp's deepseek2) and armserve quantize ----------------------------------------


def write_deepseek_gguf(hf_folder: str, path: str, split_kv_b: bool, q8: bool = False) -> None:
    """A GGUF file of a tiny HF DeepSeek checkpoint as llama.cpp's converter lays it out: arch
    `deepseek2`, experts stacked in ffn_{gate,up,down}_exps, the router bias as exp_probs_b; with
    `split_kv_b` the newer MLA layout (kv_b split into attn_k_b [H, R, nope] (transposed) and
    attn_v_b [H, v, R], key/value lengths of the MQA view plus the _mla ones), else attn_kv_b.
    F32, or with `q8` every matrix but the embedding in Q8_0 blocks (k_b/v_b too, as 3-d tensors);
    no tokenizer (the test passes the HF folder's)."""
    import numpy as np
    from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType
    from gguf.quants import quantize
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(hf_folder, "config.json")))
    sd = load_file(os.path.join(hf_folder, "model.safetensors"))
    a = "deepseek2"
    H, nope, v, rank = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    rope = cfg["qk_rope_head_dim"]
    w = GGUFWriter(path, a)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(1 if split_kv_b else H)
    w.add_rope_freq_base(float(cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_rope_dimension_count(rope)
    rp = cfg["rope_parameters"]
    if rp["rope_type"] == "yarn":  # llama.cpp keeps 0.1 * mscale_all_dim, not mscale
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rp["mscale_all_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    v3 = cfg["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(cfg["n_group"] or 1)
    w.add_expert_group_used_count(cfg["topk_group"] or 1)

    def add(name: str, t: torch.Tensor) -> None:
        a = np.ascontiguousarray(t.float().numpy())
        if q8 and a.ndim >= 2 and name != "token_embd.weight":
            w.add_tensor(name, quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    add("output.weight", sd["lm_head.weight"])
    names = {"q_proj": "attn_q", "q_a_proj": "attn_q_a", "q_a_layernorm": "attn_q_a_norm", "q_b_proj": "attn_q_b",
             "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "o_proj": "attn_output"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        add(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        for hf, gg in names.items():
            if p + f"self_attn.{hf}.weight" in sd:
                add(f"blk.{i}.{gg}.weight", sd[p + f"self_attn.{hf}.weight"])
        kv_b = sd[p + "self_attn.kv_b_proj.weight"]
        if split_kv_b:
            k_b, v_b = kv_b.view(H, nope + v, rank).split([nope, v], dim=1)
            add(f"blk.{i}.attn_k_b.weight", k_b.transpose(1, 2))
            add(f"blk.{i}.attn_v_b.weight", v_b)
        else:
            add(f"blk.{i}.attn_kv_b.weight", kv_b)
        if i < cfg["first_k_dense_replace"]:
            for gg in ("gate", "up", "down"):
                add(f"blk.{i}.ffn_{gg}.weight", sd[p + f"mlp.{gg}_proj.weight"])
            continue
        add(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"])
        if v3:
            add(f"blk.{i}.exp_probs_b.bias", sd[p + "mlp.gate.e_score_correction_bias"])
        for gg in ("gate", "up", "down"):
            stacked = torch.stack([sd[p + f"mlp.experts.{e}.{gg}_proj.weight"] for e in range(cfg["n_routed_experts"])])
            add(f"blk.{i}.ffn_{gg}_exps.weight", stacked)
            add(f"blk.{i}.ffn_{gg}_shexp.weight", sd[p + f"mlp.shared_experts.{gg}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("split_kv_b", [False, True], ids=["kv_b", "k_b_v_b"])
def test_deepseek_gguf_round_trip(tiny_checkpoints, tmp_path, split_kv_b):
    """A `deepseek2` GGUF of the V3 checkpoint (config from the header: sigmoid gating, groups,
    scaling, q_lora_rank; kv_b whole or split) gives transformers' greedy tokens."""
    folder = tiny_checkpoints["deepseek_v3"]
    path = str(tmp_path / "ds.gguf")
    write_deepseek_gguf(folder, path, split_kv_b)
    llm = tiny(path, tokenizer=folder)
    assert type(llm.llm_engine.model).__name__ == "DeepseekV3ForCausalLM"
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert tokens(outs) == [hf_greedy(folder, o.prompt_token_ids) for o in outs]


def test_deepseek_gguf_q8_0_stays_quantized_and_close(tiny_checkpoints, tmp_path):
    """Q8_0 blocks: MLA's q/kv-a/o projections and the experts run as int8 weights, kv_b (split,
    3-d blocks) is dequantized for absorption; next-token log-probs stay close to the F32 file's."""
    from armserve.quantization import QuantizedLinear

    folder = tiny_checkpoints["deepseek_v3"]
    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    write_deepseek_gguf(folder, f32, split_kv_b=True)
    write_deepseek_gguf(folder, q8, split_kv_b=True, q8=True)
    a, b = tiny(f32, tokenizer=folder), tiny(q8, tokenizer=folder)
    attn, mlp = b.llm_engine.model.layers[1].self_attn, b.llm_engine.model.layers[1].mlp
    # (Q8_0 as w8h where a row holds an even number of blocks, else w8)
    assert all(isinstance(m, QuantizedLinear)
               and [p.fmt for p in m.parts] == ["w8h" if m.in_features % 64 == 0 else "w8"] for m in (
        attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj, mlp.experts[0].down_proj))
    assert attn.attn.w_uk is not None
    for p in PROMPTS[:2]:
        assert_next_token_logprobs_close(a, b, p, 0.15)  # int8 weights and activations everywhere (measured 0.12)


def test_deepseek_v2_gguf_header_gives_its_config(tiny_checkpoints, tmp_path):
    """The V2 checkpoint's header (softmax gating, group-limited greedy, full-rank q, YaRN) read
    back into the config the HF folder has, but for YaRN's mscale: the file keeps only
    mscale_all_dim, so mscale is taken equal to it (as DeepSeek's own configs have it)."""
    from armserve.model_loader import load_config, resolve_model_path

    folder = tiny_checkpoints["deepseek_v2"]
    path = str(tmp_path / "v2.gguf")
    write_deepseek_gguf(folder, path, split_kv_b=True)
    got, want = load_config(resolve_model_path(path)), load_config(resolve_model_path(folder))
    assert got.architectures == ["DeepseekV2ForCausalLM"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
                "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace",
                "topk_method", "n_group", "topk_group", "vocab_size"):
        assert getattr(got, key) == getattr(want, key), key
    for key in ("routed_scaling_factor", "rms_norm_eps"):  # (float32 in the file)
        assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-6), key
    rg, rw = got.rope_parameters, want.rope_parameters
    assert rg["rope_type"] == "yarn" and rg["factor"] == rw["factor"]
    assert rg["original_max_position_embeddings"] == rw["original_max_position_embeddings"]
    assert rg["mscale_all_dim"] == pytest.approx(rw["mscale_all_dim"]) and rg["mscale"] == rg["mscale_all_dim"]


def test_quantize_deepseek(tiny_checkpoints, tmp_path):
    """`armserve quantize`: experts (routed and shared) and MLA's q/kv-a/o projections int4,
    kv_b_proj and the router kept float; the folder runs and stays close to its dequantized self."""
    from armserve.quantization import QuantizedLinear
    from armserve.quantization.quantize import quantize_model

    out = tmp_path / "q"
    quantize_model(tiny_checkpoints["deepseek_v3"], str(out), group_size=32, progress=False)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.self_attn.kv_b_proj.weight" in keys  # float
    assert "model.layers.1.self_attn.q_b_proj.qweight" in keys and "model.layers.1.mlp.gate.weight" in keys
    q = tiny(str(out))
    layer = q.llm_engine.model.layers[1]
    assert all(isinstance(m, QuantizedLinear) for m in (
        layer.self_attn.q_a_proj, layer.self_attn.q_b_proj, layer.self_attn.kv_a_proj_with_mqa, layer.self_attn.o_proj,
        layer.mlp.experts[0].gate_up_proj, layer.mlp.shared_experts.down_proj))
    assert not isinstance(layer.mlp.gate, QuantizedLinear)
    deq = tiny(str(out), quantization="none")
    assert_next_token_logprobs_close(q, deq, PROMPTS[0], 0.15)  # int8 activations only
    assert math.isfinite(q.generate(PROMPTS[:1], SamplingParams(max_tokens=4, logprobs=1),
                                    use_tqdm=False)[0].outputs[0].cumulative_logprob)
