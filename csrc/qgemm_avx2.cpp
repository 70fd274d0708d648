// Quantized GEMM with AVX2 (the tiles: qgemm_avx2.h).
#include "qgemm_avx2.h"

extern "C" const QKernelTable* armserve_qtable_avx2() {
  return armserve::QKernels<armserve::ScalarOps, QAvx2>::table("avx2");
}
