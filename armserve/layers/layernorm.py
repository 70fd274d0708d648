"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


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

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 like the reference implementations: bf16 variance loses digits.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + self.offset if self.offset else self.weight
        if self.offset:
            return (xf * w).to(x.dtype)
        return w * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
