"""Heads that draft from the target's hidden states: EAGLE-3 (speculative_config method "eagle3")
and DeepSeek-V3's MTP layer ("mtp"). The drafts of tiny random heads in the checkpoint formats
vLLM loads against plain-PyTorch references of the published designs (target hidden states from
transformers), greedy output identical to decoding without speculation (EAGLE-3: with drafts
accepted and rejected, preemption and prefix caching), and bad heads as named errors."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.nn.functional as F

from armserve import LLM, SamplingParams
from armserve.config import ConfigError

from conftest import CACHE, make_tiny_checkpoint

H, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128
DRAFT_VOCAB = 512


@pytest.fixture(scope="module")
def target4(tokenizer_dir) -> str:
    """A tiny random 4-layer Llama: vLLM's default aux layers (2, n // 2, n - 3) exist."""
    return make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama4"), "LlamaForCausalLM", tokenizer_dir,
                                num_hidden_layers=4)


def _head_config(vocab: int, **extra) -> dict:
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=H,
               intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
               num_hidden_layers=1, rms_norm_eps=1e-6, max_position_embeddings=512, rope_theta=10000.0,
               hidden_act="silu", vocab_size=vocab, draft_vocab_size=DRAFT_VOCAB, tie_word_embeddings=False,
               torch_dtype="float32")
    cfg.update(extra)
    return cfg


def random_head_tensors(vocab: int, seed: int = 0, draft_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A random EAGLE-3 head's tensors under SafeAILab's / vLLM's names (no embed_tokens: the
    target's table is shared); the draft vocabulary is `draft_ids` (sorted target ids)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    if draft_ids is None:
        draft_ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return {
        "midlayer.self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "midlayer.input_layernorm.weight": 1 + w(H, scale=0.3),
        "midlayer.hidden_norm.weight": 1 + w(H, scale=0.3),
        "midlayer.post_attention_layernorm.weight": 1 + w(H, scale=0.3),
        "fc.weight": w(H, 3 * H, scale=0.1),
        "norm.weight": 1 + w(H, scale=0.3),
        "lm_head.weight": w(DRAFT_VOCAB, H, scale=0.5),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def write_head(path: str, tensors: dict[str, torch.Tensor], config: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


# ---- the reference: the published design in plain torch ----------------------------------------


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=10000.0):  # x [T, heads, d], rotate-half layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].float()
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_head(t: dict[str, torch.Tensor], embed: torch.Tensor, tokens: list[int], hidden: torch.Tensor,
                   norm_before_residual: bool = False):
    """The head over its whole sequence (row p: token tokens[p], hidden[p], position p), causal:
    (draft logits, outputs before the final norm) of every row."""
    T = len(tokens)
    pos = torch.arange(T)
    e = _rms(embed[torch.tensor(tokens)], t["midlayer.input_layernorm.weight"])
    h = _rms(hidden, t["midlayer.hidden_norm.weight"])
    x = torch.cat([e, h], -1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    q, k = _rope(q, pos), _rope(k, pos)
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    a = att.transpose(0, 1).reshape(T, HEADS * HEAD_DIM) @ t["midlayer.self_attn.o_proj.weight"].T
    r = a + (h if norm_before_residual else hidden)  # the fused hidden state (normed or not) is the residual
    m = _rms(r, t["midlayer.post_attention_layernorm.weight"])
    m = (F.silu(m @ t["midlayer.mlp.gate_proj.weight"].T) * (m @ t["midlayer.mlp.up_proj.weight"].T)
         ) @ t["midlayer.mlp.down_proj.weight"].T
    pre = m + r
    return _rms(pre, t["norm.weight"]) @ t["lm_head.weight"].T, pre


@functools.lru_cache(maxsize=64)
def _target_aux(target, ctx: tuple[int, ...]) -> torch.Tensor:
    """The target's hidden states entering vLLM's default aux layers (2, n // 2, n - 3), of
    positions 0 .. len(ctx) - 2, concatenated."""
    with torch.no_grad():
        hs = target(torch.tensor([ctx]), output_hidden_states=True).hidden_states
    n = target.config.num_hidden_layers
    return torch.cat([hs[i][0] for i in (2, n // 2, n - 3)], -1)[:-1]


def reference_logits(target, t, ctx: list[int], drafts: list[int], nbr: bool = False) -> torch.Tensor:
    """The reference head's draft-vocabulary logits for the next draft after the known tokens
    `ctx` and the drafts before it (`nbr`: norm_before_residual)."""
    with torch.no_grad():
        hidden = _target_aux(target, tuple(ctx)) @ t["fc.weight"].T
        tokens = list(ctx[1:])  # row p: the token at p + 1
        for d in drafts:  # each further step: the draft before it and the head's own output
            _, pre = reference_head(t, target.model.embed_tokens.weight, tokens, hidden, nbr)
            tokens.append(d)
            hidden = torch.cat([hidden, pre[-1:]])
        return reference_head(t, target.model.embed_tokens.weight, tokens, hidden, nbr)[0][-1]


def spy_on_drafts(llm) -> list:
    """Wraps the engine's head proposer: every draft logits row it computes is noted as (the known
    tokens, the drafts before it, the engine's logits row, the draft it chose)."""
    proposer = llm.llm_engine.backend.scheduler.proposer
    calls: list[torch.Tensor] = []  # each draft_token_ids call's logits
    orig_ids = proposer.head.draft_token_ids

    def draft_ids(normed):
        calls.append(proposer.head._local_logits(normed).clone())
        return orig_ids(normed)

    checks = []  # (known tokens, drafts before, the engine's logits, its draft)
    orig_record, orig_propose = proposer.record, proposer.propose_batch

    def record(out, starts, aux):
        before = {id(s.request): s.request.spec and s.request.spec.eagle for s in out.scheduled}
        calls.clear()
        orig_record(out, starts, aux)
        ready = [s.request for s in out.scheduled if s.request.spec and s.request.spec.eagle is not None
                 and s.request.spec.eagle is not before[id(s.request)]]
        for n, req in enumerate(ready):
            checks.append((list(req.all_token_ids), [], calls[-1][n], req.spec.eagle[2]))

    def propose(items):
        calls.clear()
        drafts = orig_propose(items)
        for j, rows in enumerate(calls, start=1):  # step j: the requests drafting more than j tokens
            for row, (req, d) in zip(rows, [(r, d) for (r, _, _), d in zip(items, drafts) if len(d) > j]):
                checks.append((list(req.all_token_ids), d[:j], row, d[j]))
        return drafts

    proposer.head.draft_token_ids, proposer.record, proposer.propose_batch = draft_ids, record, propose
    return checks


def _speculators_head(path: str, t: dict[str, torch.Tensor], vocab: int) -> str:
    """The same head in the `speculators` format (vLLM reads both): `layers.0.*` names, the layer's
    config nested, norm_before_residual on by default."""
    layer = {k: v for k, v in _head_config(vocab).items() if k not in ("architectures", "draft_vocab_size")}
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "draft_vocab_size": DRAFT_VOCAB,
           "transformer_layer_config": layer, "speculators_config": {"algorithm": "eagle3"}}
    return write_head(path, {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}, cfg)


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_drafts_match_the_reference(target4, tmp_path, fmt):
    """Every draft logit row the head computes (first drafts right after a target step, later ones
    in the proposing steps) equals the reference's for that sequence and the drafts before it;
    SafeAILab's format and the speculators format (norm before the residual) alike."""
    from transformers import AutoModelForCausalLM

    vocab = json.load(open(os.path.join(target4, "config.json")))["vocab_size"]
    t = random_head_tensors(vocab)
    if fmt == "eagle":
        head = write_head(str(tmp_path / "head"), t, _head_config(vocab))
    else:
        head = _speculators_head(str(tmp_path / "head"), t, vocab)
    # (a budget of 16 tokens: the long prompt is prefilled in chunks while the others decode)
    llm = LLM(target4, dtype="float32", kv_cache_space=0.02, max_model_len=256, block_size=16,
              max_num_batched_tokens=16,
              speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    checks = spy_on_drafts(llm)
    prompts = [[5, 17, 300, 41, 9], list(range(200, 240)), [7, 7, 7, 1000, 2000, 3000, 12]]
    # (fewer tokens than a back-off lasts: no request drafts again over head KV it skipped)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(checks) >= 12 and sum(1 for c in checks if c[1]) >= 4
    graphs = llm.llm_engine.backend.runner.graphs
    if graphs.enabled:  # the target's hidden states came from replayed steps too
        assert graphs.replays + graphs.verify_replays > 0
    target = AutoModelForCausalLM.from_pretrained(target4, dtype=torch.float32).eval()
    to_draft = {int(tid): i for i, tid in enumerate(torch.arange(DRAFT_VOCAB) + t["d2t"])}
    for ctx, before, got, token in checks:
        want = reference_logits(target, t, ctx, before, nbr=fmt == "speculators")
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
        assert got[to_draft[token]] == got.max()  # the draft: the argmax, mapped by d2t


# ---- greedy output identical: a head that is right one token in two -------------------------------


@pytest.fixture(scope="module")
def cycle_pair(target4, tmp_path_factory):
    """A target whose next token follows a cycle over 16 tokens (every attention and MLP output
    zeroed, so each layer's input is the token's embedding, and an LM head that maps each cycle
    token to the next) and a head that predicts the token after next from the target's hidden
    state (its layer's outputs zeroed too): its first draft is always right, its second (fed its
    own output) always wrong, which exercises accepted and rejected drafts in the same run."""
    from transformers import AutoModelForCausalLM

    out = str(tmp_path_factory.mktemp("eagle") / "cycle-target")
    model = AutoModelForCausalLM.from_pretrained(target4, dtype=torch.float32)
    cycle = list(range(3000, 3016))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        unit = [_rms(emb[c], model.model.norm.weight) for c in cycle]
        for i, c in enumerate(cycle):
            model.lm_head.weight[cycle[(i + 1) % 16]] = unit[i]
    model.save_pretrained(out)
    vocab = model.config.vocab_size
    draft_ids = torch.tensor(sorted(set(cycle) | set(range(0, DRAFT_VOCAB - 16))))
    t = random_head_tensors(vocab, seed=1, draft_ids=draft_ids)
    t["midlayer.self_attn.o_proj.weight"].zero_()
    t["midlayer.mlp.down_proj.weight"].zero_()
    # fc passes the first aux state (the token's embedding) through
    t["fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, 2 * H)], 1)
    t["norm.weight"] = torch.ones(H)
    lm = t["lm_head.weight"] * 0.05
    for i, c in enumerate(cycle):
        lm[int((draft_ids == cycle[(i + 2) % 16]).nonzero())] = _rms(emb[c], torch.ones(H)).detach()
    t["lm_head.weight"] = lm
    head = write_head(str(tmp_path_factory.mktemp("eagle") / "cycle-head"), t, _head_config(vocab))
    return out, head, cycle


def _run(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def test_greedy_identical_with_accepted_and_rejected_drafts(cycle_pair, tokenizer_dir):
    target, head, cycle = cycle_pair
    kw = dict(kv_cache_space=0.0002, max_model_len=256, block_size=16, tokenizer=tokenizer_dir)  # tight: preemptions
    plain = LLM(target, **kw)
    spec = LLM(target, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3}, **kw)
    prompts = [cycle[:5], cycle[3:9] + cycle[:2], [11, 12, 13] + cycle[7:10], cycle[:5]] * 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _run(plain, prompts, params)
    assert want[0][:3] == cycle[5:8]  # (the target follows its cycle)
    backend = spec.llm_engine.backend
    proposer, firsts = backend.scheduler.proposer, []
    orig = proposer.propose_batch

    def propose(items):  # (each request's first draft, and the two tokens before it)
        drafts = orig(items)
        firsts.extend((req.all_token_ids[-2:], d[0]) for (req, _, _), d in zip(items, drafts) if d)
        return drafts

    proposer.propose_batch = propose
    assert _run(spec, prompts, params) == want
    # on the cycle, the first draft is the token after next of the hidden state's token: always right
    nxt = {c: cycle[(i + 1) % 16] for i, c in enumerate(cycle)}
    on_cycle = [(last, d) for last, d in firsts if nxt.get(last[0]) == last[1]]
    assert len(on_cycle) >= 40 and all(d == nxt[last[1]] for last, d in on_cycle)
    st = backend.scheduler.spec_stats
    assert st.num_accepted_tokens >= 60 and st.num_draft_tokens > st.num_accepted_tokens
    assert st.num_accepted_tokens_per_pos[0] > 5 * st.num_accepted_tokens_per_pos[1]
    assert backend.scheduler.num_preemptions > 0 and backend.kv.prefix_hits > 0
    backend.kv.check_invariants()
    assert backend.kv.num_free_blocks == backend.kv.num_blocks


# ---- bad heads ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target4_model(target4):
    """armserve's model of target4 and its config, for loading heads against."""
    from armserve import model_loader

    src = model_loader.resolve_model_path(target4)
    config = model_loader.load_config(src)
    return model_loader.load_model(src, config, torch.float32), config


@pytest.mark.parametrize("change, words", [
    (lambda t, c: c.update(hidden_size=32, head_dim=8), "reads hidden states of size 32"),
    (lambda t, c: c.update(hidden_size=32, head_dim=8, target_hidden_size=H), "hidden size 32 and no embed_tokens"),
    (lambda t, c: c.update(vocab_size=1000), "vocabulary of 1000 tokens"),
    (lambda t, c: c.update(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head"),
    (lambda t, c: t.pop("fc.weight"), "missing 1 tensor"),
    (lambda t, c: t.pop("midlayer.hidden_norm.weight"), "missing 1 tensor"),
    (lambda t, c: t.pop("d2t"), "no d2t mapping"),
    (lambda t, c: t.update(d2t=t["d2t"][:-1]), "d2t must be 512 integers"),
    (lambda t, c: t["d2t"].__setitem__(1, t["d2t"][0] - 1), "same target id"),
    (lambda t, c: t["d2t"].__setitem__(-1, 10**6), "outside the target's vocabulary"),
    (lambda t, c: t["t2d"].__setitem__(int(t["t2d"].nonzero()[0]), False), "t2d does not mark"),
    (lambda t, c: t.update({"fc.weight": torch.zeros(H, 2 * H)}), "fc.weight"),
    (lambda t, c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), "outside this 4-layer"),
])
def test_bad_heads_are_named_errors(target4_model, tmp_path, change, words):
    from armserve.models.eagle3 import load_eagle3_head

    model, config = target4_model
    t, c = random_head_tensors(config.vocab_size), _head_config(config.vocab_size)
    change(t, c)
    head = write_head(str(tmp_path / "head"), t, c)
    with pytest.raises(ConfigError, match=words):
        load_eagle3_head(head, model, config, torch.float32)


def test_a_missing_head_is_named(target4_model, tmp_path):
    from armserve.models.eagle3 import load_eagle3_head

    model, config = target4_model
    with pytest.raises(ConfigError, match="EAGLE-3 head .*nowhere' cannot be read: .*does not exist"):
        load_eagle3_head(str(tmp_path / "nowhere"), model, config, torch.float32)


def test_a_bad_head_fails_the_engine_start(target4, tmp_path):
    vocab = json.load(open(os.path.join(target4, "config.json")))["vocab_size"]
    t = random_head_tensors(vocab)
    t.pop("lm_head.weight")
    head = write_head(str(tmp_path / "head"), t, _head_config(vocab))
    with pytest.raises(ConfigError, match="EAGLE-3 head .* is missing 1 tensor.*lm_head.weight"):
        LLM(target4, kv_cache_space=0.01, max_model_len=64,
            speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 2})


def test_eagle3_config_errors():
    from armserve.config import EngineConfig

    with pytest.raises(ConfigError, match="needs the head's checkpoint folder"):
        EngineConfig(model="m", speculative_config={"method": "eagle3"})
    with pytest.raises(ConfigError, match="'eagle3' with tensor_parallel_size > 1"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config={"method": "eagle3", "model": "h"})


# ---- DeepSeek-V3 MTP ---------------------------------------------------------------------------


def _mtp_tensors(config, index: int) -> dict[str, torch.Tensor]:
    """A random MTP layer under DeepSeek-V3's names: a random DeepSeek-V3 decoder layer (the
    checkpoint's layer `index`, made by transformers) and the MTP parts around it."""
    import transformers

    cfg = transformers.DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": index + 1})
    torch.manual_seed(3)
    layer = transformers.DeepseekV3ForCausalLM(cfg).model.layers[index]
    g = torch.Generator().manual_seed(4)
    h, v = config.hidden_size, config.vocab_size
    out = {}
    for k, t in layer.state_dict().items():
        if k == "mlp.experts.gate_up_proj":  # (transformers fuses the experts; checkpoints name each)
            for e, w in enumerate(t):
                gate, up = w.chunk(2, dim=0)
                out[f"model.layers.{index}.mlp.experts.{e}.gate_proj.weight"] = gate.clone()
                out[f"model.layers.{index}.mlp.experts.{e}.up_proj.weight"] = up.clone()
        elif k == "mlp.experts.down_proj":
            for e, w in enumerate(t):
                out[f"model.layers.{index}.mlp.experts.{e}.down_proj.weight"] = w.clone()
        else:
            out[f"model.layers.{index}.{k}"] = t.detach().clone()
    out[f"model.layers.{index}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(config.n_routed_experts,
                                                                                        generator=g)
    for k in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{index}.{k}.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    for k in ("input_layernorm", "post_attention_layernorm"):
        out[f"model.layers.{index}.{k}.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    out[f"model.layers.{index}.eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h, generator=g)
    out[f"model.layers.{index}.shared_head.head.weight"] = 0.2 * torch.randn(v, h, generator=g)
    return out


@pytest.fixture(scope="module")
def deepseek_mtp(tokenizer_dir, tmp_path_factory):
    """(the tiny DeepSeek-V3 checkpoint, a copy of it with an MTP layer at index num_hidden_layers
    in a second safetensors file, that layer's tensors)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoConfig

    from conftest import tiny_deepseek_checkpoints

    base = tiny_deepseek_checkpoints(tokenizer_dir)["deepseek_v3"]
    config = AutoConfig.from_pretrained(base)
    out = str(tmp_path_factory.mktemp("mtp") / "deepseek-v3-mtp")
    shutil.copytree(base, out)
    t = _mtp_tensors(config, config.num_hidden_layers)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, "mtp.safetensors"))
    return base, out, t


def reference_mtp(ref, t, n: int, target_hidden: torch.Tensor, embed: torch.Tensor, tokens: list[int]):
    """The MTP layer over its whole sequence (row p: token tokens[p] at position p, the target's
    final hidden state target_hidden[p]): (logits, normed outputs) of every row. `ref`: a one-layer
    transformers DeepSeek-V3 holding the MTP's decoder layer, shared_head.norm as its final norm."""
    p = f"model.layers.{n}."
    e = embed[torch.tensor(tokens)].clone()
    e[0] = 0  # position 0
    x = torch.cat([_rms(e, t[p + "enorm.weight"]), _rms(target_hidden, t[p + "hnorm.weight"])], -1)
    x = x @ t[p + "eh_proj.weight"].T
    out = ref(inputs_embeds=x[None], output_hidden_states=True)
    normed = out.hidden_states[-1][0]
    return normed @ t[p + "shared_head.head.weight"].T, normed


def test_mtp_drafts_match_the_reference_and_greedy_is_unchanged(deepseek_mtp):
    import transformers

    base, ckpt, t = deepseek_mtp
    kw = dict(dtype="float32", kv_cache_space=0.02, max_model_len=128, block_size=16)
    llm = LLM(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kw)
    checks = spy_on_drafts(llm)
    prompts = [[5, 17, 300, 41, 9], list(range(200, 230)), [7, 7, 7, 1000, 2000, 3000, 12]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # (within a back-off: see above)
    got = _run(llm, prompts, params)
    assert got == _run(LLM(base, **kw), prompts, params)
    assert llm.llm_engine.backend.scheduler.spec_stats.num_draft_tokens > 0
    assert len(checks) >= 6 and sum(1 for c in checks if c[1]) >= 3

    target = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    config = target.config
    n = config.num_hidden_layers
    ref = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**config.to_dict(), "num_hidden_layers": 1, "first_k_dense_replace": 0})).eval()
    p = f"model.layers.{n}."
    state = {"model.layers.0." + k[len(p):]: v for k, v in t.items() if k.startswith(p) and not any(
        s in k for s in ("enorm", "hnorm", "eh_proj", "shared_head"))}
    state["model.norm.weight"] = t[p + "shared_head.norm.weight"]
    experts = range(config.n_routed_experts)
    for e in experts:
        for w in ("gate_proj", "up_proj", "down_proj"):
            del state[f"model.layers.0.mlp.experts.{e}.{w}.weight"]
    state["model.layers.0.mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [t[f"{p}mlp.experts.{e}.gate_proj.weight"], t[f"{p}mlp.experts.{e}.up_proj.weight"]]) for e in experts])
    state["model.layers.0.mlp.experts.down_proj"] = torch.stack([t[f"{p}mlp.experts.{e}.down_proj.weight"]
                                                                 for e in experts])
    missing, _ = ref.load_state_dict(state, strict=False)
    assert set(missing) <= {"model.embed_tokens.weight", "lm_head.weight"}, missing
    embed = target.model.embed_tokens.weight
    with torch.no_grad():
        for ctx, before, logits, token in checks:
            hidden = target(torch.tensor([ctx]), output_hidden_states=True).hidden_states[-1][0][:-1]
            tokens = list(ctx[1:])
            for d in before:  # later steps: the previous draft, the layer's own normed output
                _, normed = reference_mtp(ref, t, n, hidden, embed, tokens)
                tokens.append(d)
                hidden = torch.cat([hidden, normed[-1:]])
            want = reference_mtp(ref, t, n, hidden, embed, tokens)[0][-1]
            torch.testing.assert_close(logits, want, atol=2e-3, rtol=1e-3)
            assert logits[token] == logits.max()


def test_mtp_errors_are_named(deepseek_mtp, target4, tmp_path):
    import shutil

    base, ckpt, _ = deepseek_mtp
    kw = dict(kv_cache_space=0.01, max_model_len=64)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="is missing .* tensor.* of MTP layer 3"):
        LLM(base, speculative_config=spec, **kw)  # (its config names one MTP layer, its weights have none)
    with pytest.raises(ConfigError, match="the target is a LlamaForCausalLM"):
        LLM(target4, speculative_config=spec, **kw)
    none = str(tmp_path / "no-mtp")
    shutil.copytree(ckpt, none)
    cfg = json.load(open(os.path.join(none, "config.json")))
    json.dump({**cfg, "num_nextn_predict_layers": 0}, open(os.path.join(none, "config.json"), "w"))
    with pytest.raises(ConfigError, match="no num_nextn_predict_layers"):
        LLM(none, speculative_config=spec, **kw)
