"""Matmuls: the dense GEMM on weights prepacked at load (bf16 and float32), the skinny decode
matmul, the int8-activation GEMMs of quantized weights (and embedding rows gathered from such a
weight), and the fused MoE expert pass.

`dense` decides for itself (with the kernels off it unpacks the weight for PyTorch); the others
always run their kernel, their callers having chosen: the weight format at load, `gemv`'s row
limit, a quantized layer's GEMM per part, whether a layer's experts can be fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from armserve.kernels import reference
from armserve.kernels.capture import call
from armserve.kernels.dispatch import use_kernel
from armserve.kernels.library import DTYPE_CODES


def dense(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [m, k] @ W^T for a weight W [n, k] prepacked by `pack_bf16` or `pack_f32` (out in the
    weight's dtype, or `out_dtype`).

    The kernels can be switched off after loading (tests force the PyTorch path): the packed
    weight is then unpacked for PyTorch's GEMM, slowly but with the same values."""
    f32 = packed.dtype == torch.float32
    if use_kernel("dense", x) and x.dtype == packed.dtype:
        gemm = gemm_f32 if f32 else gemm_bf16
        return gemm(x, packed, n, k, out_dtype=out_dtype or packed.dtype)
    w = reference.unpack_f32_ref(packed, n, k) if f32 else reference.unpack_bf16_ref(packed, n, k)
    out = F.linear(x, w.to(x.dtype))
    return out if out_dtype is None else out.to(out_dtype)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ w [n, k]^T for a few tokens (x and w of one dtype), streaming w once at memory speed."""
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    call("armserve_gemv", DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k)
    return out


def packed_bf16_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """Shape of `pack_bf16`'s result for a weight [n, k]: (ceil(n / 16), ceil(k / 2), 16, 2)."""
    return (-(-n // 16), -(-k // 2), 16, 2)


def packed_f32_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """Shape of `pack_f32`'s result for a weight [n, k]: (ceil(n / 16), ceil(k / 2), 2, 16)."""
    return (-(-n // 16), -(-k // 2), 2, 16)


def _pack(kernel: str, w: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    assert w.dim() == 2 and w.dtype == dtype
    w = w.contiguous()
    out = torch.empty(shape(*w.shape), dtype=dtype)
    call(kernel, w.data_ptr(), *w.shape, out.data_ptr())
    return out


# The packed formats' codes in the C ABI (csrc/api.h; the fused MoE's bf16 blocks are 2).
Q_FORMATS = {"w4": 0, "w8": 1, "w5": 3, "w6": 4, "w8h": 5}


def pack_q(qt) -> torch.Tensor:
    """The packed tiles the w4a8 / w8a8 / w5a8 / w6a8 GEMMs read (csrc/qgemm.h) of a
    quantization.QuantizedTensor (done once at load): what its reference, quantization.formats.pack,
    computes, in one pass."""
    from armserve.quantization.formats import packed_bytes  # (the quantization package imports the kernels)

    n, k = qt.codes.shape
    codes, scales = qt.codes.contiguous(), qt.scales.float().contiguous()
    szp = qt.szp.float().contiguous() if qt.fmt in ("w4", "w6") else None  # (w6: its d)
    assert k % qt.group == 0 and qt.group % (4 if qt.fmt in ("w8", "w8h") else 8) == 0
    assert scales.shape == (n, k // qt.group)
    out = torch.empty(packed_bytes(qt.fmt, n, k, qt.group), dtype=torch.uint8)
    call("armserve_pack_q", Q_FORMATS[qt.fmt], codes.data_ptr(), scales.data_ptr(),
         0 if szp is None else szp.data_ptr(), n, k, qt.group, out.data_ptr())
    return out


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """Prepack a bf16 weight [n, k] (done once at load) for `gemm_bf16`.

    Returns a bfloat16 tensor of shape (ceil(n / 16), ceil(k / 2), 16, 2): for column block b,
    k-pair p, column c, the pair (w[16b + c, 2p], w[16b + c, 2p + 1]), zero-padded in n and k (the
    operand layout of AVX512-BF16 vdpbf16ps / ARM BFDOT; see csrc/dense_gemm.h)."""
    return _pack("armserve_pack_bf16", w, torch.bfloat16, packed_bf16_shape)


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """Prepack a float32 weight [n, k] (done once at load) for `gemm_f32`.

    Returns a float32 tensor of shape (ceil(n / 16), ceil(k / 2), 2, 16): for column block b,
    k-pair p, the 16 columns' weights w[16b + c, 2p], then w[16b + c, 2p + 1], zero-padded in n
    and k (one 16-lane vector each; see csrc/dense_gemm.h)."""
    return _pack("armserve_pack_f32", w, torch.float32, packed_f32_shape)


_GEMM_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _gemm(kernel: str, x_dtype: torch.dtype, x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
          out: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`gemm_bf16` / `gemm_f32`: the checks, the output and the call, for activations of `x_dtype`."""
    assert x.dtype == x_dtype and x.dim() == 2 and x.shape[1] == k
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype)
    assert out.dim() == 2 and out.shape == (m, n) and (out.stride(1) == 1 or m == 0) and out.dtype in _GEMM_OUT_CODES
    call(kernel, _GEMM_OUT_CODES[out.dtype], out.data_ptr(), x.data_ptr(), packed.data_ptr(), m, n, k, out.stride(0))
    return out


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [m, k] bf16 @ W^T for a weight W [n, k] packed by `pack_bf16`, any m (decode and prefill).

    `out` (bfloat16 or float32 [m, n], unit column stride) may be a column range of a wider tensor,
    e.g. `fused[:, a:a + n]`: only those columns are written. float32 output keeps the fp32 sums
    unrounded (LM-head logits)."""
    return _gemm("armserve_gemm_bf16", torch.bfloat16, x, packed, n, k, out, out_dtype)


def gemm_f32(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [m, k] float32 @ W^T for a weight W [n, k] packed by `pack_f32`, any m (decode and
    prefill); `out` as in `gemm_bf16`."""
    return _gemm("armserve_gemm_f32", torch.float32, x, packed, n, k, out, out_dtype)


def quantize_act(x: torch.Tensor, group: int,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 activations per token and group: (codes [m, k], scales [m, k // group], group sums),
    written into `out` when given (buffers of exactly those shapes, reused across calls)."""
    x = x.contiguous()
    m, k = x.shape
    if out is None:
        out = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // group, dtype=torch.float32),
               torch.empty(m, k // group, dtype=torch.int32))
    q, scale, gsum = out
    call("armserve_quantize_act", DTYPE_CODES[x.dtype], x.data_ptr(), m, k, group, q.data_ptr(), scale.data_ptr(),
         gsum.data_ptr())
    return out


def qgemm(fmt: str, out: torch.Tensor, col: int, acts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          packed: torch.Tensor, n: int, group: int) -> None:
    """out[:, col:col + n] = acts x W^T for a packed "w4", "w8", "w8h", "w5" or "w6" weight (csrc/qgemm.h)."""
    q, scale, gsum = acts
    call(f"armserve_gemm_{fmt}", DTYPE_CODES[out.dtype],
         out.data_ptr() + col * out.element_size(), q.data_ptr(), scale.data_ptr(), gsum.data_ptr(),
         packed.data_ptr(), q.shape[0], n, q.shape[1], group, out.stride(0))


def qgemm_dense(fmt: str, out: torch.Tensor, col: int, x: torch.Tensor, packed: torch.Tensor, n: int,
                group: int) -> None:
    """out[:, col:col + n] = x (bf16 [m, k]) @ W^T for a packed "w4", "w8", "w8h", "w5" or "w6" weight, dequantized to
    bf16 panel by panel for the dense GEMM's tiles (prefill-sized m; csrc/dense_gemm_impl.h)."""
    x = x.contiguous()
    call("armserve_gemm_q_bf16", Q_FORMATS[fmt], DTYPE_CODES[out.dtype],
         out.data_ptr() + col * out.element_size(), x.data_ptr(), packed.data_ptr(), x.shape[0], n, x.shape[1],
         group, out.stride(0))


def qembedding(ids: torch.Tensor, packed: torch.Tensor, fmt: str, n: int, k: int, group: int, dtype: torch.dtype,
               start: int = 0, exact: torch.Tensor | None = None) -> torch.Tensor:
    """Embedding rows [m, k] of `dtype` for int64 ids [m] from a table of n rows kept as a packed "w4",
    "w8", "w8h", "w5" or "w6" weight (csrc/qgemm.h): row ids[i] - start dequantized, zeros where that is outside [0, n).
    `exact`: float32 [n, k / group, 2] (scale, scale * zero point) of a w4 table whose scales are not
    float16 values (GGUF Q4_K), used instead of the packed float16 ones."""
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert exact is None or (exact.dtype == torch.float32 and exact.is_contiguous() and fmt == "w4")
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], k, dtype=dtype)
    call("armserve_qembedding", Q_FORMATS[fmt], DTYPE_CODES[dtype], out.data_ptr(), packed.data_ptr(),
         None if exact is None else exact.data_ptr(), ids.data_ptr(), ids.shape[0], start, n, k, group)
    return out


def gguf_embedding(ids: torch.Tensor, address: int, type_code: int, row_bytes: int, n: int, k: int,
                   dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """Embedding rows [m, k] of `dtype` for int64 ids [m] from a GGUF table as the file stores it:
    n rows of ggml type `type_code` (quantization/gguf.py GGUF_ROW_TYPES) at `address`, `row_bytes`
    apart (the caller keeps them mapped). Row ids[i] - start dequantized, zeros outside [0, n)."""
    assert ids.dtype == torch.int64 and ids.dim() == 1
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], k, dtype=dtype)
    call("armserve_gguf_embedding", type_code, DTYPE_CODES[dtype], out.data_ptr(), address, row_bytes, ids.data_ptr(),
         ids.shape[0], start, n, k)
    return out


_MOE_FORMATS = {**Q_FORMATS, "bf16": 2}


def fused_moe(fmt: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor,
              up: torch.Tensor, down: torch.Tensor, inter: int, group_gu: int = 0, group_dn: int = 0) -> torch.Tensor:
    """One MoE layer's experts in one call (csrc/moe_impl.h): float32 [T, hidden] =
    sum_j weights[t, j] * down(silu(gate(x[t])) * up(x[t])) of expert ids[t, j].

    `gate`, `up`, `down`: int64 [E] tensors of each expert's weight addresses ("w4" / "w8" / "w8h" /
    "w5" / "w6" tiles of the quantized GEMM with groups `group_gu` / `group_dn`, or "bf16" blocks of
    `pack_bf16`); the caller keeps the weights alive. ids int64 [T, top_k] in [0, E), weights float32 [T, top_k]."""
    x = x.contiguous()
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    ids = ids.contiguous().to(torch.int64)
    weights = weights.contiguous().to(torch.float32)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    call("armserve_fused_moe", _MOE_FORMATS[fmt], DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), tokens, hidden,
         inter, top_k, ids.data_ptr(), weights.data_ptr(), gate.shape[0], gate.data_ptr(), up.data_ptr(),
         down.data_ptr(), group_gu, group_dn)
    return out
