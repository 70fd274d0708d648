// C ABI of armserve's CPU kernels and the table each ISA variant fills.
//
// Tensors are passed as raw pointers plus sizes; Python (armserve/ops.py) owns the memory and
// calls through ctypes, so the build needs no torch headers.
#pragma once
#include <cstdint>

extern "C" {

// Element types of activations, weights and KV cache.
enum ArmDType : int32_t { AS_F32 = 0, AS_BF16 = 1, AS_F16 = 2 };

// One step's attention layout, shared by every layer of the step (built once in Python).
// Token rows of the step: sequence s owns rows [q_start[s], q_start[s] + q_len[s]); its
// queries sit at positions context_len[s] - q_len[s] ... context_len[s] - 1 and attend to
// cache tokens [0, position] (or the last `sliding_window` of them).
struct AttnBatch {
  int32_t num_seqs;
  const int32_t* q_start;
  const int32_t* q_len;
  const int32_t* context_len;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int32_t max_blocks;
  int32_t block_size;
};

struct KernelTable {
  const char* name;
  // out = norm(x (+ residual)) * (w + w_offset); with residual, residual <- x + residual first.
  void (*rms_norm)(int32_t dtype, void* out, const void* x, void* residual, const void* w, int64_t rows,
                   int64_t dim, float eps, float w_offset);
  // In place on q [T, nq*hd] and k [T, nk*hd] (rows `q_stride`/`k_stride` elements apart, so
  // q and k may be views into a fused qkv output); cos_sin: [max_pos, rot_dim] float32 (cos | sin).
  void (*rotary)(int32_t dtype, const int64_t* positions, void* q, void* k, const float* cos_sin, int64_t tokens,
                 int32_t nq, int32_t nk, int32_t head_dim, int32_t rot_dim, int32_t neox, int64_t q_stride,
                 int64_t k_stride);
  // x: [rows, 2d] = [gate | up] -> out [rows, d]; act 0 = silu, 1 = gelu (erf), 2 = gelu (tanh).
  void (*act_and_mul)(int32_t dtype, int32_t act, void* out, const void* x, int64_t rows, int64_t d);
  // Copy this step's k/v rows ([T, hk*hd], rows `src_stride` elements apart) into cache slots;
  // caches in the block layout of attention_impl.h (K tiles transposed), `bs` the block size.
  void (*reshape_and_cache)(int32_t dtype, const void* k, const void* v, void* k_cache, void* v_cache,
                            const int64_t* slots, int64_t tokens, int32_t hk, int32_t hd, int64_t src_stride,
                            int32_t bs);
  // out: [T, hq*hd]; q rows `q_stride` elements apart; caches in the layout of attention_impl.h.
  void (*paged_attention)(int32_t dtype, void* out, const void* q, const void* k_cache, const void* v_cache,
                          const AttnBatch* batch, int32_t hq, int32_t hk, int32_t hd, float scale,
                          int32_t sliding_window, float softcap, int64_t q_stride);
  // ---- 8-bit KV cache (appended: the entries above keep their offsets) ----
  // Quantize each (token, kv head) row of k/v ([T, hk*hd], rows `src_stride` elements apart)
  // symmetrically into int8 caches (attention_impl.h's layout) with float32 scales [blocks, hk, bs]:
  //   scale = absmax(row) / 127, q = round_half_even(x / scale) (all zeros when scale == 0).
  void (*reshape_and_cache_i8)(int32_t dtype, const void* k, const void* v, int8_t* k_cache, int8_t* v_cache,
                               float* k_scale, float* v_scale, const int64_t* slots, int64_t tokens, int32_t hk,
                               int32_t hd, int64_t src_stride, int32_t bs);
  // paged_attention over int8 caches: scores are (q . k8) * k_scale, values weighted by p * v_scale.
  void (*paged_attention_i8)(int32_t dtype, void* out, const void* q, const int8_t* k_cache,
                             const int8_t* v_cache, const float* k_scale, const float* v_scale,
                             const AttnBatch* batch, int32_t hq, int32_t hk, int32_t hd, float scale,
                             int32_t sliding_window, float softcap, int64_t q_stride);
  // Skinny matmul for decode: out [M, N] = x [M, K] @ w [N, K]^T, M small (a few tokens), x and w
  // of the same dtype. Each weight row is read from memory once per call, as one sequential stream
  // per thread, and widened in registers (or fed to a bf16 dot instruction); oneDNN's bf16 path
  // reaches only about a third of the memory bandwidth here.
  void (*gemv)(int32_t dtype, void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k);
};

// Nonzero: the skinny matmul's bf16 rows use the CPU's bf16 dot-product instruction (AVX512-BF16
// vdpbf16ps, ARM BFDOT) instead of widening to fp32. Set in dispatch.cpp from the CPU's features;
// armserve_set_bf16_dot can turn it off (tests, comparisons). bf16 x bf16 products are exact in
// fp32 either way; only how the fp32 sums are grouped (and, for ARM BFDOT, rounded) differs.
extern int armserve_bf16_dot;

// The CPU's features as dispatch.cpp detects them (cpuid / HWCAP, once), for the other
// dispatchers (qdispatch.cpp) to read rather than probe again.
struct CpuFeatures {
  bool avx2, fma, f16c, avx512, avx512_bf16, avx512_vnni, amx;
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
