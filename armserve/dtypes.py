"""The torch dtypes of an engine configuration: the model's (`resolve_dtype`, "auto" by the CPU) and
the KV cache's (`resolve_kv_cache_dtype`). config.py validates the names without torch; this module
is where they become torch dtypes, on the engine's side only."""

from __future__ import annotations

import torch

from armserve.config import EngineConfig, dtype_name, kv_cache_dtype_name

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bfloat16 natively (AVX512-BF16/AMX on x86, BF16 on ARM) and the
    kernel variant in use does too: a forced variant (`ARMSERVE_ISA=avx2`) stands for its CPUs."""
    from armserve import kernels

    native = kernels.native_bf16()
    if native is not None:
        return native
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((low for low in map(str.lower, f) if low.startswith(("flags", "features"))), "")
    except OSError:
        flags = ""
    if {"avx512_bf16", "amx_bf16", "bf16"} & set(flags.replace(":", " ").split()):  # bf16: aarch64's "Features"
        return True
    return torch.backends.cpu.get_cpu_capability().upper() in {"AVX512_BF16", "AMX"}


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: torch.dtype | None = None,
                  quantized_gguf: bool = False) -> torch.dtype:
    """Map a user dtype to a torch dtype. `auto` is bfloat16 on CPUs with native BF16 and for a GGUF
    file whose weights stay quantized (`quantized_gguf`) on every CPU; else float32."""
    name = dtype_name(dtype)
    if name == "auto":
        # NOTE: a float16 checkpoint also runs as bfloat16/float32 here: CPUs have no fast fp16 GEMM
        # in PyTorch, and bfloat16 keeps fp16's range problems away.
        # A quantized GGUF's linear layers quantize their activations to int8 whatever the dtype, so
        # the dtype mostly sets the KV cache: 16 bits, as llama.cpp's f16 cache and vLLM's GGUF
        # dtype, halve it, and decode ran as fast as in float32 on AVX2 (docs/benchmarks.md, Memory).
        return torch.bfloat16 if quantized_gguf or cpu_has_native_bf16() else torch.float32
    return _TORCH_DTYPES[name]


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the KV cache is stored in: the model dtype for `auto` and `bfloat16` (whose
    model dtype is bfloat16), torch.int8 for `int8`."""
    return torch.int8 if kv_cache_dtype_name(kv_cache_dtype) == "int8" else model_dtype


def resolve_dtypes(config: EngineConfig, checkpoint_dtype: torch.dtype | None = None,
                   gguf: bool = False) -> tuple[torch.dtype, torch.dtype]:
    """(the model's dtype, the KV cache's) of `config` for a checkpoint stored in `checkpoint_dtype`
    (`gguf`: a GGUF file): the one place `dtype` and `kv_cache_dtype` become torch dtypes."""
    if kv_cache_dtype_name(config.kv_cache_dtype) == "bfloat16":  # (config.py refuses other dtypes with it)
        dtype = torch.bfloat16
    else:
        dtype = resolve_dtype(config.dtype, checkpoint_dtype, gguf and config.quantization != "none")
    return dtype, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)

