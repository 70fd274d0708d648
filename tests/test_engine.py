"""Engine behaviour: batching, chunked prefill, prefix caching and preemption change nothing
about greedy output; no KV block leaks; every bad input is refused with a clear error."""

from __future__ import annotations

import random

import pytest

from armserve import LLM, SamplingParams
from armserve.config import ConfigError
from armserve.engine.llm_engine import RequestError
from armserve.model_loader import ModelLoadError
from armserve.models import UnsupportedArchitectureError
from armserve.sampling_params import SamplingParamsError
from conftest import FORCED_RERUN

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32


def tiny(folder: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("kv_cache_space", 0.02)
    kw.setdefault("block_size", 16)  # short test prompts: 16-token blocks give each several
    return LLM(folder, **kw)


def mixed_prompts(tokenizer, n: int = 8) -> list[list[int]]:
    rng = random.Random(0)
    words = "the a cat dog ran over under blue sky sea ship code def return while".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(3 + 7 * i))
        out.append(tokenizer.encode(text))
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def token_lists(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Each prompt run alone, default engine settings."""
    llm = tiny(tiny_llama)
    prompts = mixed_prompts(llm.get_tokenizer())
    alone = [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    return prompts, alone


def test_batch_equals_alone(tiny_llama, reference):
    prompts, alone = reference
    llm = tiny(tiny_llama)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert token_lists(outs) == alone


def test_heavy_chunking_equals_alone(tiny_llama, reference):
    prompts, alone = reference
    llm = tiny(tiny_llama, max_num_batched_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert token_lists(outs) == alone


def test_prefix_caching_on_and_off(tiny_llama, reference):
    prompts, alone = reference
    shared = prompts[-1]  # longest prompt as a shared prefix of new prompts
    variants = [shared + p[:5] for p in prompts]
    off = tiny(tiny_llama, enable_prefix_caching=False)
    on = tiny(tiny_llama, enable_prefix_caching=True)
    want = token_lists(off.generate([{"prompt_token_ids": p} for p in variants], GREEDY, use_tqdm=False))
    # Warm the cache with the shared prefix, then run the variants: they must hit.
    on.generate([{"prompt_token_ids": shared}], GREEDY, use_tqdm=False)
    outs = on.generate([{"prompt_token_ids": p} for p in variants], GREEDY, use_tqdm=False)
    assert token_lists(outs) == want
    assert all(o.num_cached_tokens >= 16 for o in outs)
    assert on.llm_engine.kv.prefix_hit_rate > 0.3
    assert off.llm_engine.kv.prefix_hits == 0


def test_preemption_under_a_tiny_cache(tiny_llama, reference):
    prompts, alone = reference
    llm = tiny(tiny_llama, kv_cache_space=10 * BLOCK_BYTES_TINY / 2**30)
    engine = llm.llm_engine
    assert engine.kv.num_blocks == 10
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert token_lists(outs) == alone
    assert engine.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions > 0 for o in outs)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_no_block_leaks_after_aborts_and_preemptions(tiny_llama):
    llm = tiny(tiny_llama, kv_cache_space=12 * BLOCK_BYTES_TINY / 2**30, max_num_batched_tokens=32)
    engine = llm.llm_engine
    prompts = mixed_prompts(llm.get_tokenizer(), 8)
    rng = random.Random(1)
    live: list[str] = []
    finished = 0
    for round_ in range(6):
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0.8, max_tokens=rng.randint(1, 30), seed=i, n=rng.choice([1, 2]))
            live.append(engine.add_request(f"r{round_}-{i}", {"prompt_token_ids": p}, params))
        for step in range(40):
            for out in engine.step():
                if out.finished:
                    finished += 1
                    live.remove(out.request_id)
            if step % 7 == 3 and live:
                victim = rng.choice(live)
                engine.abort_request(victim)
                live.remove(victim)
            engine.kv.check_invariants()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished += 1
        engine.kv.check_invariants()
    assert finished > 0 and engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert not engine.scheduler.requests and not engine.scheduler.running and not engine.scheduler.waiting


def test_smollm2_batch_of_8_equals_alone(smollm2_gguf):
    llm = LLM(smollm2_gguf, dtype="float32", kv_cache_space=0.2, max_model_len=1024)
    prompts = [
        "The capital of France is",
        "def fib(n):",
        "List three colours:",
        "Water boils at",
        "A haiku about the sea:\n",
        "The quick brown fox",
        "In 1492, Columbus",
        "Photosynthesis is the process by which plants",
    ]
    p = SamplingParams(temperature=0.0, max_tokens=8 if FORCED_RERUN else 16, ignore_eos=True)
    batch = token_lists(llm.generate(prompts, p, use_tqdm=False))
    alone = [llm.generate([q], p, use_tqdm=False)[0].outputs[0].token_ids for q in (prompts[0], prompts[7])]
    assert batch[0] == alone[0] and batch[7] == alone[1]


# ---- sampling features through the whole engine -----------------------------------------


def test_seed_gives_same_text_whatever_the_batch(tiny_llama):
    llm = tiny(tiny_llama)
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate(["hello there"], p, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(["a b c", "hello there", "x y z w"], [others, p, others], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    different_seed = llm.generate(["hello there"], SamplingParams(temperature=1.0, max_tokens=20, seed=99,
                                                                  ignore_eos=True), use_tqdm=False)
    assert different_seed[0].outputs[0].token_ids != alone


def test_n_completions_and_stop_strings(tiny_llama):
    llm = tiny(tiny_llama)
    outs = llm.generate(["the cat"], SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True),
                        use_tqdm=False)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    # A stop string taken from a greedy run is cut from the output.
    full = llm.generate(["the cat"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    cut = llm.generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.index(stop)]
    kept = llm.generate(["the cat"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_max_tokens_and_min_tokens(tiny_llama):
    llm = tiny(tiny_llama)
    full = llm.generate(["the dog"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = full[5]
    first = full.index(stop_tok)
    out = llm.generate(["the dog"], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = llm.generate(["the dog"], SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    out = llm.generate(["the dog"], SamplingParams(temperature=0.0, max_tokens=24, min_tokens=first + 2,
                                                   stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2


def test_prompt_logprobs_and_logprobs(tiny_llama):
    import torch
    from transformers import AutoModelForCausalLM

    llm = tiny(tiny_llama, max_num_batched_tokens=8)  # prompt logprobs across several chunks
    p = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, logprobs=2, ignore_eos=True)
    out = llm.generate(["one two three four five six seven eight nine ten"], p, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert ids[pos] in entry
        assert abs(entry[ids[pos]].logprob - ref[pos - 1, ids[pos]].item()) < 1e-4
        # the rank counts the tokens above it; ones within the logprob tolerance may fall either way
        x = ref[pos - 1, ids[pos]]
        above, near = int((ref[pos - 1] > x + 1e-4).sum()), int((ref[pos - 1] > x - 1e-4).sum())
        assert 1 + above <= entry[ids[pos]].rank <= 1 + near
        assert len(entry) <= 3
    c = out.outputs[0]
    assert len(c.logprobs) == 3
    assert c.cumulative_logprob == pytest.approx(sum(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)))


def test_chat_uses_the_template(tiny_llama):
    llm = tiny(tiny_llama)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    text = llm.get_tokenizer().decode(out[0].prompt_token_ids)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.rstrip().endswith("assistant")


# ---- bad input ------------------------------------------------------------------------


def test_bad_requests_are_refused_and_engine_keeps_working(tiny_llama):
    llm = tiny(tiny_llama, max_model_len=64)
    engine = llm.llm_engine
    long_prompt = {"prompt_token_ids": [5] * 64}
    with pytest.raises(RequestError, match="max_model_len"):
        llm.generate([long_prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate([{"prompt_token_ids": [5] * 40}], SamplingParams(max_tokens=30), use_tqdm=False)
    with pytest.raises(RequestError, match="out of range"):
        llm.generate([{"prompt_token_ids": [10**9]}], use_tqdm=False)
    with pytest.raises(RequestError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    # A bad prompt in the middle of a batch refuses the whole call, leaving nothing queued.
    with pytest.raises(RequestError):
        llm.generate(["fine", long_prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks
    ok = llm.generate(["still works"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


def test_request_larger_than_the_whole_cache_is_refused(tiny_llama):
    llm = tiny(tiny_llama, kv_cache_space=2 * BLOCK_BYTES_TINY / 2**30)
    with pytest.raises(RequestError, match="kv_cache_space"):
        llm.generate(["hello"], SamplingParams(max_tokens=40), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_bad_engine_arguments(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="dtype"):
        LLM(tiny_llama, dtype="int3")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path))
    with pytest.raises(TypeError, match="unknown engine argument"):
        LLM(tiny_llama, max_batch=3)
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(tiny_llama, max_model_len=10**6)


def test_broken_model_folders(tiny_llama, tmp_path):
    import json
    import shutil

    bad_arch = tmp_path / "arch"
    shutil.copytree(tiny_llama, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        LLM(str(bad_arch), dtype="float32")

    truncated = tmp_path / "trunc"
    shutil.copytree(tiny_llama, truncated)
    w = truncated / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(truncated), dtype="float32")

    no_weights = tmp_path / "noweights"
    shutil.copytree(tiny_llama, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(no_weights), dtype="float32")

    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(str(bad_gguf))


def test_a_deleted_llm_is_freed_at_once(tiny_llama):
    """`del llm` frees the engine (model, KV cache, grammar-compile workers) at once, without waiting
    for the cyclic garbage collector: nothing made while the first LLM of a process is built holds
    its constructor's frames. (A fresh interpreter: only the first LLM of a process imports transformers.)"""
    import os
    import subprocess
    import sys

    code = f"""
import gc, weakref
gc.disable()
from armserve import LLM, SamplingParams, StructuredOutputsParams
llm = LLM({tiny_llama!r}, kv_cache_space=0.02, max_model_len=256)
llm.generate(["Answer:"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-c]{{3}}")),
             use_tqdm=False)
ref = weakref.ref(llm.llm_engine.backend)
del llm
print("freed" if ref() is None else "alive")
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "freed"
