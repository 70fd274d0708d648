// Scalar conversions between float32 and the 16-bit float types, shared by every kernel family
// (kernels_impl.h, dense_gemm_impl.h). Round to nearest even; NaN -> 0x7fc0 for bf16, as PyTorch.
// Branch-free, so loops of them vectorise for each TU's flags. Same rule as kernels_impl.h: an
// anonymous namespace, so no TU ever runs another TU's (differently compiled) copy.
#pragma once
#include <cstdint>
#include <cstring>

namespace armserve_conv {
namespace {

static inline float bf16_to_f32(uint16_t h) { return __builtin_bit_cast(float, uint32_t(h) << 16); }

static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(r);
}

// GCC 12 (Debian 12's aarch64-linux-gnu-g++) has no _Float16 in C++ on aarch64; its __fp16
// converts with the same IEEE fcvt instructions (round to nearest even).
#if defined(__aarch64__)
typedef __fp16 half_t;
#else
typedef _Float16 half_t;
#endif

static inline float f16_to_f32(uint16_t h) {
  half_t v;
  std::memcpy(&v, &h, 2);
  return float(v);
}

static inline uint16_t f32_to_f16(float f) {
  half_t v = half_t(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

}  // namespace
}  // namespace armserve_conv
