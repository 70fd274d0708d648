"""The paged KV cache and attention over it, float and int8 (csrc/attention_impl.h): the cache
layout the kernels index, writing a step's keys and values into it, and attending.

One layer's cache, block by block, head by head, with each tile of `KEY_TILE` keys transposed so
that its keys are the lanes of a vector:

    K  [num_blocks, num_kv_heads, block_size // KEY_TILE, head_dim, KEY_TILE]
    V  [num_blocks, num_kv_heads, block_size, head_dim]

(a bfloat16 cache pairs neighbours for the bf16 dot instructions, `kv_cache_shapes`). An int8 cache
also has `k_scale`/`v_scale` `[num_blocks, num_kv_heads, block_size]` float32: each (token, kv
head) row is stored as round(x / scale) with scale = absmax(row) / 127 (`reference.quantize_kv_ref`).
The PyTorch path (layers/attention.py) reads and writes rows through the same layout.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from armserve.kernels.capture import call
from armserve.kernels.library import DTYPE_CODES


KEY_TILE = 16  # keys per transposed K tile; block sizes are multiples of it


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.float32) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's K cache, V cache and int8 scales for a cache of `dtype` (see the module
    docstring; bfloat16 pairs neighbours for the bf16 dot instructions)."""
    if block_size % KEY_TILE:
        raise ValueError(f"block_size must be a multiple of {KEY_TILE}, got {block_size}")
    nb, hk, bs, hd, t = num_blocks, num_kv_heads, block_size, head_dim, KEY_TILE
    scales = (nb, hk, bs)
    if dtype == torch.bfloat16:
        if hd % 2:
            raise ValueError(f"a bfloat16 cache needs an even head_dim, got {hd}")
        return (nb, hk, bs // t, hd // 2, t, 2), (nb, hk, bs // 2, hd, 2), scales
    return (nb, hk, bs // t, hd, t), (nb, hk, bs, hd), scales


class AttnBatch(ctypes.Structure):
    """One step's sequences as the attention kernels read them (csrc/api.h): where each one's
    query rows start, how many, its context length and its block table row."""

    _fields_ = [
        ("num_seqs", ctypes.c_int32),
        ("q_start", ctypes.c_void_p),
        ("q_len", ctypes.c_void_p),
        ("context_len", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("max_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
    ]


def make_attn_batch(q_start: torch.Tensor, q_len: torch.Tensor, context_len: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int) -> AttnBatch:
    """The step layout for `paged_attention`; the int32 tensors must outlive it."""
    return AttnBatch(q_start.shape[0], q_start.data_ptr(), q_len.data_ptr(), context_len.data_ptr(),
                     block_tables.data_ptr(), block_tables.shape[1], block_size)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(kv heads, head_dim, block size) of caches in the kernels' block layout (module docstring);
    the kernels index raw memory, so anything else is refused."""
    return _cache_geometry(tuple(k_cache.shape), tuple(v_cache.shape), v_cache.dtype,
                           k_cache.is_contiguous() and v_cache.is_contiguous())


@functools.lru_cache(maxsize=64)
def _cache_geometry(k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype,
                    contiguous: bool) -> tuple[int, int, int]:
    """`_check_cache` for one pair of shapes, worked out once (it runs for every layer of every step)."""
    ok = contiguous and len(v_shape) in (4, 5)
    if ok:
        nb, hk = v_shape[:2]
        bs, hd = (v_shape[2] * 2, v_shape[3]) if len(v_shape) == 5 else v_shape[2:]
        ok = bs % 16 == 0 and (k_shape, v_shape) == kv_cache_shapes(nb, bs, hk, hd, dtype)[:2]
    if not ok:
        raise ValueError(f"caches must be contiguous K and V in the block layout of kv_cache_shapes() for "
                         f"their dtype, got {'' if contiguous else 'non-contiguous '}K {k_shape} / V {v_shape} {dtype}")
    return hk, hd, bs


def _check_head_dim(hd: int) -> None:
    if hd % 16:
        raise ValueError(f"the attention kernels need head_dim to be a multiple of 16, got {hd}")


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write rows of k/v ([T, hk*hd], row-strided views are fine) into cache slots."""
    hk, hd, bs = _check_cache(k_cache, v_cache)
    assert k.stride(0) == v.stride(0) and k.stride(1) == 1 and k.shape[1] == hk * hd
    call("armserve_reshape_and_cache", DTYPE_CODES[k.dtype], k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
         v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], hk, hd, k.stride(0), bs)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of q rows ([T, hq*hd], row-strided views are fine) over their cached context."""
    assert q.stride(1) == 1
    hk, hd, bs = _check_cache(k_cache, v_cache)
    _check_head_dim(hd)
    if (hk, hd, bs) != (num_kv_heads, head_dim, batch.block_size):
        raise ValueError(f"caches hold ({hk} heads, head_dim {hd}, block size {bs}), the call says "
                         f"({num_kv_heads}, {head_dim}, {batch.block_size})")
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    call("armserve_paged_attention", DTYPE_CODES[q.dtype], out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
         v_cache.data_ptr(), ctypes.addressof(batch), num_heads, num_kv_heads, head_dim,
         scale, sliding_window or 0, softcap or 0.0, q.stride(0))
    return out


def _check_i8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor) -> tuple[int, int, int]:
    """The int8 kernels index raw memory: refuse anything but the layout they assume."""
    hk, hd, bs = _check_cache(k_cache, v_cache)
    for name, c, s in (("k", k_cache, k_scale), ("v", v_cache, v_scale)):
        if c.dtype != torch.int8:
            raise ValueError(f"{name}_cache must be int8, got {c.dtype}")
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(v_cache.shape[:3]) or not s.is_contiguous():
            raise ValueError(f"{name}_scale must be a contiguous float32 [blocks, kv_heads, block_size] = "
                             f"{tuple(v_cache.shape[:3])} tensor, got {s.dtype} of shape {tuple(s.shape)}")
    return hk, hd, bs


def reshape_and_cache_i8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize rows of k/v ([T, hk*hd], row-strided views are fine) into int8 cache slots and their
    per-(slot, kv head) scales (see reference.quantize_kv_ref)."""
    hk, hd, bs = _check_i8_cache(k_cache, v_cache, k_scale, v_scale)
    if k.stride(0) != v.stride(0) or k.stride(1) != 1 or k.shape[1] != hk * hd or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, {hk * hd}] with unit column stride and equal row strides, "
                         f"got {tuple(k.shape)} / {tuple(v.shape)}")
    if k.dtype not in DTYPE_CODES or v.dtype != k.dtype:
        raise ValueError(f"k/v dtype must be one of float32, bfloat16, float16, got {k.dtype} / {v.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    call("armserve_reshape_and_cache_i8", DTYPE_CODES[k.dtype], k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
         v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
         slot_mapping.data_ptr(), k.shape[0], hk, hd, k.stride(0), bs)


def paged_attention_i8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor, batch: AttnBatch, num_heads: int, num_kv_heads: int, head_dim: int,
                       scale: float, sliding_window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """`paged_attention` over int8 caches (scores (q . k8) * k_scale, values weighted by p * v_scale)."""
    hk, hd, _ = _check_i8_cache(k_cache, v_cache, k_scale, v_scale)
    _check_head_dim(hd)
    if q.stride(1) != 1 or q.dtype not in DTYPE_CODES:
        raise ValueError(f"q must be float32/bfloat16/float16 with unit column stride, got {q.dtype} "
                         f"strides {q.stride()}")
    if (hk, hd) != (num_kv_heads, head_dim):
        raise ValueError(f"cache rows are ({hk}, {hd}), expected ({num_kv_heads}, {head_dim})")
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    call("armserve_paged_attention_i8", DTYPE_CODES[q.dtype], out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
         v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
         ctypes.addressof(batch), num_heads, num_kv_heads, head_dim, scale,
         sliding_window or 0, softcap or 0.0, q.stride(0))
    return out


def encoder_attention(qkv: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, head_dim: int,
                      scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional attention of an encoder step: qkv [T, 3 * heads * head_dim] (q, k, v heads side
    by side; row-strided views are fine) holds the sequences back to back, `seq_lens` (int32) tokens
    each, and every row attends to all rows of its own sequence. `bias` ([3 * heads * head_dim], the
    projection's) is added to the rows as the kernel reads them. Returns [T, heads * head_dim]."""
    _check_head_dim(head_dim)
    if head_dim > 512:
        raise ValueError(f"the encoder-attention kernel takes head_dim up to 512, got {head_dim}")
    width = num_heads * head_dim
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != 3 * width or qkv.dtype not in DTYPE_CODES:
        raise ValueError(f"qkv must be float32/bfloat16/float16 [T, {3 * width}] with unit column stride, got "
                         f"{qkv.dtype} {tuple(qkv.shape)} strides {qkv.stride()}")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous int32 vector, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if seq_lens.numel() == 0 or int(seq_lens.min()) < 1 or int(seq_lens.sum()) != qkv.shape[0]:
        raise ValueError(f"seq_lens must be positive and add up to the {qkv.shape[0]} rows of qkv, got "
                         f"{seq_lens.tolist()}")
    if not scale > 0:  # the kernel takes each row's max of the raw scores as the max of the scaled ones
        raise ValueError(f"scale must be positive, got {scale}")
    if bias is not None and (bias.dtype != qkv.dtype or bias.shape != (3 * width,)):
        raise ValueError(f"bias must be {qkv.dtype} [{3 * width}], got {bias.dtype} {tuple(bias.shape)}")
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(qkv.shape[0], width, dtype=qkv.dtype)
    call("armserve_encoder_attention", DTYPE_CODES[qkv.dtype], out.data_ptr(), qkv.data_ptr(),
         None if bias is None else bias.data_ptr(), seq_lens.data_ptr(), seq_lens.numel(), num_heads, head_dim, scale,
         qkv.stride(0))
    return out
