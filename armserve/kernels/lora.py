"""Batched LoRA (punica-style shrink then expand): one batch mixes tokens of different adapters.

Adapters are stacked per layer: A as [L, R, K] and B as [L, N, R] (L adapter slots, R the maximum
rank, lower ranks zero-padded), and each token names its slot in `indices` (-1: no adapter, the
base model alone). A layer's output gets `scale[slot] * (x @ A[slot].T) @ B[slot].T` added:

    buf = lora_shrink(x, A, indices)           # [T, R] float32
    lora_expand_(y, buf, B, indices, scales)   # y[T, N] += scales[idx] * buf @ B[idx].T

A fused layer (qkv, gate_up) shrinks once with its slices' A stacked along R, then expands each
slice into its column range of y (a view: rows any stride apart).

Both run the C++ kernels (csrc/lora_impl.h) where `use_kernel("lora", ...)` allows and the other
tensors are laid out as the kernels read them, their references otherwise. The kernel calls take
pointers and sizes only, so a recorded decode step (kernels/capture.py) replays them: `a`, `b`,
`indices` and `scales` are then read at the addresses recorded, so the caller keeps them in place
(slot weights and scales overwritten in place, the step's indices written into a persistent tensor).
The kernels treat a slot outside [0, L) like -1 (no adapter), where the references raise.
"""

from __future__ import annotations

import torch

from armserve.kernels.capture import call
from armserve.kernels.dispatch import use_kernel
from armserve.kernels.library import DTYPE_CODES


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


def _check(what: str, ok: bool, detail: str) -> None:
    if not ok:
        raise ValueError(f"{what}: {detail}")


def _indices_ok(indices: torch.Tensor) -> bool:
    return indices.dtype == torch.int64 and indices.dim() == 1 and indices.is_contiguous()


def lora_shrink(x: torch.Tensor, a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x [T, K] (float32 / bfloat16), a [L, R, K] same dtype, indices [T] int64 -> [T, R] float32.
    The kernel takes x rows and a's slots and rows any stride apart (a fused layer's A sliced along R)."""
    _check("lora_shrink", x.dim() == 2 and a.dim() == 3 and a.shape[2] == x.shape[1] and indices.shape == (x.shape[0],),
           f"x {tuple(x.shape)}, a {tuple(a.shape)}, indices {tuple(indices.shape)}")
    if not (use_kernel("lora", x) and a.dtype == x.dtype and (a.stride(2) == 1 or a.shape[2] <= 1)
            and _indices_ok(indices)):
        return lora_shrink_ref(x, a, indices)
    t, k = x.shape
    out = torch.empty(t, a.shape[1], dtype=torch.float32)
    call("armserve_lora_shrink", DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), a.data_ptr(),
         indices.data_ptr(), t, a.shape[1], k, a.shape[0], x.stride(0), out.stride(0), a.stride(0), a.stride(1))
    return out


def lora_expand_(y: torch.Tensor, buf: torch.Tensor, b: torch.Tensor, indices: torch.Tensor,
                 scales: torch.Tensor) -> torch.Tensor:
    """y [T, N] (a view; float32 / bfloat16) += scales[idx] * buf [T, R] @ b[idx].T, in place; b [L, N, R]
    in y's dtype, scales [L] float32. Returns y. The kernel takes y and buf rows any stride apart and b's
    slots too (each slot's [N, R] contiguous)."""
    _check("lora_expand_", y.dim() == 2 and buf.dim() == 2 and b.dim() == 3 and buf.shape[0] == y.shape[0]
           and b.shape[1:] == (y.shape[1], buf.shape[1]) and indices.shape == (y.shape[0],)
           and scales.shape == (b.shape[0],),
           f"y {tuple(y.shape)}, buf {tuple(buf.shape)}, b {tuple(b.shape)}, indices {tuple(indices.shape)}, "
           f"scales {tuple(scales.shape)}")
    if not (use_kernel("lora", y) and b.dtype == y.dtype and (b.shape[0] == 0 or b[0].is_contiguous()) and buf.dtype == torch.float32
            and (buf.stride(1) == 1 or buf.shape[1] <= 1) and _indices_ok(indices)
            and scales.dtype == torch.float32 and scales.is_contiguous()):
        return lora_expand_ref(y, buf, b, indices, scales)
    t, n = y.shape
    call("armserve_lora_expand", DTYPE_CODES[y.dtype], y.data_ptr(), buf.data_ptr(), b.data_ptr(),
         indices.data_ptr(), scales.data_ptr(), t, n, b.shape[2], b.shape[0], y.stride(0), buf.stride(0), b.stride(0))
    return y
