"""Gated activations over a fused gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

from armserve import kernels


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim -> silu(gate) * up."""

    act = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.act_and_mul(x, self.act)


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
