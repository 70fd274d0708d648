"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from armserve import ops


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: returns (norm(x + residual) * (weight + offset), x + residual)."""
    if residual is not None:
        x = x + residual
    # Computed in float32 like the reference implementations: bf16 variance loses digits.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        out = (xf * (weight.float() + offset)).to(x.dtype)
    else:
        out = weight * xf.to(x.dtype)
    return out, x


class RMSNorm(nn.Module):
    """`forward(x, residual)` returns `(norm(x + residual), x + residual)`, so a decoder layer
    carries the residual stream without an extra add per layer.

    `offset` is 1.0 for Gemma, whose checkpoints store `weight - 1`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        if ops.use_kernel("rms_norm", x):
            out = ops.rms_norm(x, self.weight, self.eps, residual, self.offset)
            return out if residual is None else (out, residual)
        out, summed = rms_norm_ref(x, self.weight, self.eps, residual, self.offset)
        return out if residual is None else (out, summed)

    def start_or_add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's first norm: (norm(x), x) for the first layer (x starts the residual
        stream), (norm(x + residual), x + residual) after it."""
        if residual is None:
            return self(x), x
        return self(x, residual)

    def forward_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """In place on x [T, heads, head_dim] (a view into a fused qkv output): each head normalised
        by this norm of head_dim (Qwen3's and Gemma 3's q/k norms)."""
        if ops.use_kernel("rms_norm_heads", x):
            return ops.rms_norm_heads_(x, self.weight, self.eps, self.offset)
        x.copy_(rms_norm_ref(x, self.weight, self.eps, None, self.offset)[0])
        return x
