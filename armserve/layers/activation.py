"""Gated activations over a fused gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armserve import ops


def act_and_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    """PyTorch reference: x = [gate | up] along the last dim -> act(gate) * up."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none") * up


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    act = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if ops.use_kernel("act_and_mul", x):
            return ops.act_and_mul(x, self.act)
        return act_and_mul_ref(x, self.act)


class GeluAndMul(SiluAndMul):
    """x = [gate | up] -> gelu(gate) * up; `approximate="tanh"` for Gemma's gelu_pytorch_tanh."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.act = "gelu_tanh" if approximate == "tanh" else "gelu"


def get_act_and_mul(name: str) -> nn.Module:
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul("none")
    raise ValueError(f"unsupported activation {name!r}; supported: silu, gelu, gelu_pytorch_tanh")
