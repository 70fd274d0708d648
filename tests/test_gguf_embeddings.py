"""GGUF embedding models: a `bert` GGUF (llama.cpp's tensor names, WordPiece vocabulary in its
phantom-space spelling, bert.pooling_type) and a `qwen3` GGUF with pooling_type last, both written
with the gguf package's GGUFWriter from tiny random transformers checkpoints and compared with
those checkpoints' transformers outputs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import CACHE, make_tiny_checkpoint

TEXTS = ["Hello World!", "The quick brown fox jumps over the lazy dog.", "Embeddings, unaffected résumé", "a"]
MIN_COSINE = 0.9999


def _phantom(token: str) -> str:
    """llama.cpp's spelling of a WordPiece token in a GGUF (its converter's phantom space)."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def write_bert_gguf(folder: str, path: str, pooling, head: dict | None = None) -> None:
    """llama.cpp's layout of a BERT checkpoint (a BertModel's, or a cross-encoder's under `bert.`);
    `head`: more tensors by GGUF name (a reranker's `cls` / `cls.output`)."""
    from gguf import GGUFWriter, TokenType
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = {k.removeprefix("bert."): v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w = GGUFWriter(path, "bert")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_causal_attention(False)
    w.add_pooling_type(pooling)
    w.add_token_type_count(cfg["type_vocab_size"])
    w.add_tokenizer_model("bert")
    w.add_token_list([_phantom(t) for t, _ in vocab])
    w.add_token_types([TokenType.CONTROL if t.startswith("[") and t.endswith("]") else TokenType.NORMAL
                       for t, _ in vocab])
    w.add_bos_token_id(tok.cls_token_id)  # llama.cpp's [CLS]
    w.add_eos_token_id(tok.sep_token_id)
    w.add_sep_token_id(tok.sep_token_id)
    w.add_unk_token_id(tok.unk_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_mask_token_id(tok.mask_token_id)

    def add(name: str, t) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))

    for gg, hf in (("token_embd", "word_embeddings"), ("token_types", "token_type_embeddings"),
                   ("position_embd", "position_embeddings")):
        add(f"{gg}.weight", sd[f"embeddings.{hf}.weight"])
    add("token_embd_norm.weight", sd["embeddings.LayerNorm.weight"])
    add("token_embd_norm.bias", sd["embeddings.LayerNorm.bias"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for gg, hf in (("attn_q", "attention.self.query"), ("attn_k", "attention.self.key"),
                       ("attn_v", "attention.self.value"), ("attn_output", "attention.output.dense"),
                       ("attn_output_norm", "attention.output.LayerNorm"), ("ffn_up", "intermediate.dense"),
                       ("ffn_down", "output.dense"), ("layer_output_norm", "output.LayerNorm")):
            for part in ("weight", "bias"):
                add(f"blk.{i}.{gg}.{part}", sd[p + hf + "." + part])
    for name, t in (head or {}).items():
        add(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pooling", ["MEAN"])  # (not the default, CLS: the header's is read)
def test_bert_gguf_matches_transformers(tiny_bert, tmp_path, pooling):
    """The GGUF's WordPiece tokenizer gives the HF tokenizer's ids, and its vectors are the HF
    model's mean rows, normalized."""
    from gguf import PoolingType
    from transformers import AutoModel, AutoTokenizer

    from armserve import LLM

    path = str(tmp_path / "tiny-bert.gguf")
    write_bert_gguf(tiny_bert, path, getattr(PoolingType, pooling))
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.config.runner == "pooling"
    outs = llm.embed(TEXTS, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(tiny_bert)
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in TEXTS]
    ref = AutoModel.from_pretrained(tiny_bert, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [ref(**tok(t, return_tensors="pt")).last_hidden_state[0] for t in TEXTS]
    want = torch.stack([r[0] if pooling == "CLS" else r.mean(0) for r in rows])
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = F.cosine_similarity(got, F.normalize(want, dim=-1), dim=-1)
    assert bool((cos >= MIN_COSINE).all()), cos.tolist()


def write_qwen3_gguf(folder: str, path: str, rank_tokens: tuple[str, str] | None = None) -> None:
    """A `qwen3` GGUF of an embedding model (pooling_type last): its byte-level BPE vocabulary and
    merges from the HF tokenizer, tied embeddings (no output tensor), F32. `rank_tokens` (yes, no):
    a reranker as llama.cpp's converter writes Qwen3-Reranker: pooling_type rank, `cls.output` the
    two tokens' rows of the head, and its prompt as the `rerank` chat template."""
    from gguf import GGUFWriter, PoolingType
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = load_file(os.path.join(folder, "model.safetensors"))
    tok = AutoTokenizer.from_pretrained(folder)
    tj = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w = GGUFWriter(path, "qwen3")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_pooling_type(PoolingType.RANK if rank_tokens else PoolingType.LAST)
    if rank_tokens:
        w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)

    def add(name: str, t) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    if rank_tokens:
        add("cls.output.weight", sd["model.embed_tokens.weight"][tok.convert_tokens_to_ids(list(rank_tokens))])
    add("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for gg, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                       ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                       ("attn_output", "self_attn.o_proj"), ("attn_q_norm", "self_attn.q_norm"),
                       ("attn_k_norm", "self_attn.k_norm"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                       ("ffn_down", "mlp.down_proj")):
            add(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_qwen3_embedding_gguf_matches_transformers(tokenizer_dir, tmp_path):
    """A decoder embedding GGUF: runner pooling from its pooling_type, the final norm's last row
    (normalized) of transformers' model on the same token ids."""
    from transformers import AutoModelForCausalLM

    from armserve import LLM

    folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3-tied"), "Qwen3ForCausalLM", tokenizer_dir,
                                  perturb_norms=True, tie_word_embeddings=True)
    path = str(tmp_path / "tiny-qwen3-embedding.gguf")
    write_qwen3_gguf(folder, path)
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.config.runner == "pooling"
    outs = llm.embed(TEXTS, use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([ref.model(input_ids=torch.tensor([o.prompt_token_ids])).last_hidden_state[0, -1]
                            for o in outs])
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = F.cosine_similarity(got, F.normalize(want, dim=-1), dim=-1)
    assert bool((cos >= MIN_COSINE).all()), cos.tolist()


# llama.cpp's converter's prompt for Qwen3-Reranker (shortened; braces of its own kept literal)
RERANK_TEMPLATE = ("<|im_start|>system\nJudge whether the Document meets the Query {{not a field}}.<|im_end|>\n"
                   "<|im_start|>user\n<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_reranker_gguf_matches_transformers(tokenizer_dir, tmp_path):
    """A Qwen3-Reranker GGUF (pooling_type rank, cls.output = the head's [yes, no] rows): the
    score of each pair is transformers' P(yes) over {yes, no} at the last token of the GGUF's
    rerank prompt, the prompt rendered as llama.cpp renders it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from armserve import LLM

    folder = make_tiny_checkpoint(os.path.join(CACHE, "tiny-qwen3-tied"), "Qwen3ForCausalLM", tokenizer_dir,
                                  perturb_norms=True, tie_word_embeddings=True)
    tok = AutoTokenizer.from_pretrained(folder)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    assert tok.unk_token_id not in (yes, no)
    path = str(tmp_path / "tiny-qwen3-reranker.gguf")
    write_qwen3_gguf(folder, path, rank_tokens=("yes", "no"))
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.config.runner == "pooling"
    query, docs = "what do foxes eat", ["Foxes eat rabbits.", "CPU inference", "The sky is blue today."]
    outs = llm.score(query, docs, use_tqdm=False)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = []
    for doc, o in zip(docs, outs):
        ids = tok(RERANK_TEMPLATE.replace("{query}", query).replace("{document}", doc))["input_ids"]
        assert o.prompt_token_ids == ids
        with torch.no_grad():
            logits = ref(input_ids=torch.tensor([ids])).logits[0, -1]
        want.append(float(torch.softmax(logits[[yes, no]], dim=0)[0]))
    got = [o.outputs.score for o in outs]
    assert got == pytest.approx(want, abs=1e-4)
    assert max(want) - min(want) > 1e-3, want  # the pairs are told apart
