// LoRA expand's short dots with 256-bit AVX2 + FMA, shared by the x86 variants (kernels_avx2.cpp,
// kernels_avx512.cpp: ymm, not zmm, since LoRA ranks are multiples of 8, not always of 16). Each
// includer compiles its own copy (anonymous namespace) with its own ISA flags.
#pragma once
#include <immintrin.h>

#include "kernels_impl.h"

namespace {

struct DotsAvx2 {
  // 8 rows side by side: 8 accumulators over k, then one transposing reduction (hadd tree).
  static void dots(const float* rows, int64_t ld, const float* v, int64_t k, float* out, int64_t n) {
    const int64_t k8 = k & ~int64_t(7);
    int64_t c = 0;
    if (k8 == k)
      for (; c + 8 <= n; c += 8) {
        const float* r = rows + c * ld;
        __m256 a[8];
        for (int q = 0; q < 8; ++q) a[q] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k8; i += 8) {
          const __m256 vi = _mm256_loadu_ps(v + i);
          for (int q = 0; q < 8; ++q) a[q] = _mm256_fmadd_ps(_mm256_loadu_ps(r + q * ld + i), vi, a[q]);
        }
        // hadd pairs: lane groups hold (row q's partial sums) for q = 0..7, 128-bit halves apart
        const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
        const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
        const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
        const __m256 lo = _mm256_permute2f128_ps(h0123, h4567, 0x20), hi = _mm256_permute2f128_ps(h0123, h4567, 0x31);
        _mm256_storeu_ps(out + c, _mm256_add_ps(lo, hi));
      }
    if (c < n) armserve::ScalarOps::dots(rows + c * ld, ld, v, k, out + c, n - c);
  }
};

}  // namespace
