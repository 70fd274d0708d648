// Quantized GEMM, reference variant (no SIMD flags).
#include "qgemm_impl.h"

extern "C" const QKernelTable* armserve_qtable_scalar() {
  return armserve::QKernels<armserve::ScalarOps, armserve::ScalarQ>::table("scalar");
}
