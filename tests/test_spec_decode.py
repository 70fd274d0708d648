"""Speculative decoding (n-gram): config and CLI errors, the rejection sampler against the target
distribution, greedy outputs identical to decoding without it (stop strings, max_tokens, several
sequences, preemption, prefix caching), and its metrics."""

from __future__ import annotations

import os
import time

import pytest
import torch

from armserve import LLM, SamplingParams
from armserve.config import ConfigError, EngineConfig, SpeculativeConfig
from armserve.engine.rejection_sampler import rejection_sample
from armserve.engine.request import Request

from conftest import CACHE

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


# ---- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("value, words", [
    ("{not json", "not valid JSON"),
    ({"method": "ngram", "num_speculative_tokens": 4, "lookahead": 3}, "'lookahead'"),
    ({"method": "medusa"}, "unknown method 'medusa'"),
    ({"method": "draft_model"}, "needs a draft 'model'"),
    ({"method": "draft_model", "model": "x", "quantization": "fp8"}, "unknown draft quantization"),
    ({"method": "draft_model", "model": "x", "draft_vocab_size": -1}, "draft_vocab_size must be an integer >= 0"),
    ({"method": "draft_model", "model": "x", "draft_vocab_size": "all"}, "draft_vocab_size must be an integer"),
    ({"method": "ngram", "draft_vocab_size": 1000}, "draft_vocab_size only applies to method 'draft_model'"),
    ({"method": "eagle3"}, "'eagle3' needs the head's checkpoint folder"),
    ({"num_speculative_tokens": 3}, "needs a 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min 4"),
    ([1, 2], "JSON object"),
])
def test_bad_speculative_config_names_the_problem(value, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        EngineConfig(model="m", speculative_config=value)


def test_speculative_config_refused_where_not_built():
    with pytest.raises(ConfigError, match="not supported by the openvino backend"):
        EngineConfig(model="m", backend="openvino", speculative_config={"method": "ngram"})
    with pytest.raises(ConfigError, match="tensor_parallel_size > 1"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "m"})


def test_speculative_config_from_json_and_dict():
    a = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert a.speculative_config == SpeculativeConfig("ngram", 3)
    assert a.speculative_config.prompt_lookup_min >= 1 and a.speculative_config.prompt_lookup_max >= 2
    assert EngineConfig(model="m").speculative_config is None


def test_cli_flag_errors(capsys):
    from armserve.cli import build_parser, main

    assert main(["generate", "--speculative-config", '{"method": "mtp", "quantization": "w4a8"}', "--max-tokens",
                 "1"]) == 2
    assert "'mtp' takes no 'quantization'" in capsys.readouterr().err
    assert main(["generate", "--speculative-config", "{oops", "--max-tokens", "1"]) == 2
    assert "speculative_config is not valid JSON" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    assert args.speculative_config == '{"method": "ngram"}'


# ---- the rejection sampler, statistically ----------------------------------------------------


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution plain sampling draws from: softmax(logits / T) over the top-k tokens."""
    z = logits / temperature
    kth = z.topk(top_k).values[-1]
    return torch.where(z >= kth, z, float("-inf")).softmax(-1)


def test_rejection_sampler_keeps_the_target_distribution():
    torch.manual_seed(0)
    vocab, draws = 8, 12000
    logits = torch.randn(3, vocab) * 1.5  # rows for: after the known tokens, after d0, after d0 d1
    drafts = [int(logits[0].argsort()[-2]), int(logits[1].argmax())]  # a likely-ish d0, a likely d1
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=10)
    reqs = [Request(str(i), [1, 2, 3], params, 10) for i in range(draws)]
    out = rejection_sample(logits.repeat(draws, 1), reqs, [drafts] * draws, vocab)
    p0, p1 = _target(logits[0], 0.8, 5), _target(logits[1], 0.8, 5)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # second token, given the first was d0
    for acc, token in out:
        toks = acc + [token]
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
    tv_first = 0.5 * (first / draws - p0).abs().sum()
    tv_second = 0.5 * (second / second.sum() - p1).abs().sum()
    # ~0.01 of sampling noise at these counts. A wrong rule misses by far more: accepting the
    # draft always puts 1 - p0(d0) on the wrong token; drawing the rejection from p instead of
    # the residual gives d0 p0(d0) (2 - p0(d0)) instead of p0(d0).
    bound = 0.03
    assert tv_first < bound and tv_second < bound, (tv_first, tv_second)
    wrong_resample = p0[drafts[0]] * (1 - p0[drafts[0]])
    assert min(1 - p0[drafts[0]], wrong_resample) > 3 * bound


def test_rejection_sampler_greedy_is_the_argmax():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    best = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0, max_tokens=10)
    req = Request("r", [1], params, 10)
    assert rejection_sample(logits, [req], [best[:3]], 50) == [(best[:3], best[3])]
    wrong = [best[0], (best[1] + 1) % 50, best[2]]
    assert rejection_sample(logits, [req], [wrong], 50) == [([best[0]], best[1])]


# ---- the engine: a model whose next token follows from the last one ----------------------------


@pytest.fixture(scope="module")
def markov_llama(tiny_llama) -> str:
    """The tiny random Llama with every attention output projection zeroed: its next token is a
    function of the current one, so a prompt that lists a chain of its own greedy tokens and then
    starts the chain again is continued by that chain (drafts get accepted), and anything else is
    continued by tokens n-gram lookup does not guess."""
    out = os.path.join(CACHE, "tiny-llama-markov-" + os.path.basename(tiny_llama).split("-")[-1])
    if not os.path.isfile(os.path.join(out, "config.json")):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
        tmp = f"{out}.tmp{os.getpid()}"  # (test_forced_isa's variant runs may make it side by side)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process made it first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def engines(markov_llama):
    kw = dict(kv_cache_space=0.02, max_model_len=256, block_size=16)
    return LLM(markov_llama, **kw), LLM(markov_llama, speculative_config=NGRAM, **kw)


def _chain_prompts(off: LLM) -> list[list[int]]:
    """Prompts: a chain of the model's greedy tokens then its start again (long runs accepted),
    a few of its tokens followed by others (drafts accepted, then rejected), and plain text
    (nothing to look up)."""
    start = off.get_tokenizer()("The cat sat")["input_ids"]
    chain = off.generate([{"prompt_token_ids": start}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    plain = off.get_tokenizer()("hello world, this is a test of")["input_ids"]
    return [start + chain + start, start + chain[:6] + plain[:4] + start, plain]


def _run(llm: LLM, prompts, params):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _spec_stats(llm: LLM):
    return llm.llm_engine.backend.scheduler.spec_stats.copy()


def test_greedy_batch_equals_no_speculation(engines):
    off, on = engines
    prompts = _chain_prompts(off)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    before = _spec_stats(on)
    want = [c.token_ids for c in _run(off, prompts, params)]
    got = [c.token_ids for c in _run(on, prompts, params)]
    assert got == want
    after = _spec_stats(on)
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 20
    assert after.num_draft_tokens - before.num_draft_tokens > after.num_accepted_tokens - before.num_accepted_tokens
    on.llm_engine.backend.kv.check_invariants()
    assert on.llm_engine.backend.kv.num_free_blocks == on.llm_engine.backend.kv.num_blocks


def test_stops_inside_an_accepted_run(engines):
    off, on = engines
    prompt = _chain_prompts(off)[0]
    full = _run(off, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens mid-run
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[full.token_ids[9]]),
        SamplingParams(temperature=0, max_tokens=30, stop=[full.text[len(full.text) // 3:len(full.text) // 3 + 4]]),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[full.token_ids[5]]),
    ]
    for params in cases:
        want, got = _run(off, [prompt], params)[0], _run(on, [prompt], params)[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params
    assert len(_run(on, [prompt], cases[0])[0].token_ids) == 7


def test_logprobs_of_a_verified_run(engines):
    off, on = engines
    prompt = _chain_prompts(off)[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    before = _spec_stats(on).num_accepted_tokens
    want, got = _run(off, [prompt], params)[0], _run(on, [prompt], params)[0]
    assert _spec_stats(on).num_accepted_tokens - before >= 10
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 20
    for g, w in zip(got.logprobs, want.logprobs):
        assert set(g) == set(w)
        for t in w:
            assert g[t].rank == w[t].rank and abs(g[t].logprob - w[t].logprob) < 1e-3
    assert abs(got.cumulative_logprob - want.cumulative_logprob) < 1e-2


def _tight_space(llm: LLM) -> float:
    """A KV space of 26 blocks of 16 tokens of the tiny Llamas, whatever KV dtype dtype="auto" picks
    on this CPU (float32 where bfloat16 is not native: twice a bfloat16 block's bytes)."""
    return 0.0001 * llm.llm_engine.backend.kv_cache_dtype.itemsize / 2


def test_preemption_and_prefix_caching_with_speculation(markov_llama, engines):
    off, _ = engines
    prompts = _chain_prompts(off) * 3
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    want = [c.token_ids for c in _run(off, prompts, params)]
    # a cache too small for all nine sequences at once: some are preempted and recomputed
    tight = LLM(markov_llama, kv_cache_space=_tight_space(off), max_model_len=256, block_size=16,
                speculative_config=NGRAM)
    backend = tight.llm_engine.backend
    assert [c.token_ids for c in _run(tight, prompts, params)] == want
    assert backend.scheduler.num_preemptions > 0 and backend.scheduler.spec_stats.num_accepted_tokens > 0
    hits = backend.kv.prefix_hits
    assert [c.token_ids for c in _run(tight, prompts[:1], params)] == want[:1]  # its prefix is cached now
    assert backend.kv.prefix_hits > hits
    backend.kv.check_invariants()
    assert backend.kv.num_free_blocks == backend.kv.num_blocks


def test_random_sampling_runs_and_penalties_apply(engines):
    _, on = engines
    prompts = [p for p in _chain_prompts(on)[:2]]
    outs = _run(on, prompts, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, ignore_eos=True,
                                           repetition_penalty=1.1))
    assert all(len(c.token_ids) == 20 for c in outs)


# ---- a real model: SmolLM2 copying a list ---------------------------------------------------


@pytest.mark.parametrize("weights", [{"dtype": "float32", "quantization": "none"}, {}],
                         ids=["float32", "gguf-default"])
def test_smollm2_greedy_identical_with_and_without(smollm2_gguf, weights):
    """Speculation changes how many positions a step computes, never what a position gets: the
    logprobs of every emitted token are the same bits with it as without (docs/speculative_decoding.md),
    for dense float32 weights and for the GGUF's own (quantized blocks, int8 activations, bfloat16)."""
    llm = LLM(smollm2_gguf, kv_cache_space=0.05, max_model_len=512, **weights,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi. "
               "Again: apple, banana,", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    scheduler = llm.llm_engine.backend.scheduler
    proposer, scheduler.proposer = scheduler.proposer, None  # the plain decode path first
    want = llm.generate(prompts, params, use_tqdm=False)
    scheduler.proposer = proposer
    got = llm.generate(prompts, params, use_tqdm=False)

    def bits(outs):
        return [[(t, {k: v.logprob for k, v in lp.items()}) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]

    assert bits(got) == bits(want)
    assert scheduler.spec_stats.num_accepted_tokens >= 5


# ---- metrics -----------------------------------------------------------------------------


def test_metrics_under_vllm_names(caplog):
    import logging

    from armserve.engine.stat_loggers import LoggingStatLogger
    from armserve.engine.stats import IterationStats, SchedulerStats, SpecDecodingStats
    from armserve.entrypoints.metrics import PrometheusMetrics

    m = PrometheusMetrics("m")
    sd = SpecDecodingStats(num_drafts=3, num_draft_tokens=12, num_accepted_tokens=7,
                           num_accepted_tokens_per_pos=[3, 2, 1, 1])
    m.record(SchedulerStats(spec_decoding=sd), IterationStats())
    sd2 = SpecDecodingStats(4, 16, 8, [4, 2, 1, 1])
    m.record(SchedulerStats(spec_decoding=sd2), IterationStats())
    text = m.render().decode()
    for name, value in (("spec_decode_num_drafts_total", 4.0), ("spec_decode_num_draft_tokens_total", 16.0),
                        ("spec_decode_num_accepted_tokens_total", 8.0)):
        for prefix in ("vllm", "armserve"):
            assert f'{prefix}:{name}{{engine="0",model_name="m"}} {value}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 4.0' in text
    log = LoggingStatLogger(interval=0.0)
    log.record(SchedulerStats(num_running=1, spec_decoding=sd2), IterationStats(num_generation_tokens=5))
    with caplog.at_level(logging.INFO, logger="armserve"):
        log.maybe_log()
    assert "Draft acceptance rate: 50.0%" in caplog.text


# ---- draft models ----------------------------------------------------------------------------


def test_draft_model_drafting_for_itself_is_always_accepted(tiny_llama, engines):
    """The target drafting for itself at full precision: every draft must be accepted, which holds
    only if the draft's own KV cache follows each sequence exactly (catch-up, rollback, prefix-cache
    hits, preemption)."""
    off, _ = engines
    prompts = [[1, 2, 3, 4], list(range(100, 140)), list(range(100, 140)), [7] * 30]
    kw = dict(kv_cache_space=_tight_space(off), max_model_len=256, block_size=16)  # tight: preemptions
    plain = LLM(tiny_llama, **kw)
    spec = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama,
                                               "num_speculative_tokens": 3}, **kw)
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    want = [c.token_ids for c in _run(plain, prompts, params)]
    backend = spec.llm_engine.backend
    assert [c.token_ids for c in _run(spec, prompts, params)] == want
    st = backend.scheduler.spec_stats
    assert st.num_draft_tokens > 50 and st.num_accepted_tokens == st.num_draft_tokens
    assert backend.scheduler.num_preemptions > 0 and backend.kv.prefix_hits > 0
    backend.kv.check_invariants()


def test_quantized_self_drafting(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ARMSERVE_SELF_DRAFT_CACHE", str(tmp_path))
    kw = dict(kv_cache_space=0.02, max_model_len=256, block_size=16, dtype="float32")
    plain = LLM(tiny_llama, **kw)
    spec = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama, "quantization": "w4a8",
                                               "num_speculative_tokens": 3}, **kw)
    assert os.listdir(tmp_path)  # the int4 copy, made at load
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [c.token_ids for c in _run(spec, prompts, params)] == [c.token_ids for c in _run(plain, prompts, params)]
    st = spec.llm_engine.backend.scheduler.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # an int4 copy agrees often, not always


def test_quantized_self_drafting_over_part_of_the_vocabulary(tiny_llama, tmp_path, monkeypatch):
    """draft_vocab_size: the int4 draft's head keeps the rows of the first ids (whole 16-row tiles)
    and of the special tokens; every draft is a target id from that set, some are accepted, and
    greedy output is what decoding without speculation gives."""
    from armserve.engine.draft_proposer import DraftModelProposer

    monkeypatch.setenv("ARMSERVE_SELF_DRAFT_CACHE", str(tmp_path))
    kw = dict(kv_cache_space=0.02, max_model_len=256, block_size=16, dtype="float32")
    plain = LLM(tiny_llama, **kw)
    spec = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama, "quantization": "w4a8",
                                               "num_speculative_tokens": 3, "draft_vocab_size": 20000}, **kw)
    backend = spec.llm_engine.backend
    tok = backend.tokenizer
    draft = backend.scheduler.proposer.runner.model
    special = set(tok.added_tokens_decoder) | set(backend.eos_token_ids)
    kept = set(range(20000)) | {i for s in special for i in range(s // 16 * 16, s // 16 * 16 + 16)}
    assert len(tok) > 20000 and draft.lm_head.out_features == len(kept) < len(tok)
    assert set(draft.draft_to_target.tolist()) == kept
    drafted = []
    propose = DraftModelProposer.propose_batch
    monkeypatch.setattr(DraftModelProposer, "propose_batch",
                        lambda self, items: drafted.extend(d := propose(self, items)) or d)
    prompts = [[1, 2, 3, 4], list(range(100, 140))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [c.token_ids for c in _run(spec, prompts, params)] == [c.token_ids for c in _run(plain, prompts, params)]
    tokens = [t for d in drafted for t in d]
    assert tokens and set(tokens) <= kept
    st = backend.scheduler.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_server_metrics_and_stats_line(markov_llama, engines, tmp_path):
    import json

    import httpx

    from server_process import ServerProcess

    off, _ = engines
    prompt = _chain_prompts(off)[0]
    want = _run(off, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    server = ServerProcess(markov_llama, ["--kv-cache-space", "0.02", "--max-model-len", "256",
                                          "--speculative-config", json.dumps(NGRAM)], str(tmp_path / "server.log"))
    try:
        r = httpx.post(f"{server.base_url}/completions", timeout=60, json={
            "model": markov_llama, "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == off.get_tokenizer().decode(want)
        m = server.metrics()
        assert m["vllm:spec_decode_num_accepted_tokens_total"] >= 20
        assert m["vllm:spec_decode_num_draft_tokens_total"] >= m["vllm:spec_decode_num_accepted_tokens_total"]
        assert m["vllm:spec_decode_num_drafts_total"] > 0
        assert m['vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
        deadline = time.monotonic() + 10
        while "Draft acceptance rate" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "Draft acceptance rate" in server.log()
    finally:
        server.stop()
