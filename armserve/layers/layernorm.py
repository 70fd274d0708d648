"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from armserve import kernels


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
        return kernels.rms_norm(x, self.weight, self.eps, residual, self.offset)

    def start_or_add(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's first norm: (norm(x), x) for the first layer (x starts the residual
        stream), (norm(x + residual), x + residual) after it."""
        if residual is None:
            return self(x), x
        return self(x, residual)

    def forward_heads_(self, x: torch.Tensor) -> torch.Tensor:
        """In place on x [T, heads, head_dim] (a view into a fused qkv output): each head normalised
        by this norm of head_dim (Qwen3's and Gemma 3's q/k norms)."""
        return kernels.rms_norm_heads_(x, self.weight, self.eps, self.offset)
