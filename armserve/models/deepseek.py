"""DeepSeek-V2 and DeepSeek-V3: Multi-head Latent Attention and DeepSeekMoE.

- attention (layers/mla.py): q from `q_proj`, or through a low-rank `q_a_proj` -> RMSNorm ->
  `q_b_proj` (q_lora_rank); keys and values compressed by `kv_a_proj_with_mqa` into a latent of
  kv_lora_rank (RMSNorm'd) plus one rotary key part of qk_rope_head_dim shared by the heads; the
  cache holds those two only, and `kv_b_proj` is split into the up-projections absorbed into the
  query and the output;
- RoPE only on the qk_rope_head_dim part, on interleaved pairs (x0, x1), (x2, x3), ... (V2, and
  V3's `rope_interleave`), else on halves; YaRN scaling where the config has it, its mscale
  folded into the softmax scale as transformers does;
- MLP: dense in the first `first_k_dense_replace` layers, then routed experts of
  moe_intermediate_size plus `n_shared_experts` shared ones always on (one MLP of
  n_shared * moe_intermediate_size). Routing: V2 softmax top-k (group-limited greedy with
  `topk_method`), weights not renormalised (transformers' V2 ignores norm_topk_prob); V3 sigmoid
  scores plus e_score_correction_bias for the choice, grouped top-k (n_group/topk_group),
  renormalised with norm_topk_prob; both times routed_scaling_factor.

Checkpoint names are transformers' (`self_attn.{q_proj, q_a_proj, ...}`, `mlp.experts.E.*`,
`mlp.shared_experts.*`, `mlp.gate.{weight, e_score_correction_bias}`); GGUF names (llama.cpp's
`deepseek2`) map onto them in `gguf_block_names`, and the split `attn_k_b`/`attn_v_b` of newer
files are joined back into kv_b_proj in `load_weights`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from armserve.layers.fused_moe import fused_experts, select_experts
from armserve.layers.layernorm import RMSNorm
from armserve.layers.linear import Linear
from armserve.layers.mla import MLAAttention
from armserve.layers.rotary_embedding import RotaryEmbedding, rope_parameters, yarn_mscale
from armserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from armserve.models.moe import SparseMoeBlock
from armserve.quantization import QuantizedTensor


class DeepseekAttention(nn.Module):
    """The projections around MLA: q (full or low-rank), the compressed kv, RoPE, o_proj."""

    def __init__(self, config, rope_interleave: bool) -> None:
        super().__init__()
        h, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank, self.rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        self.nope_dim, self.v_dim = config.qk_nope_head_dim, config.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = Linear(h, H * qk_dim)
        else:
            self.q_a_proj = Linear(h, self.q_lora_rank, bias=bias)
            # NOTE: transformers builds both latent norms with the default eps, not rms_norm_eps
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(self.q_lora_rank, H * qk_dim)
        self.kv_a_proj_with_mqa = Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        # Loaded, then split into MLA's up-projections and dropped (process_weights_after_loading).
        self.kv_b_proj: Linear | None = Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(H * self.v_dim, h, bias=bias)
        rope = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, config.max_position_embeddings, rope,
                                          is_neox_style=not rope_interleave)
        scale = qk_dim**-0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
        self.attn = MLAAttention(H, self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim, scale)

    def absorb_kv_b(self) -> None:
        """Hand kv_b_proj's weight to MLA as its up-projections (before Linear layers are packed)."""
        w = self.kv_b_proj.weight.data
        self.attn.set_kv_b(w)
        self.kv_b_proj = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(T, H * self.rope_dim), k_pe.contiguous())
        return self.o_proj(self.attn(q_nope, q_pe.view(T, H, self.rope_dim), latent, k_pe))


class DeepseekMoE(SparseMoeBlock):
    """Routed experts (SparseMoeBlock's router and experts) plus always-on shared experts, with
    DeepSeek's routing (module docstring)."""

    def __init__(self, config, v3: bool) -> None:
        super().__init__(config, config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                         bool(getattr(config, "norm_topk_prob", False)) and v3)
        self.scoring = "sigmoid" if v3 else "softmax"
        if not v3 and getattr(config, "topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {config.topk_method!r} is not supported")
        grouped = v3 or getattr(config, "topk_method", "greedy") == "group_limited_greedy"
        self.num_groups = (config.n_group or 1) if grouped else 1
        self.topk_groups = (config.topk_group or 1) if grouped else 1
        self.routed_scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        # float32 whatever the model dtype: it decides between close scores
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False)
            if v3 else None)
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        self.shared_experts = LlamaMLP(config, config.moe_intermediate_size * n_shared) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(
            self.gate(x, torch.float32), self.top_k, self.norm_topk_prob, scoring=self.scoring,
            correction_bias=self.e_score_correction_bias, num_groups=self.num_groups,
            topk_groups=self.topk_groups, routed_scale=self.routed_scale)
        out = fused_experts(x, weights, ids, self.experts)
        if self.shared_experts is not None:
            out += self.shared_experts(x).float()
        return out.to(x.dtype)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite): MLA, softmax routing, shared experts, dense first layers."""

    # (transformers reads no `deepseek2` GGUF header: gguf_config builds V2's or V3's config)
    architectures, model_types, gguf_architectures = ("DeepseekV2ForCausalLM",), ("deepseek_v2",), ("deepseek2",)
    v3 = False
    # only the MLPs fuse projections; MLA's q_proj is its own
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    gguf_permuted_qk = False  # llama.cpp rotates DeepSeek's interleaved pairs as they are
    gguf_block_names = {
        "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
        "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.exp_probs_b",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    }
    supports_tp = False  # Multi-head Latent Attention's shared latent cache is not split over ranks

    @classmethod
    def gguf_config(cls, field: Callable[[str], Any], tensors: Mapping[str, Any], read: Callable[[], Any]):
        return config_from_gguf(field, tensors)

    def make_layers(self, config) -> nn.ModuleList:
        interleave = bool(getattr(config, "rope_interleave", True))  # V2 has no flag: always interleaved
        return nn.ModuleList(LlamaDecoderLayer(config, DeepseekAttention(config, interleave), self.make_mlp(config, i))
                             for i in range(config.num_hidden_layers))

    def make_mlp(self, config, i: int) -> nn.Module:
        sparse = config.n_routed_experts and i >= (getattr(config, "first_k_dense_replace", 0) or 0)
        return DeepseekMoE(config, self.v3) if sparse else LlamaMLP(config)

    def _checkpoint_name(self, name: str) -> str:
        name = super()._checkpoint_name(name)
        # the router's bias (HF: mlp.gate.e_score_correction_bias, GGUF: exp_probs_b.bias) lives
        # beside the router's Linear, not inside it
        for old in (".mlp.gate.e_score_correction_bias", ".mlp.exp_probs_b.bias"):
            name = name.replace(old, ".mlp.e_score_correction_bias")
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]) -> set[str]:
        return super().load_weights(self._joined_kv_b(weights))

    def _joined_kv_b(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        """kv_b_proj as one float tensor: a quantized one dequantized (MLA absorbs it into the
        query and output as per-head matrices, not a GEMM), and newer GGUF files' split
        k_b [H, R, nope] / v_b [H, v, R] joined back into [H * (nope + v), R]."""
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in weights:
            kind = next((k for k in ("kv_b_proj", "k_b_proj", "v_b_proj") if f".self_attn.{k}." in name), None)
            if kind is None:
                yield name, t
                continue
            if isinstance(t, QuantizedTensor):
                t = t.dequantize()
            if kind == "kv_b_proj":
                yield name, t
                continue
            prefix = name.split(f".{kind}.")[0]
            got = parts.setdefault(prefix, {})
            got[kind] = t
            if len(got) == 2:
                k_b = got["k_b_proj"].reshape(self.config.num_attention_heads, self.config.kv_lora_rank, -1)
                v_b = got["v_b_proj"].reshape(self.config.num_attention_heads, -1, self.config.kv_lora_rank)
                kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
                yield f"{prefix}.kv_b_proj.weight", kv_b.reshape(-1, self.config.kv_lora_rank)
                del parts[prefix]

    def process_weights_after_loading(self) -> None:
        for layer in self.layers:
            layer.self_attn.absorb_kv_b()
        super().process_weights_after_loading()


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's attention; sigmoid routing with a score-correction bias, grouped top-k,
    renormalised and scaled."""

    architectures, model_types, gguf_architectures = ("DeepseekV3ForCausalLM",), ("deepseek_v3",), ()
    v3 = True


def config_from_gguf(field: Callable[[str], Any], tensors: Mapping[str, Any]):
    """The transformers config of a llama.cpp `deepseek2` GGUF file (transformers reads no such
    header). `field(key)` is a metadata value (an array's length) or None, `tensors` the file's
    tensors by name.

    Newer files describe MLA as llama.cpp runs it (key_length = kv_lora_rank + rope, value_length =
    kv_lora_rank) and put the per-head sizes in key_length_mla / value_length_mla; older ones have
    the per-head sizes in key_length / value_length. Sigmoid gating (expert_gating_func 2) is
    V3's routing. YaRN: the file keeps 0.1 * mscale_all_dim as yarn_log_multiplier and no
    mscale; DeepSeek's published configs have mscale == mscale_all_dim, assumed here.
    """
    from transformers import DeepseekV2Config, DeepseekV3Config

    def f(key: str, default: Any = None) -> Any:
        v = field(f"deepseek2.{key}")
        return default if v is None else v

    heads, rope = int(f("attention.head_count")), int(f("rope.dimension_count"))
    qk_head, v_dim = f("attention.key_length_mla"), f("attention.value_length_mla")
    if not qk_head:
        qk_head, v_dim = f("attention.key_length"), f("attention.value_length")
    v3 = f("expert_gating_func", 1) == 2
    groups, used_groups = int(f("expert_group_count", 1)), int(f("expert_group_used_count", 1))
    rope_params: dict = {"rope_type": "default", "rope_theta": float(f("rope.freq_base", 10000.0))}
    if f("rope.scaling.type") == "yarn":
        m = float(f("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope_params.update(rope_type="yarn", factor=float(f("rope.scaling.factor")), beta_fast=32.0, beta_slow=1.0,
                           original_max_position_embeddings=int(f("rope.scaling.original_context_length")),
                           mscale=m or 1.0, mscale_all_dim=m or 1.0)
    kw = dict(
        vocab_size=int(f("vocab_size") or field("tokenizer.ggml.tokens") or 0),
        hidden_size=int(f("embedding_length")), intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")), num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=int(f("context_length")), rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        q_lora_rank=f("attention.q_lora_rank"), kv_lora_rank=int(f("attention.kv_lora_rank")),
        qk_rope_head_dim=rope, qk_nope_head_dim=int(qk_head) - rope, v_head_dim=int(v_dim),
        n_routed_experts=f("expert_count"), num_experts_per_tok=f("expert_used_count"),
        n_shared_experts=int(f("expert_shared_count", 0)), moe_intermediate_size=f("expert_feed_forward_length"),
        first_k_dense_replace=int(f("leading_dense_block_count", 0)),
        routed_scaling_factor=float(f("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(f("expert_weights_norm", False)),
        n_group=groups, topk_group=used_groups, rope_parameters=rope_params,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=field("tokenizer.ggml.bos_token_id"), eos_token_id=field("tokenizer.ggml.eos_token_id"),
    )
    if v3:
        config = DeepseekV3Config(**kw, rope_interleave=True)
    else:
        config = DeepseekV2Config(**kw, topk_method="group_limited_greedy" if groups > 1 else "greedy")
    config.architectures = ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"]
    return config


MODELS = (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM)
