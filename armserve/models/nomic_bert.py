"""NomicBert (`NomicBertModel`: nomic-embed-text-v1 / v1.5): BERT's post-LayerNorm blocks with
rotary positions instead of a position table, SwiGLU MLPs and no biases in the linear layers.

Run by the pooling runner like models/bert.py (whose step layout, `EncoderBatch`, it shares):
every sequence whole in one step, bidirectional attention over its own rows.

Checkpoints come in two spellings, both read here:
- transformers' own (`model_type` nomic_bert): `hidden_size`, `num_attention_heads`,
  `num_hidden_layers`, `intermediate_size`, `layer_norm_eps`, `rope_parameters`, `hidden_act`
  "silu"; weights `layers.N.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`,
  `post_attention_layernorm`, `post_mlp_layernorm`, `embeddings.LayerNorm`.
- nomic's original remote code (the published nomic-embed checkpoints): `n_embd`, `n_head`,
  `n_layer`, `n_inner`, `layer_norm_epsilon`, `rotary_emb_base`, `rotary_emb_fraction`,
  `rotary_emb_interleaved`, `activation_function` "swiglu"; weights `encoder.layers.N.attn.Wqkv`
  (q, k, v stacked), `attn.out_proj`, `mlp.fc11` (up), `mlp.fc12` (gate), `mlp.fc2`, `norm1`,
  `norm2`, `emb_ln` (transformers renames them the same way on load, conversion_mapping.py).
Pre-norm blocks, biases and other activations (options of the remote code no released checkpoint
uses) are refused at load.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from armserve import kernels
from armserve.layers.linear import ColumnParallelLinear, Linear, get_parallel_context
from armserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from armserve.models.bert import EncoderBatch, load_param
from armserve.quantization import QuantizedTensor


@dataclass(frozen=True, slots=True)
class _Shape:
    """A NomicBert config in one spelling (the module docstring's two)."""

    hidden: int
    heads: int
    layers: int
    inter: int
    eps: float
    max_positions: int
    rope: dict
    rotary_dim: int
    neox: bool

    @classmethod
    def of(cls, config) -> _Shape:
        get = lambda *names, default=None: next(  # noqa: E731
            (getattr(config, n) for n in names if getattr(config, n, None) is not None), default)
        if getattr(config, "prenorm", False):
            raise ValueError("NomicBert with prenorm blocks is not supported (post-norm only)")
        for flag in ("qkv_proj_bias", "mlp_fc1_bias", "mlp_fc2_bias"):
            if getattr(config, flag, False):
                raise ValueError(f"NomicBert with {flag} is not supported (no biases)")
        act = get("activation_function", "hidden_act", default="silu")
        if act not in ("swiglu", "silu"):
            raise ValueError(f"unsupported NomicBert activation {act!r} (SwiGLU only)")
        hidden, heads = int(get("n_embd", "hidden_size")), int(get("n_head", "num_attention_heads"))
        head_dim = hidden // heads
        if getattr(config, "rotary_emb_base", None) is not None:  # the remote code's keys
            rope = {"rope_type": "default", "rope_theta": float(config.rotary_emb_base)}
            if getattr(config, "rotary_scaling_factor", None):
                raise ValueError("NomicBert's rotary_scaling_factor (dynamic NTK) is not supported")
        else:
            rope = rope_parameters(config)
        return cls(hidden=hidden, heads=heads, layers=int(get("n_layer", "num_hidden_layers")),
                   inter=int(get("n_inner", "intermediate_size", default=4 * hidden)),
                   eps=float(get("layer_norm_epsilon", "layer_norm_eps", default=1e-12)),
                   max_positions=int(get("n_positions", "max_position_embeddings", default=2048)), rope=rope,
                   rotary_dim=int(head_dim * float(get("rotary_emb_fraction", default=1.0))),
                   neox=not getattr(config, "rotary_emb_interleaved", False))


class NomicBertLayer(nn.Module):
    def __init__(self, s: _Shape) -> None:
        super().__init__()
        self.num_heads, self.head_dim = s.heads, s.hidden // s.heads
        self.qkv_proj = ColumnParallelLinear(s.hidden, [s.hidden] * 3)  # shards q, k, v
        self.o_proj = Linear(s.hidden, s.hidden)
        self.attn_norm = nn.LayerNorm(s.hidden, eps=s.eps)
        self.gate_up_proj = ColumnParallelLinear(s.hidden, [s.inter, s.inter])  # shards gate, up
        self.down_proj = Linear(s.inter, s.hidden)
        self.mlp_norm = nn.LayerNorm(s.hidden, eps=s.eps)
        self.rotary = RotaryEmbedding(self.head_dim, s.max_positions, s.rope, s.rotary_dim, s.neox)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        H, D = self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q, k, _ = qkv.split(H * D, dim=-1)
        self.rotary(positions, q, k)  # in place on the views of qkv
        o = batch.attention(qkv, H, D)
        x = kernels.layer_norm(self.o_proj(o), self.attn_norm.weight, self.attn_norm.bias, self.attn_norm.eps,
                               residual=x)
        h = kernels.act_and_mul(self.gate_up_proj(x), "silu")
        return kernels.layer_norm(self.down_proj(h), self.mlp_norm.weight, self.mlp_norm.bias, self.mlp_norm.eps,
                                  residual=x)


# checkpoint layer name part -> (this module's, shard); both spellings
_LAYER_NAMES = {
    "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1), "self_attn.v_proj": ("qkv_proj", 2),
    "attn.Wqkv": ("qkv_proj", "stacked"), "self_attn.o_proj": ("o_proj", None), "attn.out_proj": ("o_proj", None),
    "post_attention_layernorm": ("attn_norm", None), "norm1": ("attn_norm", None),
    "mlp.gate_proj": ("gate_up_proj", 0), "mlp.fc12": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1), "mlp.fc11": ("gate_up_proj", 1),
    "mlp.down_proj": ("down_proj", None), "mlp.fc2": ("down_proj", None),
    "post_mlp_layernorm": ("mlp_norm", None), "norm2": ("mlp_norm", None),
}
_LAYER = re.compile(r"^(?:encoder\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")


class NomicBertModel(nn.Module):
    """A NomicBert encoder: `forward(input_ids, positions, seq_lens) -> hidden [T, hidden]`, the
    step's sequences back to back."""

    architectures = ("NomicBertModel",)
    model_types = ("nomic_bert",)
    gguf_architectures: tuple[str, ...] = ()
    is_pooling_model = True
    pooling_task = "embed"
    default_pooling_type = "CLS"  # vLLM's default for encoders; nomic-embed's own files say MEAN
    position_offset_from_pad = False
    uses_sep_token = True

    def __init__(self, config) -> None:
        super().__init__()
        if get_parallel_context().world > 1:
            raise ValueError("NomicBertModel cannot be split for tensor parallelism: use tensor_parallel_size 1")
        self.config = config
        s = self.shape = _Shape.of(config)
        self.word_embeddings = nn.Embedding(int(config.vocab_size), s.hidden)
        self.token_type_embeddings = nn.Embedding(max(1, int(getattr(config, "type_vocab_size", 1) or 1)), s.hidden)
        self.embed_norm = nn.LayerNorm(s.hidden, eps=s.eps)
        self.layers = nn.ModuleList(NomicBertLayer(s) for _ in range(s.layers))
        self.sep_token_id: int | None = None
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def max_positions(self) -> int:
        """Tokens a sequence may have: the rotary table's length."""
        return self.shape.max_positions

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        words = self.word_embeddings(input_ids)
        types = None if token_type_ids is None else self.token_type_embeddings(token_type_ids)
        norm = self.embed_norm
        if types is None:  # every token of type 0, as transformers and the remote code default to
            x = kernels.layer_norm(words, norm.weight, norm.bias, norm.eps, x_bias=self.token_type_embeddings.weight[0])
        else:
            x = kernels.layer_norm(words, norm.weight, norm.bias, norm.eps, residual=types)
        batch = EncoderBatch(seq_lens)
        for layer in self.layers:
            x = layer(x, positions, batch)
        return x

    # ---- weights ---------------------------------------------------------------------------

    def _own_name(self, name: str) -> tuple[str, object] | None:
        """(this module's parameter name, shard) of a checkpoint name; None: not used here."""
        name = name.removeprefix("model.").removeprefix("nomic_bert.").removeprefix("bert.")
        for theirs, ours in (("embeddings.word_embeddings.", "word_embeddings."),
                             ("embeddings.token_type_embeddings.", "token_type_embeddings."),
                             ("embeddings.LayerNorm.", "embed_norm."), ("emb_ln.", "embed_norm.")):
            if name.startswith(theirs):
                return ours + name[len(theirs):], None
        m = _LAYER.match(name)
        if m is None or m.group(2) not in _LAYER_NAMES:
            return None  # pooler, heads, rotary buffers
        part, shard = _LAYER_NAMES[m.group(2)]
        return f"layers.{m.group(1)}.{part}.{m.group(3)}", shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        """Fill the parameters from either spelling's tensors; returns the names filled
        (`name#shard` for the shards of the fused projections)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for raw, tensor in weights:
            own = self._own_name(raw)
            if own is None:
                continue
            name, shard = own
            if name not in params:
                raise ValueError(f"weight {raw}: {name} is not a parameter here (NomicBert has no biases)")
            if shard == "stacked":  # the remote code's Wqkv: q, k, v stacked by rows
                if isinstance(tensor, QuantizedTensor):
                    tensor = tensor.dequantize()
                if tensor.shape[0] % 3:
                    raise ValueError(f"weight {raw} has shape {tuple(tensor.shape)}, not three stacked projections")
                for i, part in enumerate(tensor.chunk(3, dim=0)):
                    load_param(self, raw, name, i, part)
                    loaded.add(f"{name}#{i}")
                continue
            load_param(self, raw, name, shard, tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        return loaded

    def expected_weights(self) -> set[str]:
        out: set[str] = set()
        for name, _ in self.named_parameters():
            if ".qkv_proj." in name:
                out |= {f"{name}#{i}" for i in range(3)}
            elif ".gate_up_proj." in name:
                out |= {f"{name}#{i}" for i in range(2)}
            else:
                out.add(name)
        return out

    def process_weights_after_loading(self) -> None:
        """Prepack the linear layers for the dense GEMM kernel, once."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.finalize()


MODELS = (NomicBertModel,)
