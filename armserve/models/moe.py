"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE (a shared expert behind a sigmoid gate) and
Qwen3-MoE. Attention is Llama's (with Qwen2's q/k/v bias or Qwen3's q/k norms); the MLP of a
sparse layer is a router plus experts (layers/fused_moe.py).

Checkpoint names: Mixtral's `block_sparse_moe.{gate, experts.E.w1/w2/w3}` are read as
`mlp.{gate, experts.E.gate_proj/down_proj/up_proj}`, the Qwen names as they are, so one loader
(LlamaForCausalLM.load_weights) fills every expert's fused gate/up projection.
"""

from __future__ import annotations

import torch
from torch import nn

from armserve.layers.fused_moe import fused_experts, select_experts
from armserve.layers.linear import Linear, get_parallel_context
from armserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, layer_sliding_windows


class SparseMoeBlock(nn.Module):
    """Router (`gate`), `num_experts` gated MLPs of `intermediate_size`, top-k per token
    (renormalised with `norm_topk_prob`); with `shared_intermediate_size`, Qwen2-MoE's shared
    expert added after a sigmoid gate. Under tensor parallelism every expert is split as a dense
    MLP is and the block's output summed over the ranks once; the router is replicated."""

    def __init__(self, config, num_experts: int, top_k: int, intermediate_size: int, norm_topk_prob: bool,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(config.hidden_size, num_experts)
        self.experts = nn.ModuleList(LlamaMLP(config, intermediate_size, reduce=False) for _ in range(num_experts))
        shared = shared_intermediate_size
        self.shared_expert = LlamaMLP(config, shared, reduce=False) if shared else None
        self.shared_expert_gate = Linear(config.hidden_size, 1) if shared else None
        self.group = get_parallel_context().group  # sums the experts' partial outputs (None on one rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x, torch.float32), self.top_k, self.norm_topk_prob)
        out = fused_experts(x, weights, ids, self.experts)
        if self.shared_expert is not None:
            scale = torch.sigmoid(self.shared_expert_gate(x, torch.float32))
            out += scale * self.shared_expert(x).float()
        out = out.to(x.dtype)
        return out if self.group is None else self.group.all_reduce(out)


def sparse_layer(config, i: int) -> bool:
    """Whether layer i has experts (Qwen's `decoder_sparse_step` and `mlp_only_layers`)."""
    if i in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (i + 1) % step == 0


class MoeDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose MLP is `mlp` (a SparseMoeBlock or a dense LlamaMLP)."""

    def __init__(self, config, sliding_window: int | None, qkv_bias: bool, qk_norm: bool, mlp: nn.Module) -> None:
        super().__init__(config, sliding_window, qkv_bias, qk_norm)
        self.mlp = mlp


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral attention, every layer sparse; top-k of the softmax, renormalised."""

    norm_topk_prob = True
    # (the stacked experts ffn_{gate,up,down}_exps are split per expert by the loader)
    gguf_block_names = {"ffn_gate_inp": "mlp.gate"}
    supports_tp = True  # SparseMoeBlock: each expert split as Llama's MLP, the router replicated

    def num_experts(self, config) -> int:
        return config.num_local_experts

    def moe_block(self, config) -> SparseMoeBlock:
        return SparseMoeBlock(config, self.num_experts(config), config.num_experts_per_tok,
                              config.intermediate_size, self.norm_topk_prob)

    def make_layers(self, config) -> nn.ModuleList:
        windows = layer_sliding_windows(config)
        return nn.ModuleList(
            MoeDecoderLayer(config, windows[i], self.qkv_bias, self.qk_norm,
                            self.moe_block(config) if sparse_layer(config, i) else LlamaMLP(config))
            for i in range(config.num_hidden_layers)
        )

    def _checkpoint_name(self, name: str) -> str:
        name = super()._checkpoint_name(name)
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for old, new in ((".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj.")):
                name = name.replace(old, new)
        return name


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE: Qwen2 attention (q/k/v bias); experts of `moe_intermediate_size`, top-k of the
    softmax renormalised only with `norm_topk_prob`; a shared expert of
    `shared_expert_intermediate_size` scaled by sigmoid(shared_expert_gate(x))."""

    qkv_bias = True
    gguf_permuted_qk = False
    gguf_block_names = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                        "ffn_down_shexp": "mlp.shared_expert.down_proj"}

    def num_experts(self, config) -> int:
        return config.num_experts

    def moe_block(self, config) -> SparseMoeBlock:
        return SparseMoeBlock(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                              bool(getattr(config, "norm_topk_prob", False)),
                              getattr(config, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms, bias only with `attention_bias`), no shared
    expert."""

    qk_norm = True
    gguf_block_names = {"ffn_gate_inp": "mlp.gate", "attn_q_norm": "self_attn.q_norm",
                        "attn_k_norm": "self_attn.k_norm"}

    def __init__(self, config) -> None:
        self.qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config)
