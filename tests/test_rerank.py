"""Cross-encoder rerankers (`*ForSequenceClassification`): a tiny random BERT cross-encoder made
with transformers against sentence-transformers' CrossEncoder (`LLM.score`, /score, /rerank), and
the RoBERTa-family head against transformers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

# The head is scaled up (_spread), which scales float rounding differences with it: scores agree to
# this, and the orders exactly.
TOL = 5e-4
QUERY = "what do foxes eat"
DOCS = ["The quick brown fox jumps over the lazy dog.", "A man is eating food.", "Foxes eat rabbits and berries.",
        "CPU inference", "Rerankers score a query against each document in one pass."]


def _spread(model, tokenizer) -> None:
    """A random head gives every pair ~0.5: the head is rescaled so that these pairs' logits have
    mean 0 and standard deviation 3 (the scores then tell the documents apart), and the token-type
    embeddings enlarged (a wrong segment id then shows)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
        model.bert.embeddings.token_type_embeddings.weight.mul_(20)
        pooled = model.bert(**tokenizer([QUERY] * len(DOCS), DOCS, return_tensors="pt", padding=True)).pooler_output
        logits = pooled @ model.classifier.weight[0]
        scale = 3.0 / logits.std()
        model.classifier.weight.mul_(scale)
        model.classifier.bias.fill_(-float(logits.mean() * scale))


@pytest.fixture(scope="module")
def cross_encoder(minilm, tmp_path_factory) -> str:
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=128, num_labels=1)
    model = BertForSequenceClassification(cfg).eval()
    _spread(model, AutoTokenizer.from_pretrained(minilm))
    out = str(tmp_path_factory.mktemp("tiny-cross-encoder"))
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(minilm, f), out)
    return out


@pytest.fixture(scope="module")
def reference_scores(cross_encoder):
    from sentence_transformers import CrossEncoder

    ce = CrossEncoder(cross_encoder, device="cpu")
    scores = [float(s) for s in ce.predict([(QUERY, d) for d in DOCS])]
    assert max(scores) - min(scores) > 0.1, scores  # the test can tell documents apart
    return scores


@pytest.fixture(scope="module")
def rerank_server(cross_encoder):
    """The server's app over the cross-encoder, in this process (the engine on a thread): the
    subprocess path is test_embeddings.py's."""
    from fastapi.testclient import TestClient

    from armserve.config import EngineConfig
    from armserve.engine.async_llm import AsyncLLM
    from armserve.entrypoints.api_server import build_app
    from armserve.entrypoints.metrics import PrometheusMetrics

    engine = AsyncLLM(EngineConfig(model=cross_encoder, dtype="float32"), log_stats=False, engine_process=False)
    with TestClient(build_app(engine, ["ce"], PrometheusMetrics("ce", 1), access_log=False)) as client:
        yield client


def test_llm_score_matches_cross_encoder(cross_encoder, reference_scores):
    from armserve import LLM

    llm = LLM(cross_encoder, dtype="float32")
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert got == pytest.approx(reference_scores, abs=TOL)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -reference_scores[i])
    side_by_side = llm.score([QUERY] * 2, DOCS[:2], use_tqdm=False)
    assert [o.outputs.score for o in side_by_side] == pytest.approx(reference_scores[:2], abs=TOL)
    probs = llm.classify("just one text", use_tqdm=False)[0].outputs.probs
    assert len(probs) == 1 and 0 < probs[0] < 1
    with pytest.raises(ValueError, match="embed"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pairs 2 texts with 3"):
        llm.score(["a", "b"], ["c", "d", "e"], use_tqdm=False)


@pytest.mark.parametrize("kind", ["roberta", "xlm-roberta"])
def test_roberta_cross_encoder_logits_match_transformers(kind, tmp_path):
    from transformers import (AutoModelForSequenceClassification, RobertaConfig, RobertaForSequenceClassification,
                              XLMRobertaConfig, XLMRobertaForSequenceClassification)

    from armserve import model_loader

    torch.manual_seed(2)
    cfg_cls, model_cls = ((RobertaConfig, RobertaForSequenceClassification) if kind == "roberta" else
                          (XLMRobertaConfig, XLMRobertaForSequenceClassification))
    cfg = cfg_cls(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=70, pad_token_id=1, type_vocab_size=1, num_labels=3)
    model_cls(cfg).eval().save_pretrained(str(tmp_path))
    src = model_loader.resolve_model_path(str(tmp_path))
    ours = model_loader.load_model(src, model_loader.load_config(src), torch.float32)
    ref = AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (n,), generator=g) for n in (9, 4, 15)]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        logits = ours.classify(ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), lens), lens)
        want = torch.cat([ref(input_ids=s[None]).logits for s in seqs])
    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_modernbert_cross_encoder_logits_match_transformers(pooling, tmp_path):
    """ModernBertForSequenceClassification (gte-reranker-modernbert): its pooling, head and
    classifier, sequences longer than the local attention window."""
    from transformers import AutoModelForSequenceClassification, ModernBertConfig, ModernBertForSequenceClassification

    from armserve import model_loader

    torch.manual_seed(3)
    cfg = ModernBertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                           intermediate_size=48, max_position_embeddings=70, local_attention=8,
                           global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           cls_token_id=1, sep_token_id=2, classifier_pooling=pooling, num_labels=2)
    model = ModernBertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(tmp_path))
    src = model_loader.resolve_model_path(str(tmp_path))
    ours = model_loader.load_model(src, model_loader.load_config(src), torch.float32)
    ref = AutoModelForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 100, (n,), generator=g) for n in (9, 4, 15)]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        logits = ours.classify(ours(torch.cat(seqs), torch.cat([torch.arange(n) for n in lens]), lens), lens)
        want = torch.cat([ref(input_ids=s[None]).logits for s in seqs])
    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-4)


def test_rerank_and_score_endpoints(rerank_server, reference_scores):
    order = sorted(range(len(DOCS)), key=lambda i: -reference_scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = rerank_server.post(path, json={"model": "ce", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == order
        assert [x["relevance_score"] for x in results] == pytest.approx([reference_scores[i] for i in order], abs=TOL)
        assert results[0]["document"]["text"] == DOCS[order[0]]
    # Cohere's documents as objects, top_n, no documents back
    r = rerank_server.post("/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                               "top_n": 2, "return_documents": False}).json()
    assert [x["index"] for x in r["results"]] == order[:2] and "document" not in r["results"][0]
    assert r["usage"]["total_tokens"] > 0
    s = rerank_server.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in s["data"]] == pytest.approx(reference_scores, abs=TOL)


@pytest.mark.parametrize("path,body,param", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": "", "documents": DOCS}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["x"] * 2049}, "documents"),
    ("/rerank", {"query": QUERY, "documents": ["word " * 200]}, "documents"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a"}, "body"),
    ("/v1/embeddings", {"input": "hello"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
])
def test_rerank_refusals(rerank_server, path, body, param):
    r = rerank_server.post(path, json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "body").split(".")[0] == param, r.text


@pytest.mark.parametrize("pooler", [True, False], ids=["cls-dense", "cls-output-only"])
def test_bert_reranker_gguf(cross_encoder, reference_scores, tmp_path, pooler):
    """A reranker GGUF in llama.cpp's layout (pooling_type rank): `cls` (dense + tanh) and
    `cls.output`. With the pooler as `cls`, the cross-encoder's own scores (sentence-transformers);
    without it (llama.cpp's converter drops BERT's pooler) the classifier over the [CLS] row, as
    llama.cpp computes it, from transformers' hidden states."""
    from gguf import PoolingType
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertForSequenceClassification

    from armserve import LLM
    from test_gguf_embeddings import write_bert_gguf

    sd = load_file(os.path.join(cross_encoder, "model.safetensors"))
    head = {"cls.output.weight": sd["classifier.weight"], "cls.output.bias": sd["classifier.bias"]}
    if pooler:
        head |= {"cls.weight": sd["bert.pooler.dense.weight"], "cls.bias": sd["bert.pooler.dense.bias"]}
    path = str(tmp_path / "reranker.gguf")
    write_bert_gguf(cross_encoder, path, PoolingType.RANK, head)
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.config.runner == "pooling"
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    want = reference_scores
    if not pooler:
        tok = AutoTokenizer.from_pretrained(cross_encoder)
        ref = BertForSequenceClassification.from_pretrained(cross_encoder, dtype=torch.float32).eval()
        with torch.no_grad():
            cls_rows = ref.bert(**tok([QUERY] * len(DOCS), DOCS, return_tensors="pt", padding=True)).last_hidden_state[:, 0]
            want = torch.sigmoid(ref.classifier(cls_rows)[:, 0]).tolist()
        assert max(abs(a - b) for a, b in zip(want, reference_scores)) > 10 * TOL  # (the two heads differ)
    assert got == pytest.approx(want, abs=TOL)
    assert sorted(range(len(DOCS)), key=lambda i: -got[i]) == sorted(range(len(DOCS)), key=lambda i: -want[i])


def test_reranker_gguf_without_classifier_is_refused(cross_encoder, tmp_path):
    from gguf import PoolingType
    from safetensors.torch import load_file

    from armserve import LLM
    from armserve.model_source import ModelLoadError
    from test_gguf_embeddings import write_bert_gguf

    sd = load_file(os.path.join(cross_encoder, "model.safetensors"))
    path = str(tmp_path / "headless.gguf")
    write_bert_gguf(cross_encoder, path, PoolingType.RANK, {"cls.weight": sd["bert.pooler.dense.weight"]})
    with pytest.raises(ModelLoadError, match="without a cls.output tensor"):
        LLM(path, dtype="float32")
