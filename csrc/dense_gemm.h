// Dense bf16 GEMM with weights prepacked once at load: out [M, N] = x [M, K] @ W [N, K]^T for
// every row count (decode batches and prefill chunks). C ABI and the per-ISA table. Float32
// weights have a GEMM of their own on the same driver (float32 layout at the end).
//
// Packed layout (uint16 = bf16 bits): [ceil(N / 16)][ceil(K / 2)][16][2]. For column block b,
// k-pair p and column c < 16, the element pair (W[16b + c][2p], W[16b + c][2p + 1]); zeros pad
// the N and K tails. A 64-byte row of the layout (one block, one pair) is exactly the weight
// operand of AVX512-BF16 vdpbf16ps (16 fp32 lanes += a[2i] b[2i] + a[2i+1] b[2i+1]) and of four
// ARM BFDOT registers, with the activation pair (x[m][2p], x[m][2p+1]) broadcast as one 32-bit
// value. Without a bf16 dot instruction a 32-bit lane widens to two fp32 values with
// `lane << 16` (even k) and `lane & 0xffff0000` (odd k), each multiplied by its fp32 activation.
//
// Float32 layout: [ceil(N / 16)][ceil(K / 2)][2][16] floats: for column block b and k-pair p the 16
// columns' weights at k = 2p (one zmm, two ymm, four NEON registers), then at k = 2p + 1. The
// tiles are the widening ones of bf16 with two plain loads in place of the widening.
#pragma once
#include <cstdint>

#include "kernels.h"

extern "C" {

struct DenseTable {
  const char* name;
  // out [M, N] (out_dtype AS_F32 or AS_BF16, rows `ldo` elements apart) = x (bf16 [M, K],
  // contiguous) times the packed weight's transpose; the type of armserve_gemm_bf16 (api.h).
  decltype(&armserve_gemm_bf16) gemm;
  // The same against quantized weights dequantized panel by panel (armserve_gemm_q_bf16, api.h).
  decltype(&armserve_gemm_q_bf16) gemm_q;
  // The GEMM's output column blocks [b0, b1) only (16 columns each), on the calling thread: column
  // 16 * (b0 + j) + c goes to out[r * ldo + 16 * j + c]. For callers that share the work out
  // themselves (the MoE's (expert, columns) items, moe_impl.h).
  void (*cols)(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n, int64_t k,
               int64_t ldo, int64_t b0, int64_t b1);
};

// The table the dense GEMM uses now (the selected variant and switches; dense_dispatch.cpp).
const DenseTable* armserve_dense_active();

// The float32 GEMM's table for the variant in use (no gemm_q).
const DenseTable* armserve_dense_f32_active();

const DenseTable* armserve_dense_scalar();
const DenseTable* armserve_dense_scalar_f32();
#if defined(__x86_64__) || defined(_M_X64)
const DenseTable* armserve_dense_avx2();
const DenseTable* armserve_dense_avx2_f32();
const DenseTable* armserve_dense_avx512();
const DenseTable* armserve_dense_avx512_f32();
const DenseTable* armserve_dense_avx512_bf16();  // needs AVX512-BF16
const DenseTable* armserve_dense_amx();          // needs AMX-BF16 and armserve_amx_ready()
// 1 once Linux granted this process AMX's tile data (asked on the first call), else 0.
int32_t armserve_amx_ready();
#endif
#if defined(__aarch64__)
const DenseTable* armserve_dense_neon();
const DenseTable* armserve_dense_neon_f32();
const DenseTable* armserve_dense_neon_bf16();  // needs BF16 (HWCAP2_BF16)
const DenseTable* armserve_dense_sve();
const DenseTable* armserve_dense_sve_f32();
const DenseTable* armserve_dense_sve_bf16();  // needs SVE and BF16
#endif
}
