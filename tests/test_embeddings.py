"""Embedding models (runner pooling): the BERT family against transformers, all-MiniLM-L6-v2's
vectors against sentence-transformers (offline `LLM.embed` and the server through the `openai`
client and LangChain), and the endpoints' refusals."""

from __future__ import annotations

import base64
import functools
import os

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "Embeddings turn text into vectors.",
    "Ok",
    "CPU inference serving engines batch requests under a token budget, one step at a time, "
    "so that many short sentences share each forward pass of the encoder.",
]
MIN_COSINE = 0.9999


@functools.lru_cache(maxsize=1)
def sentence_transformer(folder: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(folder, device="cpu")


def reference(folder: str, texts: list[str], max_seq_length: int | None = None) -> torch.Tensor:
    st = sentence_transformer(folder)
    before = st.max_seq_length
    if max_seq_length is not None:
        st.max_seq_length = max_seq_length
    try:
        return torch.as_tensor(st.encode(texts, convert_to_numpy=True)).float()
    finally:
        st.max_seq_length = before


def assert_close_vectors(got, want: torch.Tensor) -> None:
    got = torch.as_tensor(np.asarray(got, dtype=np.float32))
    assert got.shape == want.shape
    cos = F.cosine_similarity(got, want, dim=-1)
    assert bool((cos >= MIN_COSINE).all()), cos.tolist()
    assert torch.allclose(got.norm(dim=-1), want.norm(dim=-1), atol=1e-4)


# ---- the model itself --------------------------------------------------------------------------


def _tiny_encoder(kind: str, folder: str) -> str:
    from transformers import (BertConfig, BertModel, ModernBertConfig, ModernBertModel, NomicBertConfig,
                              NomicBertModel, XLMRobertaConfig, XLMRobertaModel)

    torch.manual_seed(1)
    # head_dim 16: the encoder-attention kernel's smallest (kernels.use_kernel)
    common = dict(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=80, hidden_act="gelu")
    if kind == "modernbert":  # 3 layers: global, local (a window of 4 either side), global
        model = ModernBertModel(ModernBertConfig(
            **{**common, "num_hidden_layers": 3}, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}))
    elif kind == "bert":
        model = BertModel(BertConfig(**common))
    elif kind == "nomic_bert":  # rotary base 1000, SwiGLU, no biases (transformers' own implementation)
        model = NomicBertModel(NomicBertConfig(**{**common, "hidden_act": "silu"}, type_vocab_size=2))
    else:
        model = XLMRobertaModel(XLMRobertaConfig(**common, pad_token_id=1, type_vocab_size=1))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:
                    m.bias.uniform_(-0.2, 0.2)
    model.eval().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta", "modernbert", "nomic_bert"])
def test_encoder_hidden_states_match_transformers(kind, tmp_path, monkeypatch):
    """Sequences of different lengths in one step (the encoder-attention kernel; ModernBERT's local
    layers padded, with a key mask and a band) give each sequence's transformers hidden states, on
    every kernel variant and on PyTorch's attention alone."""
    from transformers import AutoModel

    from armserve import kernels, model_loader

    folder = _tiny_encoder(kind, str(tmp_path))
    src = model_loader.resolve_model_path(folder)
    hf = model_loader.load_config(src)
    ours = model_loader.load_model(src, hf, torch.float32)
    ref = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 120, (n,), generator=g) for n in (7, 1, 19, 12)]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        wants = [ref(input_ids=s[None]).last_hidden_state[0] for s in seqs]
        before = kernels.isa()
        try:
            for isa in [*kernels.supported_isas(), "torch"]:
                if isa == "torch":  # no kernel for the attention: grouped SDPA
                    kernels.select_isa(before)
                    use_kernel = kernels.use_kernel
                    monkeypatch.setattr(kernels, "use_kernel", lambda op, *a, **k: op != "attention" and
                                        use_kernel(op, *a, **k))
                else:
                    kernels.select_isa(isa)
                hidden = ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), lens)
                for h, want in zip(hidden.split(lens), wants):
                    torch.testing.assert_close(h, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{isa}: {m}")
        finally:
            kernels.select_isa(before)


def _as_nomic_original(folder: str) -> None:
    """Rewrite a transformers NomicBert checkpoint's config in nomic's original keys (the published
    nomic-embed files, read by their remote code). transformers already writes the weights under
    the original names (Wqkv, fc11, fc12, norm1, ...)."""
    import json

    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert "encoder.layers.0.attn.Wqkv.weight" in f.keys() and "emb_ln.weight" in f.keys()
    cfg = json.load(open(os.path.join(folder, "config.json")))
    original = {"architectures": ["NomicBertModel"], "model_type": "nomic_bert", "vocab_size": cfg["vocab_size"],
                "n_embd": cfg["hidden_size"], "n_head": cfg["num_attention_heads"],
                "n_layer": cfg["num_hidden_layers"], "n_inner": cfg["intermediate_size"],
                "n_positions": cfg["max_position_embeddings"], "layer_norm_epsilon": cfg["layer_norm_eps"],
                "rotary_emb_base": cfg["rope_parameters"]["rope_theta"], "rotary_emb_fraction": 1.0,
                "rotary_emb_interleaved": False, "activation_function": "swiglu", "qkv_proj_bias": False,
                "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False,
                "type_vocab_size": cfg["type_vocab_size"], "pad_token_id": 0}
    json.dump(original, open(os.path.join(folder, "config.json"), "w"))


def test_nomic_bert_original_spelling(tmp_path):
    """A NomicBert checkpoint with the config keys nomic's remote code reads (n_embd, n_head,
    rotary_emb_base, ...) gives the hidden states transformers' own NomicBertModel gives."""
    from transformers import AutoModel

    from armserve import model_loader

    folder = _tiny_encoder("nomic_bert", str(tmp_path))
    ref = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    _as_nomic_original(folder)
    src = model_loader.resolve_model_path(folder)
    ours = model_loader.load_model(src, model_loader.load_config(src), torch.float32)
    seqs = [torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 30)]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        hidden = ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), lens)
        for s, h in zip(seqs, hidden.split(lens)):
            torch.testing.assert_close(h, ref(input_ids=s[None]).last_hidden_state[0], atol=2e-5, rtol=1e-4)


def test_tiny_bert_default_pooling_is_normalized_cls(tiny_bert):
    """No sentence-transformers files: vLLM's default for an encoder (CLS, normalized); the runner
    is picked from the checkpoint."""
    from transformers import AutoModel, AutoTokenizer

    from armserve import LLM

    llm = LLM(tiny_bert, dtype="float32")
    assert llm.llm_engine.config.runner == "pooling"
    outs = llm.embed(SENTENCES, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    ref = AutoModel.from_pretrained(tiny_bert, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([ref(**tok(s, return_tensors="pt")).last_hidden_state[0, 0] for s in SENTENCES])
    assert_close_vectors([o.outputs.embedding for o in outs], F.normalize(want, dim=-1))
    assert [o.prompt_token_ids for o in outs] == [tok(s)["input_ids"] for s in SENTENCES]


# ---- all-MiniLM-L6-v2 offline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_llm(minilm):
    from armserve import LLM

    return LLM(minilm, dtype="float32", task="embed")


def test_minilm_embed_matches_sentence_transformers(minilm, minilm_llm):
    want = reference(minilm, SENTENCES)
    batch = minilm_llm.embed(SENTENCES, use_tqdm=False)
    assert_close_vectors([o.outputs.embedding for o in batch], want)
    single = minilm_llm.embed(SENTENCES[0], use_tqdm=False)
    assert_close_vectors([single[0].outputs.embedding], want[:1])
    tok = minilm_llm.get_tokenizer()
    ids = [tok(s)["input_ids"] for s in SENTENCES[:2]]
    by_ids = minilm_llm.embed([{"prompt_token_ids": i} for i in ids], use_tqdm=False)
    assert_close_vectors([o.outputs.embedding for o in by_ids], want[:2])


def test_minilm_length_limit_and_truncation(minilm, minilm_llm):
    """max_model_len is sentence_bert_config's 256; longer is refused unless truncated, and a
    truncated input is what sentence-transformers embeds at that length."""
    from armserve.engine.input_processor import ContextLengthError, RunnerError

    assert minilm_llm.llm_engine.max_model_len == 256
    long = " ".join(["retrieval"] * 400)
    with pytest.raises(ContextLengthError, match="truncate_prompt_tokens"):
        minilm_llm.embed(long, use_tqdm=False)
    out = minilm_llm.embed([long, SENTENCES[4]], use_tqdm=False, truncate_prompt_tokens=16)
    assert len(out[0].prompt_token_ids) == 16
    assert_close_vectors([o.outputs.embedding for o in out], reference(minilm, [long, SENTENCES[4]], 16))
    out = minilm_llm.embed(long, use_tqdm=False, truncate_prompt_tokens=-1)
    assert_close_vectors([out[0].outputs.embedding], reference(minilm, [long]))
    with pytest.raises(RunnerError, match="embedding model"):
        minilm_llm.generate("hello", use_tqdm=False)


def test_pooling_scheduler_runs_requests_whole():
    """chunked_prefill=False: a request that does not fit the step's remaining budget waits."""
    from armserve.engine.kv_cache_manager import KVCacheManager
    from armserve.engine.request import Request
    from armserve.engine.scheduler import Scheduler
    from armserve.sampling_params import SamplingParams

    sched = Scheduler(KVCacheManager(8, 16, enable_caching=False), 10, 8, 10, chunked_prefill=False)
    for i in range(3):
        sched.add_request(Request(str(i), list(range(1, 7)), SamplingParams(max_tokens=1), 1))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("0", 6)]


# ---- the server --------------------------------------------------------------------------------


def test_openai_client_embeddings(minilm, embed_server):
    from openai import OpenAI

    client = OpenAI(base_url=embed_server.base_url, api_key="unused")
    want = reference(minilm, SENTENCES)
    one = client.embeddings.create(model="minilm", input=SENTENCES[0], encoding_format="float")
    assert_close_vectors([one.data[0].embedding], want[:1])
    tok = sentence_transformer(minilm).tokenizer
    assert one.usage.prompt_tokens == len(tok(SENTENCES[0])["input_ids"])
    # the client's default asks for base64 and decodes it
    batch = client.embeddings.create(model="minilm", input=SENTENCES)
    assert [d.index for d in batch.data] == list(range(len(SENTENCES)))
    assert_close_vectors([d.embedding for d in batch.data], want)
    ids = [tok(s)["input_ids"] for s in SENTENCES[:3]]
    by_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert_close_vectors([d.embedding for d in by_ids.data], want[:3])
    single_ids = client.embeddings.create(model="minilm", input=ids[1], encoding_format="float")
    assert_close_vectors([single_ids.data[0].embedding], want[1:2])
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_base64_round_trip_and_pooling_endpoint(embed_server):
    body = {"model": "minilm", "input": SENTENCES[:2]}
    floats = httpx.post(f"{embed_server.base_url}/embeddings", json=body, timeout=60).json()
    b64 = httpx.post(f"{embed_server.base_url}/embeddings", json={**body, "encoding_format": "base64"},
                     timeout=60).json()
    for f, b in zip(floats["data"], b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        # (two requests: the engine may batch their rows differently, so equal up to GEMM rounding)
        assert decoded.shape == (len(f["embedding"]),)
        np.testing.assert_allclose(decoded, np.asarray(f["embedding"], dtype=np.float32), rtol=1e-4, atol=1e-5)
    pooled = httpx.post(f"{embed_server.url}/pooling", json=body, timeout=60).json()
    assert [d["object"] for d in pooled["data"]] == ["pooling", "pooling"]
    assert_close_vectors([d["data"] for d in pooled["data"]],
                         torch.tensor([d["embedding"] for d in floats["data"]]))


def test_request_log_shows_pooling_params(embed_server):
    # --enable-log-requests: an embedding request logs its PoolingParams, not a placeholder SamplingParams
    body = {"model": "minilm", "input": ["one two three four five six"], "truncate_prompt_tokens": 4}
    r = httpx.post(f"{embed_server.base_url}/embeddings", json=body, timeout=60).json()
    line = next(ln for ln in embed_server.log().splitlines() if f"Received request {r['id']}-0:" in ln)
    assert "4 prompt tokens" in line and "PoolingParams(" in line and "truncate_prompt_tokens=4" in line, line
    assert "SamplingParams" not in line


def test_langchain_openai_embeddings(minilm, embed_server):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(model="minilm", base_url=embed_server.base_url, api_key="unused",
                           check_embedding_ctx_length=False)
    want = reference(minilm, SENTENCES)
    assert_close_vectors(emb.embed_documents(SENTENCES), want)
    assert_close_vectors([emb.embed_query(SENTENCES[2])], want[2:3])


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [[1, 2, 10**9]]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": ["ok"] * 2049}, "input"),
    ({"input": "word " * 300}, "input"),
    ({"input": "hello", "dimensions": 8}, "dimensions"),
    ({"input": "hello", "dimensions": 0}, "dimensions"),
    ({"input": "hello", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "hello", "encoding_format": "int8"}, "encoding_format"),
    ({"input": {"text": "hello"}}, "input"),
])
def test_embeddings_refusals(embed_server, body, param):
    r = httpx.post(f"{embed_server.base_url}/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"] or "").split(".")[0] == param, err  # (validation names the union member: input.str)
    if body["input"] == "word " * 300:
        assert err["code"] == "context_length_exceeded"


def test_wrong_model_kind_is_refused(embed_server, server):
    r = httpx.post(f"{embed_server.base_url}/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    r = httpx.post(f"{embed_server.base_url}/completions", json={"prompt": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    r = httpx.post(f"{server.base_url}/embeddings", json={"input": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    assert httpx.get(f"{embed_server.url}/health", timeout=10).status_code == 200


def test_score_and_rerank_with_an_embedding_model(minilm, embed_server):
    """An embedding model scores a pair by the cosine similarity of its two vectors, as
    sentence-transformers' `similarity` does; /rerank orders by it."""
    query, docs = SENTENCES[2], SENTENCES[:2] + SENTENCES[3:]
    st = sentence_transformer(minilm)
    want = st.similarity(st.encode([query]), st.encode(docs))[0].tolist()
    s = httpx.post(f"{embed_server.url}/score", json={"text_1": query, "text_2": docs}, timeout=60).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(want, abs=1e-4)
    r = httpx.post(f"{embed_server.url}/v1/rerank", json={"query": query, "documents": docs}, timeout=60).json()
    assert [x["index"] for x in r["results"]] == sorted(range(len(docs)), key=lambda i: -want[i])


def test_runner_flags(tiny_llama):
    """--runner (vLLM's current flag) and --task (its older one) pick the runner (a decoder pools
    under --runner pooling: tests/test_decoder_pooling.py); --hf-overrides is read as JSON."""
    import argparse

    from armserve import LLM
    from armserve.config import ConfigError
    from armserve.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args(["--task", "embed"]))["runner"] == "pooling"
    assert engine_kwargs(p.parse_args(["--runner", "generate"]))["runner"] == "generate"
    assert "runner" not in engine_kwargs(p.parse_args([]))
    with pytest.raises(SystemExit):
        engine_kwargs(p.parse_args(["--task", "embed", "--runner", "generate"]))
    assert engine_kwargs(p.parse_args(["--hf-overrides", '{"a": 1}']))["hf_overrides"] == '{"a": 1}'
    with pytest.raises(ConfigError, match="unknown runner"):
        LLM(tiny_llama, runner="embed")


def test_matryoshka_dimensions(tiny_bert, tmp_path):
    """A Matryoshka model (config `matryoshka_dimensions`) cuts its vectors to `dimensions` before
    normalizing (sentence-transformers' truncate_dim); other sizes and other models are refused."""
    import json
    import shutil

    from transformers import AutoModel, AutoTokenizer

    from armserve import LLM, PoolingParams
    from armserve.engine.input_processor import RequestError

    folder = str(tmp_path / "mrl")
    shutil.copytree(tiny_bert, folder)
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    cfg["matryoshka_dimensions"] = [16, 32, 64]
    with open(f"{folder}/config.json", "w") as f:
        json.dump(cfg, f)
    llm = LLM(folder, dtype="float32")
    outs = llm.embed(SENTENCES[:2], PoolingParams(dimensions=16), use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    ref = AutoModel.from_pretrained(tiny_bert, dtype=torch.float32).eval()
    with torch.no_grad():
        cls = torch.stack([ref(**tok(s, return_tensors="pt")).last_hidden_state[0, 0] for s in SENTENCES[:2]])
    assert_close_vectors([o.outputs.embedding for o in outs], F.normalize(cls[:, :16], dim=-1))
    with pytest.raises(RequestError, match="dimensions 20 is not supported by this model; supported: 16, 32, 64"):
        llm.embed("x", PoolingParams(dimensions=20), use_tqdm=False)
    plain = LLM(tiny_bert, dtype="float32")
    with pytest.raises(RequestError, match="does not support Matryoshka"):
        plain.embed("x", PoolingParams(dimensions=16), use_tqdm=False)


def test_async_llm_encode(minilm):
    """AsyncLLM.encode (vLLM's name): the vector of one input, as the offline engine gives it."""
    import asyncio

    from armserve.config import EngineConfig
    from armserve.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig(model=minilm, dtype="float32"), log_stats=False, engine_process=False)
    try:
        async def main():
            return [out async for out in engine.encode(SENTENCES[1])]

        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    assert len(outs) == 1 and outs[0].finished
    assert_close_vectors([outs[0].pooled], reference(minilm, SENTENCES[1:2]))


@pytest.mark.parametrize("mode,normalize", [("cls", False), ("lasttoken", True), ("mean", True)])
def test_pooling_from_sentence_transformers_files(tiny_bert, tmp_path, mode, normalize):
    """A folder sentence-transformers itself saved (its current file format) with each pooling
    mode, with and without Normalize: armserve reads it and embeds as it does."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    from armserve import LLM

    parts = [models.Transformer(tiny_bert), models.Pooling(64, pooling_mode=mode)]
    if normalize:
        parts.append(models.Normalize())
    st = SentenceTransformer(modules=parts, device="cpu")
    folder = str(tmp_path / mode)
    st.save(folder)
    want = torch.as_tensor(SentenceTransformer(folder, device="cpu").encode(SENTENCES))
    outs = LLM(folder, dtype="float32").embed(SENTENCES, use_tqdm=False)
    assert_close_vectors([o.outputs.embedding for o in outs], want)


def test_unsupported_pooling_is_refused_at_load(tiny_bert, tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    from armserve import LLM
    from armserve.model_loader import ModelLoadError

    folder = str(tmp_path / "max")
    SentenceTransformer(modules=[models.Transformer(tiny_bert), models.Pooling(64, pooling_mode="max")],
                        device="cpu").save(folder)
    with pytest.raises(ModelLoadError, match="pooling 'max'"):
        LLM(folder, dtype="float32")
