"""Gemma 3 (text): the Llama decoder's parts arranged Gemma's way.

- the embedding output scaled by sqrt(hidden_size), rounded to the model dtype first as
  transformers does (bfloat16: sqrt(640) = 25.30 becomes 25.25);
- RMSNorms with (1 + w) weights, four per layer: before and after attention, before and after the
  MLP (the "after" ones on the sublayer's output, before it joins the residual stream);
- per-head q/k RMSNorms (also 1 + w) before RoPE; attention scaled by query_pre_attn_scalar^-1/2;
- GELU-tanh gated MLP;
- sliding-window (local) layers interleaved with global ones (`layer_types`), each kind with its
  own RoPE base (`rope_parameters[layer_type]`, or the older rope_local_base_freq / rope_theta).
"""

from __future__ import annotations

import torch
from torch import nn

from armserve import kernels
from armserve.layers.layernorm import RMSNorm
from armserve.layers.rotary_embedding import rope_parameters
from armserve.layers.linear import VocabEmbedding
from armserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, layer_sliding_windows


def _layer_rope(config, layer_type: str) -> dict:
    params = getattr(config, "rope_parameters", None)
    per_type = isinstance(params, dict) and isinstance(params.get(layer_type), dict)
    if layer_type == "sliding_attention" and not per_type:  # older configs: local layers on their own base
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return rope_parameters(config, layer_type)


class ScaledEmbedding(VocabEmbedding):
    """Token embeddings times sqrt(hidden_size) (as a value of the table's dtype)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        # float32 [hidden]: the normalizer as a value of the table's dtype, per column (mul_cols)
        s = float(torch.tensor(hidden_size**0.5, dtype=self.weight.dtype))
        self._scale = torch.full((hidden_size,), s, dtype=torch.float32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        if kernels.use_kernel("small", x) and x.dim() == 2:
            return kernels.mul_cols(x, self._scale)  # recordable: decode steps stay replayable
        return x * self._scale[0].to(x.dtype)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_type: str, sliding_window: int | None) -> None:
        super().__init__()
        eps, h = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.self_attn = LlamaAttention(
            config, sliding_window, bool(getattr(config, "attention_bias", False)), qk_norm=True, norm_offset=1.0,
            rope=_layer_rope(config, layer_type), scale=config.query_pre_attn_scalar**-0.5,
        )
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.mlp = LlamaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of each sublayer is fused into the next norm (RMSNorm(x, residual)).
        x, residual = self.input_layernorm.start_or_add(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model (`Gemma3ForCausalLM`, model_type gemma3_text); weight names as Llama's
    plus the extra norms, so the Llama loader fills it."""

    architectures, model_types, gguf_architectures = ("Gemma3ForCausalLM",), ("gemma3", "gemma3_text"), ("gemma3",)
    gguf_block_names = {
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    gguf_permuted_qk = False
    gguf_norm_offset = 1.0  # llama.cpp's converter stores Gemma's norm weights as 1 + w

    def __init__(self, config) -> None:
        super().__init__(config)
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=1.0)
        if getattr(config, "final_logit_softcapping", None):
            raise ValueError("Gemma 3 with final_logit_softcapping is not supported")
        if getattr(config, "attn_logit_softcapping", None):
            for layer in self.layers:
                layer.self_attn.attn.logit_softcap = config.attn_logit_softcapping

    def make_layers(self, config) -> nn.ModuleList:
        windows = layer_sliding_windows(config)
        types = getattr(config, "layer_types", None) or [
            "sliding_attention" if w else "full_attention" for w in windows
        ]
        return nn.ModuleList(
            Gemma3DecoderLayer(config, types[i], windows[i]) for i in range(config.num_hidden_layers)
        )


MODELS = (Gemma3ForCausalLM,)
