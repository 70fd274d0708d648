// The table each ISA variant of armserve's CPU kernels fills (the C ABI itself is api.h).
//
// Tensors are passed as raw pointers plus sizes; Python (armserve/kernels/) owns the memory and
// calls through ctypes, so the build needs no torch headers.
#pragma once
#include <cstdint>

#include "api.h"

extern "C" {

// One ISA variant's kernels; each member has the type of the exported function that dispatches to
// it (declared once, in api.h).
struct KernelTable {
  const char* name;
  decltype(&armserve_rms_norm) rms_norm;
  decltype(&armserve_rotary) rotary;
  decltype(&armserve_act_and_mul) act_and_mul;
  decltype(&armserve_reshape_and_cache) reshape_and_cache;
  decltype(&armserve_paged_attention) paged_attention;
  // ---- 8-bit KV cache (appended: the entries above keep their offsets) ----
  decltype(&armserve_reshape_and_cache_i8) reshape_and_cache_i8;
  decltype(&armserve_paged_attention_i8) paged_attention_i8;
  // Skinny matmul for decode; oneDNN's bf16 path reaches only about a third of the memory bandwidth here.
  decltype(&armserve_gemv) gemv;
  // Batched LoRA, grouped by adapter slot (lora_impl.h).
  decltype(&armserve_lora_shrink) lora_shrink;
  decltype(&armserve_lora_expand) lora_expand;
  // Encoder steps: bidirectional attention, GELU with the bias before it, LayerNorm with the bias
  // and residual before it (appended: the entries above keep their offsets).
  decltype(&armserve_encoder_attention) encoder_attention;
  decltype(&armserve_bias_gelu) bias_gelu;
  decltype(&armserve_layer_norm) layer_norm;
};

// Nonzero: the skinny matmul's bf16 rows use the CPU's bf16 dot-product instruction (AVX512-BF16
// vdpbf16ps, ARM BFDOT) instead of widening to fp32. Set in dispatch.cpp from the CPU's features;
// armserve_set_bf16_dot can turn it off (tests, comparisons). bf16 x bf16 products are exact in
// fp32 either way; only how the fp32 sums are grouped (and, for ARM BFDOT, rounded) differs.
extern int armserve_bf16_dot;

// The CPU's features as dispatch.cpp detects them (cpuid / HWCAP, once), for the other
// dispatchers (qdispatch.cpp) to read rather than probe again.
struct CpuFeatures {
  bool avx2, fma, f16c, avx512, avx512_bf16, avx512_vnni, amx, amx_bf16;
  bool neon, dotprod, bf16, i8mm, sve, sve2;
  int sve_bits;  // 0 without SVE
};
const CpuFeatures* armserve_cpu();

const KernelTable* armserve_table_scalar();
#if defined(__x86_64__) || defined(_M_X64)
const KernelTable* armserve_table_avx2();
const KernelTable* armserve_table_avx512();
#endif
#if defined(__aarch64__)
const KernelTable* armserve_table_neon();
const KernelTable* armserve_table_sve();
#endif
}
