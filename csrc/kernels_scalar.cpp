// Reference variant: plain C++, no SIMD flags. Always correct; every CPU can run it.
#include "kernels_impl.h"

namespace {
struct IsaScalar : armserve::ScalarOps {};
}  // namespace

extern "C" const KernelTable* armserve_table_scalar() {
  return armserve::Kernels<IsaScalar>::table("scalar");
}
