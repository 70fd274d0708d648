"""Norms, rotary embedding, gated activations, an encoder block's fused bias + GELU and bias +
residual + LayerNorm, and the small ops of a decode step (bias, cast, column scaling, embedding
rows, argmax).

`rms_norm`, `rms_norm_heads_`, `rotary`, `act_and_mul`, `bias_gelu_`, `layer_norm`, `add_bias`,
`cast` and `argmax` run their kernel where `use_kernel` allows and their PyTorch reference
otherwise, so a layer makes one call.
`mul_cols` and `embedding` always run the kernel: their callers choose, each with its own PyTorch
fallback.
"""

from __future__ import annotations

import torch

from armserve.kernels import reference
from armserve.kernels.capture import call
from armserve.kernels.dispatch import use_kernel
from armserve.kernels.library import DTYPE_CODES

_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * (weight + offset); with `residual`, (norm(x + residual) * (weight + offset),
    x + residual), the kernel writing the sum into `residual` in place."""
    if not use_kernel("rms_norm", x):
        out, summed = reference.rms_norm_ref(x, weight, eps, residual, offset)
        return out if residual is None else (out, summed)
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    call("armserve_rms_norm", DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(),
         None if residual is None else residual.data_ptr(), weight.data_ptr(), x.numel() // dim, dim, eps, offset,
         1, dim)
    return out if residual is None else (out, residual)


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """In place: each head of x [T, heads, head_dim] normalised, times (weight + offset) [head_dim]
    (Qwen3's and Gemma 3's q/k norms). x may be a view into a fused qkv output: heads contiguous
    within a row, rows any stride apart."""
    if not use_kernel("rms_norm_heads", x):
        return x.copy_(reference.rms_norm_ref(x, weight, eps, None, offset)[0])
    t, heads, dim = x.shape
    call("armserve_rms_norm", DTYPE_CODES[x.dtype], x.data_ptr(), x.data_ptr(), None, weight.data_ptr(),
         t * heads, dim, eps, offset, heads, x.stride(0))
    return x


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_dim: int,
           rot_dim: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, nq*hd] and k [T, nk*hd] (row-strided views are fine): the kernel rotates them
    in place; the reference returns rotated copies. Returns the rotated (q, k)."""
    if not use_kernel("rotary", q):
        return reference.rotary_ref(positions, q, k, cos_sin, head_dim, rot_dim, neox)
    call("armserve_rotary", DTYPE_CODES[q.dtype], positions.data_ptr(), q.data_ptr(), k.data_ptr(),
         cos_sin.data_ptr(), positions.shape[0], q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim, rot_dim,
         int(neox), q.stride(0), k.stride(0))
    return q, k


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """[..., 2d] = [gate | up] -> act(gate) * up, act one of "silu", "gelu", "gelu_tanh"."""
    if not use_kernel("act_and_mul", x):
        return reference.act_and_mul_ref(x, act)
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    call("armserve_act_and_mul", DTYPE_CODES[x.dtype], _ACT_CODES[act], out.data_ptr(), x.data_ptr(),
         x.numel() // (2 * d), d)
    return out


def bias_gelu_(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """x = gelu(x + bias) in place (x [m, n], bias [n]; `approximate` "none" (erf) or "tanh", as
    F.gelu): an encoder MLP's up projection bias and activation in one pass."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if not use_kernel("bias_gelu", x) or x.dim() != 2 or x.stride(1) != 1 or bias.dtype != x.dtype:
        return x.copy_(reference.bias_gelu_ref(x, bias, approximate))
    assert bias.shape == (x.shape[1],)
    call("armserve_bias_gelu", DTYPE_CODES[x.dtype], x.data_ptr(), bias.contiguous().data_ptr(), x.shape[0],
         x.shape[1], x.stride(0), int(approximate == "tanh"))
    return x


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None, x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + x_bias + residual) * weight + bias over the last dimension of x [m, n] (x_bias
    [n]: the bias of the projection that made x; residual [m, n]): a post-norm block's bias, residual
    add and norm in one pass."""
    parts = [t for t in (weight, bias, residual, x_bias) if t is not None]
    if not use_kernel("layer_norm", x) or x.dim() != 2 or any(t.dtype != x.dtype for t in parts):
        return reference.layer_norm_ref(x, weight, bias, eps, residual, x_bias)
    assert residual is None or residual.shape == x.shape
    x, weight, bias, residual, x_bias = (None if t is None else t.contiguous()
                                         for t in (x, weight, bias, residual, x_bias))
    out = torch.empty_like(x)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    call("armserve_layer_norm", DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), ptr(x_bias), ptr(residual),
         ptr(weight), ptr(bias), x.shape[0], x.shape[1], eps)
    return out


def add_bias(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """out += bias in place (out [m, n] with unit column stride; bias [n], any supported dtype); the
    kernel on a decode step's few rows (so the step stays kernel calls only), PyTorch beyond."""
    if not use_kernel("small", out):
        return out.add_(bias)
    assert out.stride(-1) == 1 and bias.is_contiguous() and bias.shape[-1] == out.shape[-1]
    call("armserve_add_bias", DTYPE_CODES[out.dtype], out.data_ptr(), DTYPE_CODES[bias.dtype], bias.data_ptr(),
         out.shape[0], out.shape[1], out.stride(0))
    return out


def mul_cols(x: torch.Tensor, mul: torch.Tensor) -> torch.Tensor:
    """x *= mul in place, column-wise (x [m, n] with unit column stride, mul float32 [n]); always
    the kernel (see the module docstring)."""
    assert x.dim() == 2 and x.stride(1) == 1 and mul.dtype == torch.float32 and mul.shape == (x.shape[1],)
    call("armserve_mul_cols", DTYPE_CODES[x.dtype], x.data_ptr(), mul.data_ptr(), x.shape[0], x.shape[1],
         x.stride(0))
    return x


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids] for int64 ids [m], rows of any dtype (no bounds check: the engine validates token
    ids); always the kernel (see the module docstring)."""
    assert ids.dtype == torch.int64 and ids.dim() == 1 and table.dim() == 2 and table.is_contiguous()
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype)
    call("armserve_embedding", out.data_ptr(), table.data_ptr(), ids.data_ptr(), ids.shape[0],
         table.shape[1] * table.element_size())
    return out


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) for the float types (round to nearest even); the kernel, into a new contiguous
    tensor, on a decode step's few rows, PyTorch beyond."""
    if not use_kernel("small", x):
        return x.to(dtype)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    call("armserve_cast", DTYPE_CODES[x.dtype], x.data_ptr(), DTYPE_CODES[dtype], out.data_ptr(), x.numel())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [B, V] rows, the kernel for float32 rows with unit column stride (ties
    and NaNs as PyTorch; its argmax takes ~0.3 ms over a 150k vocabulary, a fair part of a small
    model's decode step)."""
    if not use_kernel("argmax", x):
        return x.argmax(dim=-1)
    out = torch.empty(x.shape[0], dtype=torch.int64)
    call("armserve_argmax", x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
