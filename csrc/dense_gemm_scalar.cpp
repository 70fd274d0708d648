// Dense bf16 GEMM, reference variant (no SIMD flags): what every SIMD variant is checked against.
#include "dense_gemm_impl.h"

extern "C" const DenseTable* armserve_dense_scalar() {
  return armserve_dense::DenseGemm<armserve_dense::ScalarP<>>::table("scalar");
}

extern "C" const DenseTable* armserve_dense_scalar_f32() {
  return armserve_dense::DenseGemm<armserve_dense::ScalarP<true>>::table_f32("scalar");
}
