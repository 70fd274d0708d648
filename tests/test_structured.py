"""Structured outputs in the engine: the applied bitmask is xgrammar's, constrained rows obey
their schema / regex / choice / grammar, and unconstrained rows beside them are untouched."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from armserve import LLM, SamplingParams, StructuredOutputsParams
from armserve.engine.structured_output import StructuredOutputManager, apply_grammar_bitmask
from armserve.sampling_params import SamplingParamsError

from structured_schemas import SCHEMAS

xgr = pytest.importorskip("xgrammar")

SO = StructuredOutputsParams


def test_params_need_exactly_one_constraint():
    with pytest.raises(SamplingParamsError, match="exactly one"):
        SO()
    with pytest.raises(SamplingParamsError, match="exactly one.*json, regex"):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(SamplingParamsError, match="not valid JSON"):
        SO(json="{nope")
    with pytest.raises(SamplingParamsError, match="choice"):
        SO(choice=["a", ""])
    assert SO(json='{"type": "integer"}').json == {"type": "integer"}


@pytest.mark.parametrize("pad", [0, 100])
def test_bitmask_equals_xgrammar_reference(tokenizer_dir, pad):
    """Our fill + unpacking gives exactly the logits xgrammar's own matcher and kernel give, on
    constrained rows only, with the logits width padded past the tokenizer's vocabulary."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    width = len(tok) + pad
    mgr = StructuredOutputManager(tok, width, {tok.eos_token_id})
    specs = [SO(json=SCHEMAS[0][1]), SO(regex=r"[a-c]+x"), SO(choice=["yes", "no"]), SO(json_object=True)]
    prefixes = ['{"name": "Bo', "ab", "", '{"a": [1, 2']
    matchers, refs = [], []
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=width, stop_token_ids=[tok.eos_token_id])
    ref_compiler = xgr.GrammarCompiler(info, max_threads=1)
    for so, prefix in zip(specs, prefixes):
        m = mgr.new_matcher(mgr.compile(so))
        kind, text, _ = so.cache_key()
        if kind == "json":
            cg = ref_compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
        elif kind == "regex":
            cg = ref_compiler.compile_regex(so.regex)
        elif kind == "choice":
            cg = ref_compiler.compile_grammar('root ::= "yes" | "no"')
        else:
            cg = ref_compiler.compile_builtin_json_grammar()
        r = xgr.GrammarMatcher(cg)
        for mm in (m, r):
            assert mm.accept_string(prefix) if prefix else True
        matchers.append(m)
        refs.append(r)
    torch.manual_seed(0)
    logits = torch.randn(7, width)
    rows = [1, 2, 4, 6]  # rows 0, 3 and 5 are unconstrained
    ours = logits.clone()
    apply_grammar_bitmask(ours, mgr.fill_bitmask(matchers), torch.tensor(rows))
    expected = logits.clone()
    ref_mask = xgr.allocate_token_bitmask(len(rows), width)
    for i, r in enumerate(refs):
        r.fill_next_token_bitmask(ref_mask, i)
    for i, row in enumerate(rows):
        one = logits[row:row + 1].clone()
        xgr.apply_token_bitmask_inplace(one, ref_mask[i:i + 1], vocab_size=width, backend="torch_native")
        expected[row] = one[0]
    assert torch.equal(ours, expected)
    for row in (0, 3, 5):
        assert torch.equal(ours[row], logits[row])
    allowed = torch.isfinite(ours[rows])
    assert 0 < int(allowed[1].sum()) < width and not bool(allowed[:, len(tok):].any())  # padding never allowed


# ---- through the engine on SmolLM2 ------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(smollm2_gguf) -> LLM:
    return LLM(smollm2_gguf, dtype="float32", kv_cache_space=0.2, max_model_len=1024)


def chat(llm: LLM, question: str) -> dict:
    return {"prompt_token_ids": llm.encode_chat([{"role": "user", "content": question}])}


def greedy(max_tokens: int, so: StructuredOutputsParams | None = None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so, **kw)


def test_twenty_json_schemas_validate(llm):
    prompts = [chat(llm, f"{q} Answer in JSON.") for q, _ in SCHEMAS]
    params = [greedy(96, SO(json=s)) for _, s in SCHEMAS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (q, schema), out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (q, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_grammar_and_json_object(llm):
    grammar = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    cases = [
        ("Give me a phone number.", SO(regex=r"\(\d{3}\) \d{3}-\d{4}"), lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        ("Is the sky blue?", SO(choice=["yes", "no", "it depends"]), lambda t: t in ("yes", "no", "it depends")),
        ("What is 6 times 7?", SO(grammar=grammar), lambda t: re.fullmatch(r"The answer is \d\d?\.", t)),
        ("Describe a cat in JSON.", SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    outs = llm.generate([chat(llm, q) for q, _, _ in cases],
                        [greedy(64 if so.json_object else 24, so) for _, so, _ in cases], use_tqdm=False)
    for (q, so, ok), out in zip(cases, outs):
        if so.json_object and out.outputs[0].finish_reason == "length":
            continue  # any JSON object is unbounded; the prefix is still checked by the grammar
        assert out.outputs[0].finish_reason == "stop" and ok(out.outputs[0].text), (q, out.outputs[0].text)


def test_invalid_constraints_raise_naming_the_problem(llm):
    engine = llm.llm_engine
    for so, match in [(SO(regex="a(b"), "structured_outputs.regex: invalid regex.*parenthesis"),
                      (SO(json={"type": "foo"}), "structured_outputs.json: invalid JSON schema.*foo"),
                      (SO(grammar="root ::= nothing"), "structured_outputs.grammar: invalid grammar.*nothing")]:
        with pytest.raises(ValueError, match=match):
            llm.generate("x", greedy(4, so), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


MIXED_QUESTIONS = ["Describe a person.", "The capital of France is", "A point in 2D.", "def fib(n):",
                   "Give a colour.", "Water boils at", "Is it raining?", "The quick brown fox"]


def test_mixed_batch_of_8_free_rows_equal_their_solo_runs(llm):
    """Four constrained rows (JSON schemas, one sampled with a seed) beside four free greedy rows:
    every row equals its own run alone, token for token; decode steps are still replayed graphs."""
    params = []
    for i, q in enumerate(MIXED_QUESTIONS):
        if i % 2 == 0:
            schema = dict(SCHEMAS)[q]
            params.append(greedy(64, SO(json=schema)) if i != 4 else
                          SamplingParams(temperature=0.9, seed=7, max_tokens=64, structured_outputs=SO(json=schema)))
        else:
            params.append(greedy(24, ignore_eos=True))
    prompts = [chat(llm, q) for q in MIXED_QUESTIONS]
    replays = llm.llm_engine.runner.graphs.replays
    batch = llm.generate(prompts, params, use_tqdm=False)
    graphs_on = llm.llm_engine.runner.graphs.enabled
    assert not graphs_on or llm.llm_engine.runner.graphs.replays > replays
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0]
        assert batch[i].outputs[0].token_ids == alone.token_ids, MIXED_QUESTIONS[i]
        if i % 2 == 0:
            jsonschema.validate(json.loads(alone.text), dict(SCHEMAS)[MIXED_QUESTIONS[i]])


def test_n_seed_stop_strings_and_prefix_cache(llm):
    schema = dict(SCHEMAS)["A team of people."]
    p = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=120, structured_outputs=SO(json=schema))
    prompt = chat(llm, "A team of people. Answer in JSON.")
    first = llm.generate([prompt], p, use_tqdm=False)[0]
    again = llm.generate([prompt], p, use_tqdm=False)[0]  # the prompt's blocks now come from the prefix cache
    assert again.num_cached_tokens > 0
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    for c in first.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
    assert any(c.finish_reason == "stop" for c in first.outputs)
    # A stop string ends a constrained completion early, like any other.
    out = llm.generate([chat(llm, "Describe a person.")],
                       greedy(64, SO(json=SCHEMAS[0][1]), stop=['"age"', '"name"']), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason in ('"age"', '"name"') and out.text == "{"


def test_preempted_constrained_requests_stay_valid(smollm2_gguf):
    """A cache too small for the batch: requests are preempted and recomputed mid-JSON; the grammar
    state (which keeps the accepted output tokens) carries on, and each output equals its solo run."""
    block = 2 * 30 * 16 * 3 * 64 * 4  # K+V, 30 layers, 16 tokens, 3 KV heads, head_dim 64, float32
    small = LLM(smollm2_gguf, dtype="float32", kv_cache_space=10 * block / 2**30, max_model_len=256, block_size=16)
    qs = [q for q, _ in SCHEMAS[:6]]
    prompts = [chat(small, f"{q} JSON please.") for q in qs]
    params = [greedy(48, SO(json=dict(SCHEMAS)[q])) for q in qs]
    outs = small.generate(prompts, params, use_tqdm=False)
    engine = small.llm_engine
    assert engine.scheduler.num_preemptions > 0
    for q, p, sp, out in zip(qs, prompts, params, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (q, c.text)
        jsonschema.validate(json.loads(c.text), dict(SCHEMAS)[q])
        assert c.token_ids == small.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    # Every decode graph of this fresh engine was captured while a bitmask was being filled beside it.
    graphs = engine.runner.graphs
    assert not graphs.enabled or (graphs.graphs and all(g.replayable for g in graphs.graphs.values()))


def test_twenty_json_schemas_validate_on_qwen(qwen_coder_gguf):
    """The same 20 schemas on Qwen2.5-Coder-0.5B-Instruct (a 152k vocabulary): one batch, every
    output validates."""
    qwen = LLM(qwen_coder_gguf, kv_cache_space=0.3, max_model_len=512)
    prompts = [chat(qwen, f"{q} Answer in JSON.") for q, _ in SCHEMAS]
    outs = qwen.generate(prompts, [greedy(96, SO(json=s)) for _, s in SCHEMAS], use_tqdm=False)
    for (q, schema), out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (q, c.text)
        jsonschema.validate(json.loads(c.text), schema)
