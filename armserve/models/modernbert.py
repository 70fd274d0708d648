"""ModernBERT (`ModernBertModel`: gte-modernbert, modernbert-embed, ...): a bidirectional encoder
with rotary positions, GeGLU MLPs, pre-LayerNorm blocks (the first block's attention norm is the
embeddings' own), no biases by default, and attention alternating between global layers and local
ones that see tokens within `local_attention // 2` of each other (`layer_types`, or every
`global_attn_every_n_layers`-th layer global). Each kind of layer has its own rotary base.

Run by the pooling runner like models/bert.py (whose step layout, `EncoderBatch`, it shares):
every sequence whole in one step; global layers (and local ones whose window reaches every key of
the step) use `EncoderBatch.attention`, local ones `scaled_dot_product_attention` over the step's
sequences padded to the longest, with a key mask and a band mask.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from armserve.layers.linear import Linear, get_parallel_context
from armserve.layers.pooler import pool
from armserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from armserve.models.bert import EncoderBatch, load_param
from armserve.quantization import QuantizedTensor

_APPROXIMATE = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class _Batch(EncoderBatch):
    """The step's layout plus each local window's mask, built once and shared by the layers."""

    def __init__(self, seq_lens: list[int]) -> None:
        super().__init__(seq_lens)
        self._bands: dict[int, torch.Tensor] = {}
        lens = torch.tensor(seq_lens)
        self.valid = torch.arange(self.longest)[None, :] < lens[:, None]  # [B, L]

    def attn_mask(self, window: int | None) -> torch.Tensor | None:
        """None (all keys), or a boolean mask [B or 1, 1, L, L]: keys inside the sequence (`mask`,
        EncoderBatch's) and within `window` of the query. A padding query row may see every key:
        its output is dropped."""
        if window is None:
            return self.mask
        if window not in self._bands:
            pos = torch.arange(self.longest)
            band = ((pos[:, None] - pos[None, :]).abs() <= window)[None, None]  # [1, 1, L, L]
            if self.mask is not None:
                band = (band & self.mask) | ~self.valid[:, None, :, None]
            self._bands[window] = band
        return self._bands[window]


class ModernBertLayer(nn.Module):
    def __init__(self, config, i: int) -> None:
        super().__init__()
        h, eps, norm_bias = config.hidden_size, config.norm_eps, config.norm_bias
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        kind = config.layer_types[i]
        self.window = config.local_attention // 2 if kind == "sliding_attention" else None
        # layer 0 reads the embeddings' norm directly (transformers: an Identity)
        self.attn_norm = nn.LayerNorm(h, eps=eps, bias=norm_bias) if i else nn.Identity()
        self.Wqkv = Linear(h, 3 * h, bias=config.attention_bias)
        self.Wo = Linear(h, h, bias=config.attention_bias)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_parameters(config, kind))
        self.mlp_norm = nn.LayerNorm(h, eps=eps, bias=norm_bias)
        self.Wi = Linear(h, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.Wo_mlp = Linear(config.intermediate_size, h, bias=config.mlp_bias)
        self.approximate = _APPROXIMATE[config.hidden_activation]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: _Batch) -> torch.Tensor:
        H, D = self.num_heads, self.head_dim
        qkv = self.Wqkv(self.attn_norm(x))
        q, k, _ = qkv.split(H * D, dim=-1)
        self.rotary(positions, q, k)  # in place on the views of qkv
        if self.window is None or batch.longest - 1 <= self.window:  # every key in reach: no band
            o = batch.attention(qkv, H, D)
        else:
            grid = batch.to_grid(qkv).view(batch.num_seqs, batch.longest, 3, H, D).permute(2, 0, 3, 1, 4)
            o = batch.from_grid(F.scaled_dot_product_attention(*grid.unbind(0), attn_mask=batch.attn_mask(self.window)))
        x = x + self.Wo(o)
        a, gate = self.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.Wo_mlp(F.gelu(a, approximate=self.approximate) * gate)


class ModernBertModel(nn.Module):
    """A ModernBERT encoder: `forward(input_ids, positions, seq_lens) -> hidden [T, hidden]` (the
    final norm's output), the step's sequences back to back."""

    architectures = ("ModernBertModel",)
    model_types = ("modernbert",)
    gguf_architectures: tuple[str, ...] = ()
    is_pooling_model = True
    pooling_task = "embed"
    default_pooling_type = "CLS"
    position_offset_from_pad = False
    uses_sep_token = True

    def __init__(self, config) -> None:
        super().__init__()
        if get_parallel_context().world > 1:
            raise ValueError("ModernBertModel cannot be split for tensor parallelism: use tensor_parallel_size 1")
        if config.hidden_activation not in _APPROXIMATE:
            raise ValueError(f"unsupported hidden_activation {config.hidden_activation!r} for ModernBERT")
        self.config = config
        h = config.hidden_size
        self.tok_embeddings = nn.Embedding(config.vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.norm_eps, bias=config.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = nn.LayerNorm(h, eps=config.norm_eps, bias=config.norm_bias)
        self.sep_token_id: int | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_norm(self.tok_embeddings(input_ids))
        batch = _Batch(seq_lens)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return self.final_norm(x)

    # ---- weights ---------------------------------------------------------------------------

    def _own_name(self, name: str) -> str | None:
        """This module's name of a checkpoint tensor; None for the task heads."""
        name = name.removeprefix("model.")
        if name.startswith("embeddings."):
            return name.replace("embeddings.tok_embeddings.", "tok_embeddings.").replace("embeddings.norm.",
                                                                                        "embed_norm.")
        if name.startswith("layers."):
            return name.replace(".attn.Wqkv.", ".Wqkv.").replace(".attn.Wo.", ".Wo.").replace(
                ".mlp.Wi.", ".Wi.").replace(".mlp.Wo.", ".Wo_mlp.")
        return name if name.startswith("final_norm.") else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw, tensor in weights:
            name = self._own_name(raw)
            if name is None or name not in params:
                continue
            load_param(self, raw, name, None, tensor)
            loaded.add(name)
        return loaded

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}

    def process_weights_after_loading(self) -> None:
        """Prepack the linear layers for the dense GEMM kernel, once."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()


class ModernBertForSequenceClassification(ModernBertModel):
    """A ModernBERT cross-encoder (gte-reranker-modernbert): the first token's row, or the mean of
    the rows (`classifier_pooling`), through the head (dense, activation, LayerNorm) and
    `classifier`. `classify` returns the logits."""

    architectures = ("ModernBertForSequenceClassification",)
    model_types = ()
    pooling_task = "classify"
    # head checkpoint names -> this module's
    head_names = {"head.dense.": "head_dense.", "head.norm.": "head_norm.", "classifier.": "classifier."}

    def __init__(self, config) -> None:
        super().__init__(config)
        if config.classifier_pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling {config.classifier_pooling!r} is not supported (cls or mean)")
        if config.classifier_activation not in _APPROXIMATE:
            raise ValueError(f"unsupported classifier_activation {config.classifier_activation!r}")
        h = config.hidden_size
        self.head_dense = Linear(h, h, bias=config.classifier_bias)
        self.head_norm = nn.LayerNorm(h, eps=config.norm_eps, bias=config.norm_bias)
        self.classifier = Linear(h, config.num_labels, bias=True)
        for p in self.parameters():
            p.requires_grad_(False)

    def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """float32 logits [num_seqs, num_labels]."""
        pooled = pool(hidden, seq_lens, "CLS" if self.config.classifier_pooling == "cls" else "MEAN")
        x = F.gelu(self.head_dense(pooled.to(hidden.dtype)), approximate=_APPROXIMATE[self.config.classifier_activation])
        return self.classifier(self.head_norm(x)).float()

    def _own_name(self, name: str) -> str | None:
        for prefix, own in self.head_names.items():
            if name.startswith(prefix):
                return own + name[len(prefix):]
        return super()._own_name(name)


MODELS = (ModernBertModel, ModernBertForSequenceClassification)
