"""The C++ kernels (csrc/) seen from Python: `from armserve import kernels`, then `kernels.rms_norm(...)`.

    library.py      loading armserve/_C*.so, the kernel variant (ISA), CPU features, OpenMP, threads
    capture.py      every kernel call goes through `call`; recording and replaying them (step graphs)
    dispatch.py     `use_kernel`: kernel or PyTorch, the rule of each op
    elementwise.py  norms, rotary, gated activations, bias, cast, embedding rows, argmax, an encoder
                    block's bias + GELU and bias + residual + LayerNorm
    attention.py    the paged KV cache layout, cache writes and paged attention (float and int8),
                    bidirectional attention of encoder steps
    gemm.py         dense GEMM on prepacked weights, skinny decode matmul, quantized GEMMs and
                    embedding rows, fused MoE
    lora.py         batched LoRA (punica's shrink / expand, per-token adapter slot) and its reference
    reference.py    the PyTorch reference of each kernel (the fallback, and what tests compare against)

An op that can fall back decides for itself (`use_kernel`), so a layer makes one call; the tests
hold every kernel variant this CPU runs to its reference.
"""

# The package API: callers write `kernels.rms_norm(...)`.
from armserve.kernels.attention import (  # noqa: F401
    KEY_TILE, encoder_attention, kv_cache_shapes, make_attn_batch, paged_attention, paged_attention_i8,
    reshape_and_cache, reshape_and_cache_i8,
)
from armserve.kernels.dispatch import KERNEL_OPS, QDENSE_MIN_ROWS, SMALL_OP_ROWS, use_kernel  # noqa: F401
from armserve.kernels.elementwise import (  # noqa: F401
    act_and_mul, add_bias, argmax, bias_gelu_, cast, embedding, layer_norm, mul_cols, rms_norm, rms_norm_heads_,
    rotary,
)
from armserve.kernels.gemm import (  # noqa: F401
    dense, fused_moe, gemm_bf16, gemm_f32, gemv, pack_bf16, pack_f32, pack_q, packed_bf16_shape, packed_f32_shape, qgemm,
    gguf_embedding, qembedding, qgemm_dense, quantize_act,
)
from armserve.kernels.library import (  # noqa: F401
    KernelError, amx_available, available, bf16_dot, bind_threads, compiled_variants, cpu_features, dense_f32_isa,
    dense_isa, fallback_notice, isa, library_path, load_error, native_bf16, openmp_library, openmp_runtimes,
    qgemm_isa, select_isa, set_amx, set_bf16_dot, status, supported_isas, thread_cores,
)
from armserve.kernels.lora import lora_expand_, lora_expand_ref, lora_shrink, lora_shrink_ref  # noqa: F401
