"""Kernel or PyTorch: the one place that decides, op by op (`use_kernel`).

An op runs its C++ kernel when the library is loaded and the input is one the kernel takes (and,
for the matmuls, one it is faster on); otherwise its PyTorch reference (kernels/reference.py).
The op functions that can fall back ask here themselves; a caller asks where it must choose before
the op runs (prepack a weight at load, build the attention step for the kernels, fuse a layer's
experts) or falls back in its own way (F.linear with the bias around the skinny matmul).
"""

from __future__ import annotations

import functools

import torch

from armserve.kernels import library
from armserve.kernels.library import DTYPE_CODES

# The small elementwise kernels (add_bias, mul_cols, cast, csrc/graph.cpp) are there so that a decode
# step is kernel calls only (a recorded step replays nothing else); single threaded, for the few rows
# of a decode step: beyond `SMALL_OP_ROWS` rows PyTorch's threaded ops are the better choice.
SMALL_OP_ROWS = 64

# From this many rows the int8-weight (w8 / w8h: GGUF Q8_0; and w5 / w6, Q5_0 / Q6_K, which the w8
# tiles held before and whose results stay those bit for bit) parts of a bf16 quantized layer
# dequantize their weight panel by panel for the dense bf16 GEMM instead of quantizing the
# activations for the w8a8 GEMM: the dequantization is then shared by enough rows, and the bf16
# tiles run near the bf16 dot instruction's peak (1.2-1.5x the w8a8 GEMM's 300 GFLOP/s from 256
# rows, Zen 5). int4 parts keep the w4a8 GEMM, which runs as fast as the bf16 tiles there
# (benchmarks/bench_kernels.py --only qdense), except on AMX tiles (Xeon: ~900 GFLOP/s against the
# w4a8 GEMM's ~200). Only with a bf16 dot instruction: widened to fp32 (AVX2, NEON without BF16) the
# dense tiles lose to the int8 dot products.
QDENSE_MIN_ROWS = 128

# Largest token count for which `gemv` beats PyTorch's GEMM (benchmarks/bench_kernels.py): 4 where
# the weight rows stay cheap per token (AVX-512, or a bf16 dot instruction for bf16); with 8-wide
# widening re-reading a row for each token is compute-bound and loses to oneDNN beyond one token
# (AVX2 measured: 3.0x at 1 token, 0.77x at 4; NEON without BF16 widens alike and is treated so).
GEMV_MAX_TOKENS = 4

# The ops `use_kernel` knows; without the library (ARMSERVE_ISA=torch, none built) it says no to each.
KERNEL_OPS = ("rms_norm", "rms_norm_heads", "rotary", "act_and_mul", "embedding", "attention", "qgemm", "qgemm_pack",
              "qgemm_dense", "dense_pack", "dense", "gemv", "small", "argmax", "moe", "lora", "bias_gelu", "layer_norm")


def use_kernel(op: str, x: torch.Tensor | torch.dtype, head_dim: int | None = None, fmt: str | None = None) -> bool:
    """Whether `op` (one of KERNEL_OPS) runs its C++ kernel on `x`: a tensor (the activations; for
    "dense_pack" / "qgemm_pack" a weight about to be prepacked at load), or for "attention" the
    model dtype. Each rule below is what the kernel takes (dtype, layout; attention walks head_dim
    in 16-lane vectors) and, for the matmuls, where it beats PyTorch (the constants above); a
    quantized layer's "qgemm_dense" needs its part's `fmt` ("w4" / "w8" / "w8h" / "w5" /
    "w6"), "moe" the experts' fmt.
    Without the library every answer is no."""
    lib = library._lib if library._loaded else library.load()
    if lib is None:
        return False
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    if op in ("rms_norm", "rotary", "act_and_mul", "embedding", "qgemm", "bias_gelu", "layer_norm"):
        return dtype in DTYPE_CODES
    if op == "rms_norm_heads":  # q or k of a fused qkv output: heads contiguous, rows any stride apart
        return dtype in DTYPE_CODES and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if op == "attention":
        return dtype in DTYPE_CODES and head_dim is not None and head_dim % 16 == 0
    if op in ("dense_pack", "dense"):
        return x.dim() == 2 and dtype in (torch.bfloat16, torch.float32)
    if op == "qgemm_pack":  # whenever the kernels are on (the layer then keeps no PyTorch copy)
        return True
    if op == "qgemm_dense":
        if fmt not in ("w4", "w8", "w8h", "w5", "w6"):
            raise ValueError(f"use_kernel('qgemm_dense') needs the part's fmt ('w4', 'w8', 'w8h', 'w5' or 'w6'), "
                             f"got {fmt!r}")
        if fmt == "w4" and library.dense_isa() != "amx_bf16":
            return False
        return dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= QDENSE_MIN_ROWS and library.bf16_dot()
    if op == "gemv":
        return x.dim() == 2 and dtype in DTYPE_CODES and x.shape[0] <= _gemv_limit(library.kernel_generation, dtype)
    if op == "small":
        return x.dim() == 2 and x.shape[0] <= SMALL_OP_ROWS and dtype in DTYPE_CODES
    if op == "argmax":
        return dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    if op == "moe":
        return x.dim() == 2 and dtype in DTYPE_CODES and (fmt != "bf16" or dtype == torch.bfloat16)
    if op == "lora":  # x of shrink or y of expand: rows any stride apart, columns contiguous
        return x.dim() == 2 and dtype in DTYPE_CODES and (x.stride(1) == 1 or x.shape[1] <= 1)
    raise ValueError(f"unknown kernel op {op!r}; one of {', '.join(KERNEL_OPS)}")


@functools.lru_cache(maxsize=16)
def _gemv_limit(generation: int, dtype: torch.dtype) -> int:
    """The most rows the skinny matmul takes for weights of `dtype` on the selected variant, worked
    out once per kernel choice (`library.kernel_generation`)."""
    variant = library.isa()
    if dtype == torch.float32:
        # No widening: on x86 the kernel beat PyTorch's sgemv up to 4 tokens (AVX2 and
        # AVX-512, 1 and 2 threads; PyTorch's did not use the second thread). The scalar
        # reference variant never does.
        return 0 if variant == "scalar" else (GEMV_MAX_TOKENS if variant in ("avx2", "avx512") else 1)
    wide = variant == "avx512" or (dtype == torch.bfloat16 and library.bf16_dot())
    return GEMV_MAX_TOKENS if wide else 1
