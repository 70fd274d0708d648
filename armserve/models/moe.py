"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE (a shared expert behind a sigmoid gate) and
Qwen3-MoE. Attention is Llama's (with Qwen2's q/k/v bias or Qwen3's q/k norms); the MLP of a
sparse layer is a router plus experts (layers/fused_moe.py).

Checkpoint names: Mixtral's `block_sparse_moe.{gate, experts.E.w1/w2/w3}` are read as
`mlp.{gate, experts.E.gate_proj/down_proj/up_proj}`, the Qwen names as they are, so one loader
(LlamaForCausalLM.load_weights) fills every expert's fused gate/up projection.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from armserve.layers.fused_moe import fused_experts, select_experts
from armserve.layers.linear import Linear, get_parallel_context
from armserve.models.llama import LlamaForCausalLM, LlamaMLP


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


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral attention, every layer sparse; top-k of the softmax, renormalised."""

    # (llama.cpp writes Mixtral as a `llama` file: LlamaForCausalLM.gguf_config makes its config)
    architectures, model_types, gguf_architectures = ("MixtralForCausalLM",), ("mixtral",), ()
    # (the stacked experts ffn_{gate,up,down}_exps are split per expert by the loader)
    gguf_block_names = {"ffn_gate_inp": "mlp.gate"}

    def moe_block(self, config) -> SparseMoeBlock:
        return SparseMoeBlock(config, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, True)

    def make_mlp(self, config, i: int) -> nn.Module:
        return self.moe_block(config) if sparse_layer(config, i) else LlamaMLP(config)

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

    architectures, model_types, gguf_architectures = ("Qwen2MoeForCausalLM",), ("qwen2_moe",), ("qwen2moe",)
    qkv_bias = True
    gguf_permuted_qk = False
    gguf_block_names = {"ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                        "ffn_down_shexp": "mlp.shared_expert.down_proj"}
    gguf_norm_topk_prob = False  # llama.cpp renormalises Qwen3-MoE's top-k weights, not Qwen2-MoE's

    @classmethod
    def gguf_config(cls, field: Callable[[str], Any], tensors: Mapping[str, Any], read: Callable[[], Any]):
        """transformers' reading of the header plus what it leaves out: the experts' and the
        shared expert's widths (`expert_feed_forward_length`, `expert_shared_feed_forward_length`)
        and llama.cpp's top-k renormalisation."""
        config = read()
        arch = field("general.architecture")
        if not field(f"{arch}.expert_count"):
            return config
        width = field(f"{arch}.expert_feed_forward_length")
        if width:
            config.moe_intermediate_size = int(width)
        shared = field(f"{arch}.expert_shared_feed_forward_length")
        if shared:
            config.shared_expert_intermediate_size = int(shared)
        config.norm_topk_prob = cls.gguf_norm_topk_prob
        return config

    def moe_block(self, config) -> SparseMoeBlock:
        return SparseMoeBlock(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                              bool(getattr(config, "norm_topk_prob", False)),
                              getattr(config, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k norms, bias only with `attention_bias`), no shared
    expert."""

    architectures, model_types, gguf_architectures = ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)
    qkv_bias, qk_norm = None, True  # (bias only with the config's attention_bias)
    gguf_block_names = {"ffn_gate_inp": "mlp.gate", "attn_q_norm": "self_attn.q_norm",
                        "attn_k_norm": "self_attn.k_norm"}
    gguf_norm_topk_prob = True


MODELS = (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)
