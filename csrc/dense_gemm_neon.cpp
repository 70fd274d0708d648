// Dense bf16 GEMM with NEON (armv8-a baseline), and with BFDOT where the CPU has BF16.
#include "dense_gemm_neon.h"

extern "C" const DenseTable* armserve_dense_neon() {
  return armserve_dense::DenseGemm<armserve_dense::NeonP<>>::table("neon");
}

extern "C" const DenseTable* armserve_dense_neon_f32() {
  return armserve_dense::DenseGemm<armserve_dense::NeonP<true>>::table_f32("neon");
}

extern "C" const DenseTable* armserve_dense_neon_bf16() {
  return armserve_dense::DenseGemm<armserve_dense::NeonBf16P>::table("neon_bf16");
}
