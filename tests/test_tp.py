"""Tensor parallelism (armserve/distributed.py): TP=2 on this 2-core machine (one core per rank)
gives TP=1's greedy float32 tokens for Llama, Qwen2 and an MoE; chunked prefill, prefix caching
and preemption still work; the shared-memory all-reduce equals torch.distributed's gloo; a rank
that dies fails the step instead of hanging it."""

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


def test_tp2_chunked_prefill_preemption_and_prefix_caching(tiny_llama):
    """Under TP=2: prompts chunked into 16-token steps through a 10-block cache (preempting)
    give the tokens each prompt gets alone at TP=1; prefix-cache hits change nothing either."""
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
    outs = on.generate(variants, GREEDY, use_tqdm=False)
    assert token_lists(outs) == want
    assert all(o.num_cached_tokens >= 16 for o in outs)


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
