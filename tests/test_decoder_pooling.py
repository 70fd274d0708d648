"""Decoder embedders and rerankers (models/adapters.py): tiny random Qwen3 / Llama checkpoints saved
as sentence-transformers folders against SentenceTransformer, `--runner pooling` on a causal LM
against transformers' final hidden states, and Qwen3-Reranker (the original through hf_overrides,
the converted *ForSequenceClassification) against plain transformers' yes/no softmax."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from conftest import CACHE, make_tiny_checkpoint

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a",
         "Instruct: Given a web search query, retrieve relevant passages\nQuery: what do foxes eat"]
MIN_COSINE = 0.9999
QUERY = "what do foxes eat"
DOCS = ["Foxes eat rabbits and berries.", "The CPU has two cores.", "A fox is a small omnivore.", "Paris"]
# the Qwen3-Reranker prompt (its model card's prefix, instruction line and suffix), as a score
# template over vLLM's "query" / "document" roles (jinja drops one trailing newline: three for two)
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {{ messages[0]['content'] }}\n<Document>: {{ messages[1]['content'] }}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n\n")
OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
             "is_original_qwen3_reranker": True}


def sentence_transformers_folder(checkpoint: str, mode: str, out: str) -> str:
    """`checkpoint`'s decoder saved as sentence-transformers' Qwen3-Embedding-style folder: the bare
    model (Qwen3Model / LlamaModel), modules.json, 1_Pooling, 2_Normalize."""
    from transformers import AutoModel, AutoTokenizer

    if os.path.isfile(os.path.join(out, "modules.json")):
        return out
    final, out = out, out + ".tmp"  # (made aside, then renamed: an interrupted run leaves no half folder)
    shutil.rmtree(out, ignore_errors=True)
    AutoModel.from_pretrained(checkpoint).save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    with open(os.path.join(out, "modules.json"), "w") as f:
        json.dump([{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                   for i, (p, t) in enumerate(modules)], f)
    with open(os.path.join(out, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 256, "do_lower_case": False}, f)
    os.makedirs(os.path.join(out, "1_Pooling"))
    os.makedirs(os.path.join(out, "2_Normalize"))
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens",
                                                      "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    with open(os.path.join(out, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **flags, "include_prompt": True}, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(out, final)
    return final


def assert_close(got, want: torch.Tensor) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    cos = F.cosine_similarity(got, want.float(), dim=-1)
    assert bool((cos >= MIN_COSINE).all()), cos.tolist()


@pytest.fixture(scope="module")
def tiny_qwen3(tokenizer_dir) -> str:
    return make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3"), "Qwen3ForCausalLM", tokenizer_dir,
                                perturb_norms=True)


@pytest.mark.parametrize("arch,mode", [("Qwen3ForCausalLM", "lasttoken"), ("LlamaForCausalLM", "mean_tokens")])
def test_decoder_embedder_matches_sentence_transformers(arch, mode, tokenizer_dir):
    """Qwen3-Embedding-style (last token) and e5/gte-style mean pooling over a bare decoder, several
    lengths in one step (each a causal prefill without a cache)."""
    from sentence_transformers import SentenceTransformer

    from armserve import LLM

    ckpt = make_tiny_checkpoint(os.path.join(CACHE, f"tiny-{arch}"), arch, tokenizer_dir, perturb_norms=True)
    folder = sentence_transformers_folder(ckpt, mode, f"{ckpt}-st-{mode}")
    want = torch.as_tensor(SentenceTransformer(folder, device="cpu").encode(TEXTS))
    llm = LLM(folder, dtype="float32")
    assert llm.llm_engine.config.runner == "pooling"  # Qwen3Model / LlamaModel: picked from the checkpoint
    assert_close([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], want)


def test_causal_lm_with_runner_pooling(tiny_qwen3):
    """`--runner pooling` on a *ForCausalLM: the final norm's last row (before the LM head),
    normalized; runner auto still generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from armserve import LLM
    from armserve.engine.pooling_backend import resolve_runner
    from armserve.config import EngineConfig

    assert resolve_runner(EngineConfig(model=tiny_qwen3)) == "generate"
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([ref.model(**tok(t, return_tensors="pt")).last_hidden_state[0, -1] for t in TEXTS])
    llm = LLM(tiny_qwen3, dtype="float32", task="embed")
    assert_close([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], F.normalize(want, dim=-1))


def reference_yes_probability(folder: str, texts: list[str]) -> list[float]:
    """Qwen3-Reranker's own recipe in plain transformers: P(yes) = softmax(logit[no], logit[yes])[1]
    at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    out = []
    with torch.no_grad():
        for t in texts:
            logits = model(**tok(t, return_tensors="pt")).logits[0, -1]
            out.append(float(torch.softmax(logits[[no, yes]], dim=0)[1]))
    return out


@pytest.fixture(scope="module")
def qwen3_reranker(tokenizer_dir) -> str:
    """An original (causal-LM) Qwen3-Reranker: untied LM head, as the 8B has."""
    return make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3-reranker"), "Qwen3ForCausalLM", tokenizer_dir,
                                perturb_norms=True, tie_word_embeddings=False)


def test_original_qwen3_reranker_scores(qwen3_reranker):
    """hf_overrides (vLLM's) turns the LM into a one-logit classifier over its [no, yes] rows: the
    scores are the yes-probabilities plain transformers computes on the score template's
    chat-formatted prompt (without a template, the texts as given: test_qwen3_reranker_endpoints)."""
    from armserve import LLM
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen3_reranker)
    prompts = [tok.apply_chat_template([{"role": "query", "content": QUERY}, {"role": "document", "content": d}],
                                       chat_template=RERANK_TEMPLATE, tokenize=False) for d in DOCS]
    assert prompts[0].startswith("<|im_start|>system\nJudge") and prompts[0].endswith("</think>\n\n")
    want = reference_yes_probability(qwen3_reranker, prompts)
    assert max(want) - min(want) > 0.05, want  # the documents are told apart
    llm = LLM(qwen3_reranker, dtype="float32", runner="pooling", hf_overrides=json.dumps(OVERRIDES),
              chat_template=RERANK_TEMPLATE)
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_qwen3_reranker_endpoints(qwen3_reranker):
    """/rerank and /score over the original Qwen3-Reranker (the server's app in this process), no
    score template: query and document as one text, vLLM's default."""
    from fastapi.testclient import TestClient

    from armserve.config import EngineConfig
    from armserve.engine.async_llm import AsyncLLM
    from armserve.entrypoints.api_server import build_app
    from armserve.entrypoints.metrics import PrometheusMetrics

    want = reference_yes_probability(qwen3_reranker, [QUERY + d for d in DOCS])
    config = EngineConfig(model=qwen3_reranker, dtype="float32", runner="pooling", hf_overrides=OVERRIDES)
    engine = AsyncLLM(config, log_stats=False, engine_process=False)
    with TestClient(build_app(engine, ["rr"], PrometheusMetrics("rr", 1), access_log=False)) as client:
        r = client.post("/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
        for x in results:
            assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5
        r = client.post("/score", json={"model": "rr", "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        torch.testing.assert_close(torch.tensor([d["score"] for d in r.json()["data"]]), torch.tensor(want),
                                   atol=1e-5, rtol=1e-4)
        r = client.post("/v1/embeddings", json={"model": "rr", "input": "hi"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"


def test_converted_sequence_classifier_matches_transformers(tokenizer_dir, tmp_path):
    """A Qwen3ForSequenceClassification checkpoint (Qwen3-Reranker converted: `score.weight`):
    the last token's logit through its sigmoid, as transformers computes it."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from armserve import LLM

    folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3-seq-cls"), "Qwen3ForSequenceClassification",
                                  tokenizer_dir, num_labels=1, pad_token_id=2)
    tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [float(torch.sigmoid(ref(**tok(QUERY + d, return_tensors="pt")).logits[0, 0])) for d in DOCS]
    llm = LLM(folder, dtype="float32")
    got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)


def test_bad_overrides_are_refused(qwen3_reranker):
    from armserve import LLM
    from armserve.config import ConfigError

    with pytest.raises(ConfigError, match="hf_overrides is not valid JSON"):
        LLM(qwen3_reranker, runner="pooling", hf_overrides="{nope")
    with pytest.raises(ValueError, match="architecture 'NopeForCausalLM' is not supported"):
        LLM(qwen3_reranker, runner="pooling", hf_overrides={"architectures": ["NopeForCausalLM"]})
    with pytest.raises(ConfigError, match="'zzqx-yes' is not a token"):
        LLM(qwen3_reranker, runner="pooling", hf_overrides={**OVERRIDES, "classifier_from_token": ["no", "zzqx-yes"]})
