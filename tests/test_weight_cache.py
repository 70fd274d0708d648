"""Weights shared between engines through one mapped file (model_loader/weight_cache.py): the same
outputs as private weights, one file mapped by every engine of the same model, a stale file
rewritten rather than used, a write into a mapped weight private to its engine, and a cache that
cannot be written costing only the sharing."""

from __future__ import annotations

import os

import pytest
import torch

from armserve import LLM, SamplingParams
from armserve.model_loader import weight_cache

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
PROMPTS = [{"prompt_token_ids": [5, 9, 13, 22]}, {"prompt_token_ids": list(range(3, 143))}]  # 140: prefill rows


def outputs(llm: LLM) -> list:
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def weight_files(llm: LLM) -> dict[str | None, int]:
    """Bytes of the model's storages of MIN_BYTES or more, by the weight file mapping them (None:
    private memory, the heap or an anonymous mapping)."""
    files: dict[str | None, int] = {}
    for nbytes, tensors in weight_cache._large_storages(llm.llm_engine.model):
        path = weight_cache.mapped_file(tensors[0])
        path = path if path and path.endswith(".bin") else None
        files[path] = files.get(path, 0) + nbytes
    return files


@pytest.fixture
def models(tiny_llama, tmp_path, monkeypatch):
    """The tiny Llama in bfloat16 (dense packed weights) and as a GGUF of quantized blocks (w4, w8h
    tiles and a float k), with every storage of 4 KiB or more shared (the default leaves out what is
    under 1 MiB, most of a tiny model), the weight cache in tmp_path."""
    from test_tp import write_llama_gguf

    monkeypatch.setenv("ARMSERVE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setattr(weight_cache, "MIN_BYTES", 4096)
    gguf = str(tmp_path / "tiny.gguf")
    write_llama_gguf(tiny_llama, gguf)
    return {"bf16": (tiny_llama, None), "gguf": (gguf, tiny_llama)}


def load(model: str, tokenizer: str | None, **kw) -> LLM:
    return LLM(model, tokenizer=tokenizer, dtype="bfloat16", kv_cache_space=0.05, max_model_len=256, **kw)


@pytest.mark.parametrize("kind", ["bf16", "gguf"])
def test_engines_of_one_model_map_one_weight_file_and_answer_the_same(models, kind):
    model, tok = models[kind]
    private = load(model, tok)
    want = outputs(private)
    assert list(weight_files(private)) == [None]
    a = load(model, tok, share_weights=True)
    b = load(model, tok, share_weights=True)
    assert outputs(a) == want and outputs(b) == want
    fa, fb = weight_files(a), weight_files(b)
    # the weights the load made live in the one file; what stays private is what came after
    # (the step graphs' arena, the KV cache's views) and the rotary tables, as in the private engine
    (path,) = [p for p in fa if p]
    assert path.startswith(os.environ["ARMSERVE_CACHE_ROOT"]) and fb[path] == fa[path] > 0
    assert fa[None] == fb[None] == weight_files(private)[None] - fa[path]
    assert os.path.getsize(path) >= fa[path]


def test_a_stale_or_damaged_weight_file_is_rewritten_not_used(models):
    model, tok = models["gguf"]
    want = outputs(load(model, tok))
    first = load(model, tok, share_weights=True)
    (path,) = [p for p in weight_files(first) if p]
    good = open(path, "rb").read()
    del first
    for damaged in (good[:-4096], bytes(len(good)), good[:100] + bytes([good[100] ^ 1]) + good[101:]):
        with open(path + ".new", "wb") as f:  # (replaced whole, as the cache does: a mapped file never changes)
            f.write(damaged)
        os.replace(path + ".new", path)
        llm = load(model, tok, share_weights=True)
        assert outputs(llm) == want
        assert open(path, "rb").read() == good
        del llm


def test_a_write_into_a_mapped_weight_stays_private_to_its_engine(models):
    model, tok = models["bf16"]
    a = load(model, tok, share_weights=True)
    want = outputs(a)
    (path,) = [p for p in weight_files(a) if p]
    before = open(path, "rb").read()
    with torch.no_grad():
        for p in a.llm_engine.model.parameters():
            if weight_cache.mapped_file(p) == path:
                p.mul_(-1)  # (copy-on-write: this engine's pages only)
    assert outputs(a) != want
    assert open(path, "rb").read() == before
    assert outputs(load(model, tok, share_weights=True)) == want


def test_a_cache_that_cannot_be_written_costs_only_the_sharing(models, tmp_path, monkeypatch, caplog):
    model, tok = models["gguf"]
    want = outputs(load(model, tok))
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("ARMSERVE_CACHE_ROOT", str(blocked))
    llm = load(model, tok, share_weights=True)
    assert outputs(llm) == want
    assert list(weight_files(llm)) == [None]
    assert "weights not shared" in caplog.text


def test_sharing_is_the_default_for_data_parallel_engines_on_one_numa_node(monkeypatch):
    from armserve import memory
    from armserve.config import EngineConfig

    def resolved(nodes: int, **kw) -> bool | None:
        monkeypatch.setattr(memory, "numa_node_count", lambda: nodes)
        cfg = EngineConfig(model="m", **kw)
        cfg.finalize(512)
        return cfg.share_weights

    assert resolved(1, data_parallel_size=2) is True
    assert resolved(1) is False
    assert resolved(2, data_parallel_size=2) is False  # (a shared page is remote memory for some engine)
    assert resolved(2, data_parallel_size=2, share_weights=True) is True
    assert resolved(1, data_parallel_size=2, share_weights=False) is False
