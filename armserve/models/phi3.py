"""Phi-3 and Phi-4 (`Phi3ForCausalLM`: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini): the
Llama decoder, with fused projections in the checkpoint and its own RoPE.

- The checkpoint holds q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (llama.cpp:
  `attn_qkv`, and `ffn_up` with gate and up in it); they are split into the q/k/v and gate/up
  tensors Llama's loader fills, so the layers are Llama's.
- RoPE turns the first `partial_rotary_factor` of each head (Phi-4-mini: 3/4). `longrope`
  (128k Phi-3, Phi-3.5-mini, Phi-4-mini) divides each frequency by a per-dimension factor and
  scales cos and sin by the attention factor (`attention_factor`, else
  sqrt(1 + ln(max / original) / ln(original))).
  NOTE: one set of factors for every position, so that cached keys and later queries turn
  alike: the long ones when the model's context (max_position_embeddings) is longer than
  original_max_position_embeddings, else the short ones (vLLM's choice at its default
  max_model_len). transformers picks them by the sequence's length (short within the original
  context) and recomputes the whole cache when a sequence grows past it: the two agree on a
  prompt longer than the original context, not on shorter ones.
- Sliding-window attention where the config has one (Phi-3-mini-4k: 2047), as transformers.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from armserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from armserve.models.llama import LlamaForCausalLM
from armserve.quantization import QuantizedTensor


def _rotary(config) -> RotaryEmbedding:
    """Phi-3's RoPE: partial rotary width; default, or longrope with its own table."""
    params = rope_parameters(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
    rotary_dim = int(head_dim * partial)
    max_position = config.max_position_embeddings
    if params["rope_type"] != "longrope":
        return RotaryEmbedding(head_dim, max_position, params, rotary_dim)
    rope = RotaryEmbedding(head_dim, 1, {"rope_type": "default", "rope_theta": params["rope_theta"]}, rotary_dim)
    rope.cos_sin = _longrope_cos_sin(rotary_dim, max_position, params, config)
    return rope


def _longrope_cos_sin(rotary_dim: int, max_position: int, params: dict, config) -> torch.Tensor:
    """[max_position, rotary_dim] float32 cos | sin of longrope (transformers'
    _compute_longrope_parameters), the long factors where the context is longer than the
    original one (module docstring)."""
    original = int(params.get("original_max_position_embeddings")
                   or getattr(config, "original_max_position_embeddings", None) or max_position)
    factor = params.get("factor") or max_position / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = params["long_factor"] if max_position > original else params["short_factor"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * float(params["rope_theta"]) ** exponents)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: Llama's layers, Phi-3's RoPE, fused projections split at load."""

    architectures, model_types, gguf_architectures = ("Phi3ForCausalLM",), ("phi3",), ("phi3",)
    gguf_block_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
    gguf_permuted_qk = False

    @classmethod
    def gguf_config(cls, field: Callable[[str], Any], tensors: Mapping[str, Any], read: Callable[[], Any]):
        """transformers' reading of a `phi3` header plus what it leaves out: the rotary width
        (`rope.dimension_count`), LongRoPE (the tensors rope_factors_long/short and
        `rope.scaling.*`) and the sliding window (0: none)."""
        config = read()
        params = rope_parameters(config)
        head_dim = config.hidden_size // config.num_attention_heads
        params["partial_rotary_factor"] = (field("phi3.rope.dimension_count") or head_dim) / head_dim
        original = field("phi3.rope.scaling.original_context_length")
        if original:
            config.original_max_position_embeddings = int(original)
        long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
        if long is not None and short is not None:
            params.update(rope_type="longrope", long_factor=[float(x) for x in long],
                          short_factor=[float(x) for x in short],
                          original_max_position_embeddings=config.original_max_position_embeddings)
            attention = field("phi3.rope.scaling.attn_factor")
            if attention:
                params["attention_factor"] = float(attention)
        config.rope_parameters = params
        config.sliding_window = field("phi3.attention.sliding_window") or None
        return config

    def __init__(self, config) -> None:
        super().__init__(config)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self._qkv_rows = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

    def make_layers(self, config) -> nn.ModuleList:
        # NOTE: LlamaAttention builds its RoPE from the config, and RotaryEmbedding knows neither
        # longrope nor a partial width: the layers are built from a copy with plain RoPE over one
        # position, then all of them share Phi-3's (one table: 128k positions are 50 MB).
        plain = copy.copy(config)
        plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        plain.max_position_embeddings = 1
        layers = super().make_layers(plain)
        rope = _rotary(config)
        for layer in layers:
            layer.self_attn.rotary_emb = rope
        return layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
                     ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """qkv_proj as q_proj/k_proj/v_proj and gate_up_proj as gate_proj/up_proj (gate first)."""
        for name, t in weights:
            if ".qkv_proj." in name:
                parts, sizes = ("q_proj", "k_proj", "v_proj"), self._qkv_rows
                fused = ".qkv_proj."
            elif ".gate_up_proj." in name:
                parts, sizes = ("gate_proj", "up_proj"), [t.shape[0] // 2] * 2
                fused = ".gate_up_proj."
            else:
                yield name, t
                continue
            for part, piece in zip(parts, t.split(sizes)):  # a weight or bias, float or quantized
                yield name.replace(fused, f".{part}."), piece


MODELS = (Phi3ForCausalLM,)
