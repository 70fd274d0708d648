"""The OpenVINO backend (engine/openvino_backend.py): greedy tokens equal to the torch backend's and
transformers', parameters it cannot carry refused by name, the missing extra in one line, and the
OpenAI server tests of tests/test_server.py run again against `armserve serve --backend openvino`.

Needs the `openvino` extra (scripts/setup.sh installs it, with the exporter's own environment).
The first run exports SmolLM2 and the tiny checkpoint to OpenVINO IR (~1 minute, cached in
~/.cache/armserve/openvino)."""

from __future__ import annotations

import builtins

import httpx
import openai
import pytest

from armserve import LLM, SamplingParams

# The server tests that hold for any backend, run here against an openvino server (test_server's
# `client` and `model` fixtures, on the `server` fixture below). Left out: those that ask for top
# log-probabilities, prompt log-probabilities, echo with logprobs or prefix-cache hit counters,
# which this backend refuses or cannot report.
from test_server import (  # noqa: F401
    HELLO,
    ServerProcess,
    client,
    model,
    test_bad_requests_do_not_disturb_requests_in_flight,
    test_chat_max_completion_tokens_wins,
    test_chat_n2,
    test_chat_non_streaming_usage_is_exact,
    test_chat_stop_string,
    test_chat_streamed_equals_non_streamed_same_seed,
    test_chat_without_max_tokens_fills_the_context,
    test_completion_streamed_equals_non_streamed,
    test_eight_concurrent_chats_share_one_batch,
    test_health_version_models,
    test_invalid_requests_get_400_naming_the_problem,
    test_malformed_json_and_unknown_routes,
    test_tokenize_detokenize,
    test_unknown_model_is_404,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def ov_smollm2(smollm2_hf_reference):
    return LLM(smollm2_hf_reference, backend="openvino", dtype="float32", kv_cache_space=0.5)


@pytest.fixture(scope="module")
def torch_smollm2(smollm2_hf_reference):
    """The same folder on the torch backend: the reference the openvino outputs must equal."""
    return LLM(smollm2_hf_reference, dtype="float32", kv_cache_space=0.5)


def test_greedy_float32_equals_torch_backend_and_transformers(ov_smollm2, torch_smollm2, smollm2_hf_reference):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in ov_smollm2.generate(PROMPTS, p, use_tqdm=False)]
    ref = torch_smollm2
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, p, use_tqdm=False)]
    assert got == want
    tok = AutoTokenizer.from_pretrained(smollm2_hf_reference)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_hf_reference, dtype=torch.float32)
    for prompt, ids in zip(PROMPTS, got):
        # transformers' greedy continuation is the one whose every token is the argmax of the logits
        # given the tokens before it (EOS included, which ignore_eos lets through): one forward over
        # prompt + ids checks all 32 steps, as a 32-forward argmax loop would
        x = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = hf(torch.cat([x, torch.tensor([ids])], dim=1)).logits[0, x.shape[1] - 1: -1]
        assert logits.argmax(-1).tolist() == ids, prompt


def test_sampling_params_match_the_torch_backend(ov_smollm2, torch_smollm2):
    """Greedy with penalties, min_tokens, stop strings and stop ids: the same tokens, text and
    finish reasons as the torch backend; the chosen token's logprob within float noise."""
    ref = torch_smollm2
    msgs = [{"role": "user", "content": "Say hi."}]
    for p in [SamplingParams(temperature=0, max_tokens=40, logprobs=0),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[282]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[9999]),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=30),
              SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=40, stop=["help"], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=40, stop=["help"])]:
        a = ov_smollm2.chat(msgs, p, use_tqdm=False)[0].outputs[0]
        b = ref.chat(msgs, p, use_tqdm=False)[0].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids, b.text, b.finish_reason, b.stop_reason), p
        if p.logprobs is not None:
            la = [next(iter(d.values())).logprob for d in a.logprobs]
            lb = [next(iter(d.values())).logprob for d in b.logprobs]
            assert la == pytest.approx(lb, abs=1e-3)


def test_sampling_is_seeded_and_n_gives_n(ov_smollm2):
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, n=2, max_tokens=8, seed=11, ignore_eos=True)
    a = ov_smollm2.generate("Once upon a time", p, use_tqdm=False)[0]
    b = ov_smollm2.generate("Once upon a time", p, use_tqdm=False)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert [len(o.token_ids) for o in a.outputs] == [8, 8]
    assert all(o.finish_reason == "length" for o in a.outputs)


@pytest.mark.parametrize("bad, name", [
    (dict(logprobs=2), "logprobs"),
    (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(n=2, temperature=0), "n"),
])
def test_unsupported_parameter_is_refused_by_name(ov_smollm2, bad, name):
    with pytest.raises(ValueError, match=rf"^{name} is not supported by the openvino backend"):
        ov_smollm2.generate("Hi", SamplingParams(**bad), use_tqdm=False)
    assert not ov_smollm2.llm_engine.has_unfinished_requests()


def test_structured_outputs_are_refused_by_name(ov_smollm2):
    from armserve.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="^structured_outputs is not supported"):
        ov_smollm2.generate("Hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
                            use_tqdm=False)


def test_engine_arguments_it_cannot_carry_are_refused(smollm2_hf_reference, smollm2_gguf):
    from armserve.config import ConfigError

    with pytest.raises(ConfigError, match="block_size 16"):
        LLM(smollm2_hf_reference, backend="openvino", block_size=16)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLM(smollm2_hf_reference, backend="openvino", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="GGUF"):
        LLM(smollm2_gguf, backend="openvino")
    with pytest.raises(ConfigError, match="quantization 'int4' is the openvino backend's"):
        LLM(smollm2_hf_reference, quantization="int4")


def test_an_ir_folder_loads_directly(ov_smollm2):
    ir = ov_smollm2.llm_engine.ir_folder
    again = LLM(ir, backend="openvino", dtype="float32", kv_cache_space=0.5)
    assert again.llm_engine.ir_folder == ir
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert (again.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
            == ov_smollm2.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids)


def test_missing_extra_says_how_to_install(monkeypatch, smollm2_hf_reference):
    real_import = builtins.__import__

    def no_openvino(name, *args, **kwargs):
        if name.split(".")[0] in ("openvino", "openvino_genai"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_openvino)
    with pytest.raises(ImportError) as e:
        LLM(smollm2_hf_reference, backend="openvino")
    msg = str(e.value)
    assert "pip install armserve[openvino]" in msg and "\n" not in msg


# ---- the OpenAI server on the openvino backend (test_server's tests, these fixtures) --------------


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = ServerProcess(tiny_llama, ["--backend", "openvino", "--dtype", "float32", "--kv-cache-space", "0.02"],
                        str(tmp_path_factory.mktemp("ov-srv") / "server.log"), startup_timeout=300)
    yield srv
    srv.stop()



def test_server_refuses_what_the_backend_cannot_carry_with_400(server, client, model):
    with pytest.raises(openai.BadRequestError, match="logprobs is not supported by the openvino backend"):
        client.chat.completions.create(model=model, messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=3)
    r = httpx.post(f"{server.base_url}/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2,
                                                           "n": 2, "temperature": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("n is not supported"), r.text
    # The chosen token's logprob alone is carried.
    out = client.chat.completions.create(model=model, messages=HELLO, max_tokens=4, logprobs=True,
                                         extra_body={"ignore_eos": True})
    assert len(out.choices[0].logprobs.content) == 4


def test_server_metrics_and_stats_line(server, client, model):
    client.chat.completions.create(model=model, messages=HELLO, max_tokens=8)
    m = server.metrics()
    assert m["armserve:generation_tokens_total"] >= 8 and m["armserve:prompt_tokens_total"] > 0
    assert m["armserve:e2e_request_latency_seconds_count"] >= 1
    assert "Avg prompt throughput:" in server.log() and "OpenVINO" in server.log()


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_compressed_weights_and_int8_kv_cache(tiny_llama, bits):
    """--quantization int8/int4 exports NNCF-compressed weights into a folder of their own;
    --kv-cache-dtype int8 is the pipeline's u8 cache. Both serve (near-greedy agreement is a random
    tiny model's matter, not checked)."""
    llm = LLM(tiny_llama, backend="openvino", dtype="float32", quantization=bits, kv_cache_dtype="int8",
              kv_cache_space=0.02)
    ir = llm.llm_engine.ir_folder
    assert f"-{bits}-" in ir
    with open(f"{ir}/openvino_model.xml") as f:
        xml = f.read()
    want = ('element_type="u4"', 'element_type="i4"') if bits == "int4" else ('element_type="u8"', 'element_type="i8"')
    assert any(w in xml for w in want)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


# ---- Qwen2.5-Coder-0.5B through both backends ------------------------------------------------------


def _near_argmax_steps(hf, prompt_ids: list[int], ids: list[int], tol: float = 1e-3) -> list[int]:
    """The steps of `ids` (generated greedily after `prompt_ids`) whose token is not an argmax of
    transformers' float32 logits up to `tol` (a near-tie may go either way; anything else is a bug)."""
    import torch

    x = torch.tensor([prompt_ids + ids])
    with torch.no_grad():
        logits = hf(x).logits[0, len(prompt_ids) - 1: -1].float()
    chosen = logits[torch.arange(len(ids)), torch.tensor(ids)]
    return [i for i, gap in enumerate((logits.max(-1).values - chosen).tolist()) if gap > tol]


@pytest.fixture(scope="module")
def qwen_hf_reference(qwen_coder_gguf):
    import os

    from conftest import CACHE, hf_folder_from_gguf

    return hf_folder_from_gguf(qwen_coder_gguf, os.path.join(CACHE, "qwen2.5-coder-0.5b-hf-from-gguf"))


def test_qwen_greedy_float32_equals_torch_backend_and_transformers(qwen_hf_reference):
    """Qwen2.5-Coder-0.5B (HF folder from its GGUF, float32): every greedy token of both backends is
    transformers' argmax given the same prefix (up to a 1e-3 near-tie), and most sequences are
    equal outright."""
    import torch
    from transformers import AutoModelForCausalLM

    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ov = LLM(qwen_hf_reference, backend="openvino", dtype="float32", kv_cache_space=0.5)
    got = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in ov.generate(PROMPTS, p, use_tqdm=False)]
    del ov
    ref = LLM(qwen_hf_reference, dtype="float32", kv_cache_space=0.5)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, p, use_tqdm=False)]
    del ref
    hf = AutoModelForCausalLM.from_pretrained(qwen_hf_reference, dtype=torch.float32)
    assert sum(list(a) == list(b) for (_, a), b in zip(got, want)) >= 3
    for (prompt_ids, a), b, prompt in zip(got, want, PROMPTS):
        assert len(a) == len(b) == 16
        assert _near_argmax_steps(hf, list(prompt_ids), list(a)) == [], f"openvino, {prompt!r}"
        assert _near_argmax_steps(hf, list(prompt_ids), list(b)) == [], f"torch, {prompt!r}"
        # (so where the two first differ, both tokens are within 1e-3 of transformers' best: a near-tie)


def test_int4_group_size_divides_every_width(smollm2_hf_reference, tiny_llama):
    """NNCF refuses an int4 group that does not divide a matmul's input width: SmolLM2's hidden
    size 576 takes groups of 64 (not NNCF's default 128), the tiny checkpoint's 64 too."""
    from armserve.engine.openvino_backend import int4_group_size

    assert int4_group_size(smollm2_hf_reference) == 64
    assert int4_group_size(tiny_llama) == 64
