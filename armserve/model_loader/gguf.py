"""GGUF files (llama.cpp's format): the header parsed once per load and shared with transformers,
the config made by the file's family (`gguf_config` of the class that names its
`general.architecture`), and the tensors under Hugging Face names: the family's GGUF names on
top of llama.cpp's standard ones, MoE experts split out of their stacked tensors, quantized blocks
kept as QuantizedTensors where they feed a linear layer, the rest dequantized."""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import logging
import mmap
import os
import re
from struct import error as struct_error
from typing import Any, Iterator, Mapping

import torch

from armserve.model_source import ModelLoadError, ModelSource
from armserve.memory import release_free_heap
from armserve.models import UnsupportedArchitectureError, get_model_class, gguf_model_class
from armserve.quantization import QuantizedTensor
from armserve.quantization.gguf import convert, gguf_rows

logger = logging.getLogger(__name__)

# llama.cpp's standard tensor names -> Hugging Face's (a family adds or overrides block names
# with its `gguf_block_names`)
_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "cls.output": "score",  # a reranker's classifier (rank_config); encoders name it their own way
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# One parsed GGUF file, shared by the config, the tokenizer and the weights of one load:
# transformers would parse the whole file again for the config and for the tokenizer.
_READER: tuple[tuple[str, float, int], Any] | None = None


def _file_key(path: str) -> tuple[str, float, int]:
    """What names one version of a file: its real path, modification time and size."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime, st.st_size


def _reader(path: str):
    """The GGUFReader of `path` (gguf_reader.py), parsed once (until another file or a changed one is read)."""
    global _READER
    from armserve.model_loader.gguf_reader import LazyGGUFReader

    key = _file_key(path)
    if _READER is None or _READER[0] != key:
        _READER = None  # drop the old parse first
        try:
            _READER = (key, LazyGGUFReader(path))
        except (AttributeError, TypeError) as e:
            # NOTE: LazyGGUFReader overrides GGUFReader's private field parsing (gguf 0.17-0.19): a
            # gguf release that reshapes it must cost load time and memory, not the load itself.
            from gguf.gguf_reader import GGUFReader

            logger.warning("gguf %s: the lazy GGUF header reader does not fit it (%s); reading the whole "
                           "header with gguf's GGUFReader", importlib.metadata.version("gguf"), e)
            _READER = (key, GGUFReader(path))
    return _READER[1]


# transformers' reading of the whole header (`load_gguf_checkpoint(path, return_tensors=False)`) for
# the file of the load under way: every metadata value as Python objects, with the vocabulary or
# without it (the key's last item).
_HEADER: tuple[tuple[str, float, int, bool], dict] | None = None
# The vocabulary's arrays, which transformers reads for a tokenizer but not for a config (only
# their length, as the vocabulary size of a file whose header leaves it out).
_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


class _WithoutVocabulary:
    """A parsed GGUF file as transformers' config reading sees it: the vocabulary's arrays left out
    (converted item by item to Python values they are 1-5 s of CPU for a 50-260k vocabulary, which
    a config does not use), and `{arch}.vocab_size` added from the token count where the header
    has none: what transformers would take for it."""

    def __init__(self, reader) -> None:
        import numpy as np
        from gguf import GGUFValueType
        from gguf.gguf_reader import ReaderField

        self._reader = reader
        self.fields = {k: f for k, f in reader.fields.items() if k not in _VOCABULARY}
        tokens, key = reader.fields.get("tokenizer.ggml.tokens"), f"{header_field(reader, 'general.architecture')}.vocab_size"
        if tokens is not None and key not in self.fields:
            self.fields[key] = ReaderField(0, key, [np.array([len(tokens.data)], dtype=np.uint64)], [0],
                                           [GGUFValueType.UINT64])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def release_reader() -> None:
    """Forget the parsed GGUF file (after a load has taken what it needs)."""
    global _READER, _HEADER
    _READER = _HEADER = None


@contextlib.contextmanager
def shared_with_transformers(src: ModelSource, vocabulary: bool = True) -> Iterator[None]:
    """While transformers builds a config or tokenizer from `src`'s GGUF file, its
    `gguf.GGUFReader(path)` returns the reader parsed by `_reader` instead of a new parse, and its
    reading of the whole header is done once per load; without the vocabulary's arrays when
    `vocabulary` is False (a config alone: the tokenizer is read from the cache, or not at all)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    original, original_header = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    mine = os.path.realpath(os.path.join(src.folder, src.gguf_file))

    def reader(path, mode: str = "r"):
        if mode == "r" and os.path.realpath(path) == mine:
            return _reader(mine) if vocabulary else _WithoutVocabulary(_reader(mine))
        return original(path, mode)

    def header(path, return_tensors: bool = False, **kwargs):
        # NOTE: AutoConfig and AutoTokenizer each read the whole header for the config (transformers
        # 5.x, for the architectures its metadata-only reader does not cover), converting every
        # vocabulary entry to Python values: seconds for a 150-260k vocabulary. Both take only
        # "config" from it, which each gets a copy of.
        global _HEADER
        nonlocal vocabulary
        if return_tensors or kwargs or os.path.realpath(path) != mine:
            return original_header(path, return_tensors, **kwargs)
        key = _file_key(mine)
        # (one with the vocabulary serves a config too)
        if _HEADER is None or _HEADER[0][:3] != key or (vocabulary and not _HEADER[0][3]):
            _HEADER = None
            parsed = original_header(path, return_tensors=False)
            if not vocabulary and "vocab_size" not in parsed["config"]:
                # (a header read without the vocabulary that still lacks vocab_size reads it all: never seen)
                vocabulary = True
                parsed = original_header(path, return_tensors=False)
            _HEADER = ((*key, vocabulary), parsed)
        return {**_HEADER[1], "config": copy.deepcopy(_HEADER[1]["config"])}

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = reader, header
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = original, original_header


def read_config(src: ModelSource, vocabulary: bool = True):
    """The config of a GGUF file, made by the `gguf_config` of the family that names the file's
    `general.architecture` (transformers' reading of the header, completed or replaced). With
    `vocabulary` False the vocabulary is not converted: no tokenizer will be made from this parse."""
    from transformers import AutoConfig

    reader = _reader(os.path.join(src.folder, src.gguf_file))
    field = lambda key: header_field(reader, key)  # noqa: E731
    gguf_arch = field("general.architecture") or ""
    cls = gguf_model_class(gguf_arch)

    def read():
        with shared_with_transformers(src, vocabulary):
            return AutoConfig.from_pretrained(src.folder, gguf_file=src.gguf_file)

    tensors = {t.name: t.data for t in reader.tensors}
    config = cls.gguf_config(field, tensors, read)
    if GGUF_POOLING.get(field(f"{gguf_arch}.pooling_type")) == "RANK":
        config = rank_config(config, (getattr(config, "architectures", None) or cls.architectures)[0], tensors,
                             src.gguf_file)
        config.rerank_template = rerank_template(field("tokenizer.chat_template.rerank"))
    return config


def rank_config(config, arch: str, tensors: Mapping[str, Any], name: str):
    """A reranker GGUF (pooling_type rank) as its family's sequence classifier, with llama.cpp's
    head: encoders score their first token through `cls` (dense + tanh, optional) and
    `cls.output`; decoders (Qwen3-Reranker) their last token through `cls.output`, whose rows
    llama.cpp softmaxes, the first row's probability being the score: two rows ([yes, no]) are
    one logit, yes - no, whose sigmoid is that probability. (The pair's prompt: `rerank_template`.)"""
    target = arch.removesuffix("ForCausalLM").removesuffix("Model") + "ForSequenceClassification"
    try:
        model_cls = get_model_class(target)
    except UnsupportedArchitectureError:
        raise ModelLoadError(f"{name} is a reranker (pooling_type rank) of {arch}, which has no "
                             "sequence-classifier form here") from None
    head = tensors.get("cls.output.weight")
    if head is None:
        raise ModelLoadError(f"{name} is a reranker (pooling_type rank) without a cls.output tensor: not supported")
    rows = int(head.shape[0])
    config.architectures = [target]
    if hasattr(model_cls, "has_lm_head"):  # a decoder adapted to pooling (models/adapters.py)
        if "cls.weight" in tensors or rows > 2:
            raise ModelLoadError(f"{name}: a decoder reranker's head is cls.output of one or two rows, got "
                                 f"{rows} rows{' and a cls dense layer' if 'cls.weight' in tensors else ''}")
        config.num_labels = 1
        config.score_rows_true_false = rows == 2
    else:
        config.num_labels = rows
        config.classifier_pooler = "cls.weight" in tensors
    return config


# llama.cpp's `{arch}.pooling_type` (enum llama_pooling_type: 0 none, 4 rank) -> armserve's pooling
GGUF_POOLING = {0: None, 1: "MEAN", 2: "CLS", 3: "LAST", 4: "RANK"}


def pooling_type(src: ModelSource) -> str | None:
    """The pooling an embedding model's GGUF header names (`{arch}.pooling_type`: MEAN, CLS,
    LAST, or RANK for a reranker's head); None for a model that pools nothing (a generator).
    Reads the metadata only (the vocabulary is skipped, not parsed)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    path = os.path.join(src.folder, src.gguf_file)
    try:
        meta, _ = read_gguf_metadata(path)
    except (OSError, ValueError, struct_error) as e:
        raise ModelLoadError(f"cannot read GGUF file {path} (corrupt or truncated?): {e}") from e
    value = meta.get(f"{meta['general.architecture']}.pooling_type")
    if value is None:
        return None
    if value not in GGUF_POOLING:
        raise ModelLoadError(f"{path}: unknown pooling_type {value!r}")
    return GGUF_POOLING[value]


def wordpiece_tokenizer(src: ModelSource):
    """The WordPiece tokenizer of a BERT-family GGUF file (`tokenizer.ggml.model` "bert", which
    transformers cannot read), as a BertTokenizerFast. llama.cpp's converter stores the vocabulary
    with a "phantom space": a word-start token as "\u2581word", a continuation "##ing" as "ing",
    [SPECIAL] tokens as they are; undone here. llama.cpp lowercases and strips accents (uncased)."""
    from transformers import BertTokenizerFast
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta, _ = read_gguf_metadata(os.path.join(src.folder, src.gguf_file), ("tokenizer.ggml.tokens",))
    tokens = meta["tokenizer.ggml.tokens"]

    def original(t: str) -> str:
        if t.startswith("\u2581"):
            return t[1:]
        return t if t.startswith("[") and t.endswith("]") else "##" + t

    vocab = {original(t): i for i, t in enumerate(tokens)}

    def special(key: str, default: str) -> str:
        i = meta.get(f"tokenizer.ggml.{key}")
        return original(tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else default

    return BertTokenizerFast(vocab=vocab, do_lower_case=True, unk_token=special("unknown_token_id", "[UNK]"),
                             sep_token=special("seperator_token_id", "[SEP]"),
                             pad_token=special("padding_token_id", "[PAD]"),
                             cls_token=special("cls_token_id", special("bos_token_id", "[CLS]")),
                             mask_token=special("mask_token_id", "[MASK]"))


def rerank_template(text: str | None) -> str | None:
    """A reranker GGUF's prompt for a pair (its `tokenizer.chat_template.rerank`, which llama.cpp's
    converter writes for Qwen3-Reranker: text with `{query}` and `{document}` in it) as a score
    template, a chat template over the roles "query" and "document" (prompts.encode_pair); None
    when the file has none."""
    if not text:
        return None
    out = []
    for i, piece in enumerate(re.split(r"(\{query\}|\{document\})", text)):
        if i % 2:
            out.append("{{ messages[%d]['content'] }}" % (0 if piece == "{query}" else 1))
        elif piece:
            out.append("{% raw %}" + piece + "{% endraw %}")  # the rest is literal text, braces and all
    return "".join(out)


def tokenizer_model(src: ModelSource) -> str | None:
    """`tokenizer.ggml.model` of a GGUF file (gpt2, llama, bert, ...)."""
    return header_field(_reader(os.path.join(src.folder, src.gguf_file)), "tokenizer.ggml.model")


def header_field(reader, key: str):
    """A metadata value of the GGUF file: a string, a number, an array's length; None if absent."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None or not f.types:
        return None
    if f.types[0] == GGUFValueType.ARRAY:
        return len(f.data)
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]].tolist()[0] if f.data else None


def unpermute_qk(w: torch.Tensor | QuantizedTensor, n_head: int) -> torch.Tensor | QuantizedTensor:
    """Undo llama.cpp's interleaving of rotary pairs in q/k rows (weights, quantized too, and biases)."""
    if isinstance(w, QuantizedTensor):  # each row has its own scales: permute them alike
        szp = None if w.szp is None else unpermute_qk(w.szp, n_head)
        return QuantizedTensor(w.fmt, unpermute_qk(w.codes, n_head), unpermute_qk(w.scales, n_head), szp, w.group)
    d = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, d // n_head // 2, 2, *rest).transpose(1, 2).reshape(d, *rest)


# GGUF tensors that feed a linear layer (so may stay quantized; attn_qkv: q/k/v fused, as some
# families store them); token_embd too, as a tied lm_head.
_LINEAR = {"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output",
           "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_q_a", "attn_q_b", "attn_kv_a_mqa"}
# MoE experts stacked in one GGUF tensor [experts, rows, cols] -> one expert's projection
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def iter_weights(path: str, config, cls: type, keep_quantized: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's tensors under Hugging Face names (the model class's `gguf_names` and
    `gguf_block_names` on top of llama.cpp's standard ones, blocks under its `gguf_layer_prefix`), q/k rows un-permuted where llama.cpp permuted them
    (`gguf_permuted_qk`), norm weights back from llama.cpp's 1 + w where the family stores them so
    (`gguf_norm_offset`)."""
    try:
        reader = _reader(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path} (corrupt or truncated?): {e}") from e
    permute = cls.gguf_permuted_qk
    block_names = {**BLOCK_NAMES, **cls.gguf_block_names}
    names = {**_NAMES, **getattr(cls, "gguf_names", {})}
    layer_prefix = getattr(cls, "gguf_layer_prefix", "model.layers")
    norm_offset = float(cls.gguf_norm_offset)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    tensors, mapping = list(reader.tensors), getattr(getattr(reader.data, "base", None), "_mmap", None)
    # NOTE: the parsed header (one small array per vocabulary entry: ~250 MB for Qwen2.5's 151k
    # tokens) is dropped before the weights come in, so that it does not add to the load's peak;
    # the tensors' blocks stay reachable through their views of the file mapping.
    del reader
    release_reader()
    release_free_heap()
    for t in tensors:
        try:
            parts = t.name.split(".")
            if parts[:2] == ["cls", "output"]:  # (llama.cpp's one dotted name: a reranker's classifier)
                parts = ["cls.output", *parts[2:]]
            blk = parts[0] == "blk"
            kind = parts[2] if blk else parts[0]
            if blk and kind in _EXPERTS:
                yield from _experts(t, parts, keep_quantized, path)
                continue
            base = (block_names if blk else names).get(kind)
            if base is None:
                continue
            name = f"{layer_prefix}.{parts[1]}.{base}.{parts[3]}" if blk else f"{base}.{parts[1]}"
            if keep_quantized and kind == "token_embd" and has_output and parts[-1] == "weight":
                # NOTE: an untied token table stays where the file is mapped, as stored: lookups
                # dequantize the rows they read (quantization/embedding.py MappedEmbedding), and
                # the table's pages are the page cache's, not a copy (~150 MB for a 150k vocabulary).
                rows = gguf_rows(t.tensor_type.name, t.data, int(t.n_elements) // int(t.shape[0]), int(t.shape[0]))
                if rows is not None:
                    yield name, rows
                    continue
            qt = None
            if keep_quantized and parts[-1] == "weight" and (kind in _LINEAR or kind == "token_embd"):
                qt = convert(t.tensor_type.name, t.data)
            w = qt if qt is not None else _dequantize(t, t.data, path)
            if permute and kind in ("attn_q", "attn_k"):
                w = unpermute_qk(w, n_head if kind == "attn_q" else n_kv)
            if isinstance(w, QuantizedTensor):
                if kind == "token_embd" and not has_output:
                    yield "lm_head.weight", w  # tied: the head's quantized GEMM and the lookups share the table
                yield name, w
                continue
            if norm_offset and name.endswith("norm.weight"):
                w -= norm_offset
            if kind == "ffn_gate_inp_shexp" and w.dim() == 1:
                w = w.unsqueeze(0)  # llama.cpp keeps Qwen2-MoE's shared-expert gate [hidden], HF [1, hidden]
            yield name, w
        finally:
            # converted copies are what the model keeps, not the mapped blocks
            _drop_pages(mapping, int(t.data_offset), int(t.n_bytes))
            release_free_heap()  # the conversion's temporaries, before they pile up in the heap
    # NOTE: the header's pages (read for the config and tokenizer: ~5 MB for a 150k vocabulary) and
    # the pages fault-around mapped next to each tensor's (~4 MB) are still resident; a table left
    # mapped (MappedEmbedding) faults back in the rows that lookups read.
    _drop_pages(mapping, 0, len(mapping) if mapping is not None else 0)


def _drop_pages(mm: mmap.mmap | None, offset: int, nbytes: int) -> None:
    """Unmap the pages of bytes [offset, offset + nbytes) of the file mapping `mm` from this process
    (they stay in the page cache). The reader maps the whole file and a load reads every tensor
    once: without this, the file's pages count in the process's resident memory until the end of
    the load, on top of the converted weights (the kernels read their own packed layout, so the
    mapped blocks are not kept)."""
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    first = offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(len(mm), offset + nbytes)
    if end > first:
        mm.madvise(mmap.MADV_DONTNEED, first, end - first)


def _experts(t, parts: list[str], keep_quantized: bool, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One stacked expert tensor (`blk.N.ffn_{gate,up,down}_exps`, [experts, rows, cols]) as each
    expert's projection under the Hugging Face name, quantized blocks kept as they are."""
    proj = _EXPERTS[parts[2]]
    for e in range(t.data.shape[0]):
        name = f"model.layers.{parts[1]}.mlp.experts.{e}.{proj}.{parts[3]}"
        data = t.data[e]  # [rows, bytes of a row] for block types, [rows, cols] for float ones
        qt = convert(t.tensor_type.name, data) if keep_quantized else None
        yield name, qt if qt is not None else _dequantize(t, data, path)


def _dequantize(t, data, path: str) -> torch.Tensor:
    """`data` (tensor `t`'s blocks, or a slice of them) as a writable float32 tensor."""
    import numpy as np
    from gguf.quants import dequantize

    try:
        arr = dequantize(data, t.tensor_type)
    except Exception as e:
        raise ModelLoadError(f"cannot dequantize tensor {t.name} ({t.tensor_type.name}) of {path}: {e}") from e
    return torch.from_numpy(np.array(arr, dtype=np.float32))
