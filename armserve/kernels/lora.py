"""Batched LoRA (punica-style shrink then expand): one batch mixes tokens of different adapters.

Adapters are stacked per layer: A as [L, R, K] and B as [L, N, R] (L adapter slots, R the maximum
rank, lower ranks zero-padded), and each token names its slot in `indices` (-1: no adapter, the
base model alone). A layer's output gets `scale[slot] * (x @ A[slot].T) @ B[slot].T` added:

    buf = lora_shrink(x, A, indices)           # [T, R] float32
    lora_expand_(y, buf, B, indices, scales)   # y[T, N] += scales[idx] * buf @ B[idx].T

A fused layer (qkv, gate_up) shrinks once with its slices' A stacked along R, then expands each
slice into its column range of y (a view: rows any stride apart).
"""

from __future__ import annotations

import torch


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """PyTorch reference: [T, R] float32, row t = x[t] @ a[indices[t]].T (zeros where indices[t] < 0)."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32)
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = x[rows].double().matmul(a[slot].double().t()).float()
    return out


def lora_expand_ref(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, indices: torch.Tensor,
                    scales: torch.Tensor) -> torch.Tensor:
    """PyTorch reference, in place: y[t] += scales[s] * buf[t] @ b[s].T for s = indices[t] >= 0, the
    sum in float32 rounded once to y's dtype."""
    for slot in indices.unique().tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        delta = buf[rows].double().matmul(b[slot].double().t()) * float(scales[slot])
        y[rows] = (y[rows].float() + delta.float()).to(y.dtype)
    return y


def lora_shrink(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [T, K] (float32 / bfloat16), a [L, R, K] same dtype, indices [T] int64 -> [T, R] float32."""
    return lora_shrink_ref(x, a, indices)


def lora_expand_(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, indices: torch.Tensor,
                 scales: torch.Tensor) -> torch.Tensor:
    """y [T, N] (a view; float32 / bfloat16) += scales[idx] * buf [T, R] @ b[idx].T, in place; b [L, N, R]
    in y's dtype, scales [L] float32. Returns y."""
    return lora_expand_ref(y, buf, b, indices, scales)
