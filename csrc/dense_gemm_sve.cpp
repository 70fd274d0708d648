// Dense bf16 GEMM for the sve kernel variant: the NEON tiles (dense_gemm_neon.h), compiled with
// SVE enabled for the surrounding loops (activation conversion, output rounding).
// NOTE: deliberately not vector-length-agnostic SVE tiles. On the SVE CPUs in use NEON has the
// same multiply-add throughput (Neoverse V1: 4 x 128-bit NEON pipes = 2 x 256-bit SVE; V2/Grace and
// Graviton4: 128-bit SVE), and BFDOT by element exists in both; only 512-bit SVE (A64FX) would
// gain from SVE tiles.
#include "dense_gemm_neon.h"

extern "C" const DenseTable* armserve_dense_sve() {
  return armserve_dense::DenseGemm<armserve_dense::NeonP<>>::table("sve");
}

extern "C" const DenseTable* armserve_dense_sve_f32() {
  return armserve_dense::DenseGemm<armserve_dense::NeonP<true>>::table_f32("sve");
}

extern "C" const DenseTable* armserve_dense_sve_bf16() {
  return armserve_dense::DenseGemm<armserve_dense::NeonBf16P>::table("sve_bf16");
}
