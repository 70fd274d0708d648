"""BERT-style encoders (`BertModel`, `RobertaModel`, `XLMRobertaModel`): bidirectional attention,
post-LayerNorm blocks, absolute position and token-type embeddings. They produce one hidden row
per token; the pooling runner (engine/pooling_backend.py) turns each sequence's rows into one
vector (layers/pooler.py).

- No KV cache: a sequence is encoded whole in one step, so attention is bidirectional over each
  sequence's own rows: the C++ encoder-attention kernel (kernels.encoder_attention, flash style,
  no padding), or without it `scaled_dot_product_attention`, one call per group of sequences of the
  same length (`EncoderBatch.attention`). The linear layers are armserve's (layers/linear.py:
  prepacked dense GEMM kernels) without their biases, which go into the next op: attention (the
  kernel adds q, k, v's as it reads them), GELU (kernels.bias_gelu_) and the residual add +
  LayerNorm (kernels.layer_norm), one pass each.
- RoBERTa / XLM-RoBERTa: the same blocks; positions start after the padding id
  (`pad_token_id + 1`), as fairseq numbered them, and there is one token type.
- Checkpoint names come with or without the task head's prefix (`bert.`, `roberta.`); the
  pretraining pooler (`pooler.dense`) and heads are not used by the embedding models.
- Cross-encoders (`*ForSequenceClassification`: rerankers) add their head over the first token:
  BERT's pooler (dense + tanh) then `classifier`; RoBERTa's `classifier.dense` + tanh then
  `classifier.out_proj`. `classify` returns the logits.
- Token types: BERT numbers the tokens after a pair's first [SEP] as segment 1; with
  `sep_token_id` set (the pooling backend sets it from the tokenizer) they are derived from the
  ids, so a pair `[CLS] query [SEP] document [SEP]` needs nothing else. RoBERTa has one type.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from armserve import kernels
from armserve.layers.linear import Linear, QKVParallelLinear, get_parallel_context
from armserve.quantization import QuantizedTensor


def load_param(model: nn.Module, raw: str, name: str, shard: str | int | None,
               tensor: torch.Tensor | QuantizedTensor) -> None:
    """The encoders' loading of one checkpoint tensor (`raw`, the checkpoint's name) into parameter
    `name` of `model`: a Linear's weight or bias (or its `shard` of a fused projection) through its
    weight_loader, any other parameter copied after a shape check; a ValueError names the tensor."""
    if isinstance(tensor, QuantizedTensor):
        tensor = tensor.dequantize()
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    try:
        if isinstance(module, Linear):
            module.weight_loader(attr, tensor, "all" if shard is None else shard)
        else:
            param = getattr(module, attr)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(tensor)
    except ValueError as e:
        raise ValueError(f"weight {raw} {e}") from None


class EncoderBatch:
    """One step's sequences laid out for attention, built once per step and shared by every layer.

    `attention` runs the encoder-attention kernel over the step's rows as they are; without it, it
    groups the sequences by length: each group is one unmasked
    `scaled_dot_product_attention` over [sequences, heads, length, head_dim], with no padding to
    compute or mask (100 short sentences of 12-30 tokens: 8 ms a layer, against 14 ms for one
    padded, masked grid). `to_grid` / `from_grid` give the padded grid ([num_seqs, longest], key
    mask `mask`, None if all are as long) to models that need a mask of their own (ModernBERT's
    local attention)."""

    def __init__(self, seq_lens: list[int]) -> None:
        self.num_seqs, self.longest = len(seq_lens), max(seq_lens)
        self.seq_lens = seq_lens
        lens = torch.tensor(seq_lens)
        cols = torch.arange(self.longest)
        valid = cols[None, :] < lens[:, None]  # [B, L]
        self.index = valid.reshape(-1).nonzero().squeeze(1)  # grid cell of each token row, in order
        self.mask = None if bool(valid.all()) else valid[:, None, None, :]
        self._groups: list[tuple[int, int, torch.Tensor]] | None = None
        self._lens32 = torch.tensor(seq_lens, dtype=torch.int32)

    def groups(self) -> list[tuple[int, int, torch.Tensor]]:
        """(length, sequences, their token rows in order) per distinct sequence length."""
        if self._groups is None:
            starts = torch.tensor(self.seq_lens).cumsum(0).tolist()
            by_len: dict[int, list[int]] = {}
            for i, n in enumerate(self.seq_lens):
                by_len.setdefault(n, []).append(i)
            self._groups = []
            for n, seqs in by_len.items():
                first = torch.tensor([starts[i] - n for i in seqs])
                rows = (first[:, None] + torch.arange(n)[None, :]).reshape(-1)
                self._groups.append((n, len(seqs), rows))
        return self._groups

    def attention(self, qkv: torch.Tensor, heads: int, head_dim: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Bidirectional attention of each sequence over its own rows: qkv [T, 3 * H * D] (q, k, v
        heads side by side; plus `bias`, the projection's, if given) -> [T, H * D]."""
        T, H, D = qkv.shape[0], heads, head_dim
        if kernels.use_kernel("attention", qkv.dtype, head_dim=D) and D <= 512:
            return kernels.encoder_attention(qkv, self._lens32, H, D, D**-0.5, bias)
        if bias is not None:
            qkv = qkv + bias
        if self.mask is None:  # all as long: the rows are the grid, no copies
            q, k, v = qkv.view(self.num_seqs, self.longest, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
            o = F.scaled_dot_product_attention(q, k, v)  # [B, H, L, D]
            return o.transpose(1, 2).reshape(T, H * D)
        out = qkv.new_empty(T, H * D)
        for n, b, rows in self.groups():
            q, k, v = qkv.index_select(0, rows).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
            o = F.scaled_dot_product_attention(q, k, v)
            out.index_copy_(0, rows, o.transpose(1, 2).reshape(b * n, H * D))
        return out

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[T, C] token rows -> [B, L, C] (padding rows zero: finite, so masked-out keys add 0)."""
        grid = x.new_zeros(self.num_seqs * self.longest, x.shape[1])
        grid.index_copy_(0, self.index, x)
        return grid.view(self.num_seqs, self.longest, x.shape[1])

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """[B, H, L, D] -> [T, H*D] token rows."""
        rows = grid.transpose(1, 2).reshape(self.num_seqs * self.longest, -1)
        return rows.index_select(0, self.index)


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True)
        self.out_proj = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        proj = self.qkv_proj
        o = batch.attention(proj(x, with_bias=False), self.num_heads, self.head_dim, proj.bias)
        return kernels.layer_norm(self.out_proj(o, with_bias=False), self.norm.weight, self.norm.bias, self.norm.eps,
                                  residual=x, x_bias=self.out_proj.bias)


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} for an encoder")
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"
        self.attention = BertSelfAttention(config)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        h = kernels.bias_gelu_(self.up_proj(x, with_bias=False), self.up_proj.bias, self.approximate)
        return kernels.layer_norm(self.down_proj(h, with_bias=False), self.norm.weight, self.norm.bias, self.norm.eps,
                                  residual=x, x_bias=self.down_proj.bias)


# Hugging Face name part (under encoder.layer.N.) -> (this module's name part, qkv shard)
_LAYER_NAMES = {
    "attention.self.query": ("attention.qkv_proj", "q"),
    "attention.self.key": ("attention.qkv_proj", "k"),
    "attention.self.value": ("attention.qkv_proj", "v"),
    "attention.output.dense": ("attention.out_proj", None),
    "attention.output.LayerNorm": ("attention.norm", None),
    "intermediate.dense": ("up_proj", None),
    "output.dense": ("down_proj", None),
    "output.LayerNorm": ("norm", None),
}


class BertModel(nn.Module):
    """A BERT encoder: `forward(input_ids, positions, seq_lens) -> hidden [T, hidden]`, the step's
    sequences back to back (`seq_lens` tokens each)."""

    architectures: tuple[str, ...] = ("BertModel",)
    model_types: tuple[str, ...] = ("bert",)
    gguf_architectures: tuple[str, ...] = ("bert",)
    # llama.cpp's names for a `bert` GGUF (model_loader/gguf.py maps them; no rotary, so no q/k permutation)
    gguf_names = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
                  "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm"}
    gguf_layer_prefix = "encoder.layer"
    gguf_block_names = {"attn_q": "attention.self.query", "attn_k": "attention.self.key",
                        "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
                        "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
                        "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
    gguf_permuted_qk = False
    gguf_norm_offset = 0.0
    is_pooling_model = True
    pooling_task = "embed"  # "classify": a cross-encoder's logits (`classify`)
    default_pooling_type = "CLS"  # vLLM's default for encoders when the checkpoint says nothing
    uses_sep_token = True  # a cross-encoder reads a pair as [CLS] a [SEP] b [SEP] (prompts.encode_pair)
    # positions start here (RoBERTa: after the padding id)
    position_offset_from_pad = False
    prefixes = ("bert.",)

    def __init__(self, config) -> None:
        super().__init__()
        if get_parallel_context().world > 1:
            raise ValueError(f"{type(self).__name__} cannot be split for tensor parallelism: use tensor_parallel_size 1")
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r} is not supported "
                             "(absolute positions only)")
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(1, getattr(config, "type_vocab_size", 1) or 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.position_offset = (config.pad_token_id + 1) if self.position_offset_from_pad else 0
        self.sep_token_id: int | None = None  # token types from the ids (module docstring)
        self.make_head(config)
        for p in self.parameters():
            p.requires_grad_(False)

    @classmethod
    def gguf_config(cls, field: Callable[[str], Any], tensors: Mapping[str, Any], read: Callable[[], Any]):
        """A BertConfig from a `bert` GGUF header (transformers reads none): sizes, layer norm
        epsilon, the token-type count from `token_types`' rows, the vocabulary's length."""
        from transformers import BertConfig

        types = tensors.get("token_types.weight")
        pad = field("tokenizer.ggml.padding_token_id")
        return BertConfig(vocab_size=int(field("tokenizer.ggml.tokens")), hidden_size=int(field("bert.embedding_length")),
                          num_hidden_layers=int(field("bert.block_count")),
                          num_attention_heads=int(field("bert.attention.head_count")),
                          intermediate_size=int(field("bert.feed_forward_length")),
                          max_position_embeddings=int(field("bert.context_length")),
                          layer_norm_eps=float(field("bert.attention.layer_norm_epsilon")),
                          type_vocab_size=1 if types is None else int(types.shape[0]),
                          pad_token_id=0 if pad is None else int(pad), hidden_act="gelu")

    @property
    def max_positions(self) -> int:
        """Tokens a sequence may have: the position table less the offset RoBERTa starts at."""
        return self.config.max_position_embeddings - self.position_offset

    def make_head(self, config) -> None:
        """A task head's layers (the cross-encoders'); none for the embedding models."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None and self.sep_token_id is not None and self.token_type_embeddings.num_embeddings > 1:
            token_type_ids = _segments(input_ids, seq_lens, self.sep_token_id)
        words, one_type = self.word_embeddings(input_ids), None
        if token_type_ids is None:
            one_type = self.token_type_embeddings.weight[0]
        else:
            words = words + self.token_type_embeddings(token_type_ids)
        # (words + type) + positions, as transformers adds them, and the norm in one pass
        norm = self.embed_norm
        x = kernels.layer_norm(words, norm.weight, norm.bias, norm.eps, residual=pos, x_bias=one_type)
        batch = EncoderBatch(seq_lens)
        for layer in self.layers:
            x = layer(x, batch)
        return x

    # ---- weights ---------------------------------------------------------------------------

    def _own_name(self, name: str) -> tuple[str, Any] | None:
        """(this module's parameter name, qkv shard) of a checkpoint name; None: not used here."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if name.startswith("embeddings."):
            rest = name[len("embeddings."):]
            if rest.startswith("LayerNorm."):
                return "embed_norm." + rest[len("LayerNorm."):], None
            return (rest, None) if rest.split(".")[0] in (
                "word_embeddings", "position_embeddings", "token_type_embeddings") else None
        if not name.startswith("encoder.layer."):
            return None  # pooler, task heads, position_ids buffers
        _, _, idx, rest = name.split(".", 3)
        part, _, attr = rest.rpartition(".")
        part, shard = _LAYER_NAMES.get(part, (None, None))
        if part is None:
            return None
        return f"layers.{idx}.{part}.{attr}", shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        """Fill the parameters from Hugging Face tensors; returns the names filled (`name#shard`
        for the q/k/v shards of the fused projection)."""
        loaded: set[str] = set()
        for raw, tensor in weights:
            own = self._own_name(raw)
            if own is None:
                continue
            name, shard = own
            load_param(self, raw, name, shard, tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        out: set[str] = set()
        for name, _ in self.named_parameters():
            out |= {f"{name}#{s}" for s in "qkv"} if ".qkv_proj." in name else {name}
        return out

    def process_weights_after_loading(self) -> None:
        """Prepack the linear layers for the dense GEMM kernel, once."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()


def _segments(ids: torch.Tensor, seq_lens: list[int], sep: int) -> torch.Tensor:
    """Token type of each row: 1 after its sequence's first [SEP], else 0."""
    is_sep = (ids == sep).long()
    seps_before = is_sep.cumsum(0) - is_sep  # [SEP]s before each row, over the whole step
    lens = torch.tensor(seq_lens)
    starts = (lens.cumsum(0) - lens).repeat_interleave(lens)
    start_count = seps_before[starts]  # ... and before each row's sequence
    return (seps_before - start_count > 0).long()


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder (reranker): CLS -> pooler dense + tanh -> classifier logits."""

    architectures = ("BertForSequenceClassification",)
    gguf_architectures = ()
    model_types = ()
    pooling_task = "classify"
    # head checkpoint names (after the prefix) -> this module's
    head_names = {"pooler.dense": "head_dense", "classifier": "classifier"}
    # a reranker GGUF's head (model_loader/gguf.py rank_config): llama.cpp's `cls` (dense + tanh,
    # absent when its converter dropped BERT's pooler) and `cls.output`
    gguf_names = {**BertModel.gguf_names, "cls": "pooler.dense", "cls.output": "classifier"}

    def make_head(self, config) -> None:
        h = config.hidden_size
        self.head_dense = Linear(h, h, bias=True) if getattr(config, "classifier_pooler", True) else None
        self.classifier = Linear(h, config.num_labels, bias=True)

    def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """float32 logits [num_seqs, num_labels] from each sequence's first row."""
        lens = torch.tensor(seq_lens)
        first = hidden[lens.cumsum(0) - lens]
        if self.head_dense is not None:
            first = torch.tanh(self.head_dense(first))
        return self.classifier(first).float()

    def _own_name(self, name: str) -> tuple[str, Any] | None:
        bare = name
        for prefix in self.prefixes:
            if bare.startswith(prefix):
                bare = bare[len(prefix):]
                break
        part, _, attr = bare.rpartition(".")
        if part in self.head_names:
            return f"{self.head_names[part]}.{attr}", None
        return super()._own_name(name)


class RobertaModel(BertModel):
    """RoBERTa: BERT's blocks, positions numbered from `pad_token_id + 1`."""

    architectures = ("RobertaModel",)
    gguf_architectures = ()
    model_types = ("roberta",)
    position_offset_from_pad = True
    prefixes = ("roberta.",)


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa (multilingual-e5, bge-m3's encoder): RoBERTa's layout."""

    architectures = ("XLMRobertaModel",)
    gguf_architectures = ()
    model_types = ("xlm-roberta",)


class RobertaForSequenceClassification(RobertaModel, BertForSequenceClassification):
    """A RoBERTa cross-encoder: classifier.dense + tanh -> classifier.out_proj."""

    architectures = ("RobertaForSequenceClassification",)
    gguf_architectures = ()
    model_types = ()
    head_names = {"classifier.dense": "head_dense", "classifier.out_proj": "classifier"}


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """An XLM-RoBERTa cross-encoder (bge-reranker-base/large, mxbai-rerank)."""

    architectures = ("XLMRobertaForSequenceClassification",)
    gguf_architectures = ()


MODELS = (BertModel, RobertaModel, XLMRobertaModel, BertForSequenceClassification,
          RobertaForSequenceClassification, XLMRobertaForSequenceClassification)
