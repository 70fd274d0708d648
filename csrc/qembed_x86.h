// One row of a packed w4 / w8 table dequantized with 256-bit AVX2 (qgemm_impl.h ScalarQ has the
// reference and the rules): the quantized GEMM variants of x86 (qgemm_avx2.cpp, qgemm_avx512.cpp)
// inherit it. A row is 4 bytes of every 64-byte chunk of its tile (qgemm.h), so it is read 4 bytes
// at a time; an embedding gathers a few rows a step, so 256 bits are plenty on AVX-512 too.
#pragma once
#include <immintrin.h>

#include "qgemm_impl.h"

namespace {

struct EmbedRowsAvx2 {
  static void row_w4(const uint8_t* wt, int r, int64_t k, int64_t group, const float* exact, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* h = armserve::w4_scales(wt, g, group);
      const __m256 s = _mm256_set1_ps(exact ? exact[2 * g] : armserve::f16_to_f32(h[r]));
      const __m256 z = _mm256_set1_ps(exact ? exact[2 * g + 1] : armserve::f16_to_f32(h[16 + r]));
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        const int8_t* p = reinterpret_cast<const int8_t*>(armserve::chunk(wt, c, g)) + r * 4;
        const uint32_t b = uint32_t(armserve::load4(p));
        // bytes 0-3: the low nibbles (columns 8c .. 8c+3), bytes 4-7: the high ones (8c+4 .. 8c+7)
        const uint64_t u = uint64_t(b & 0x0f0f0f0fu) | (uint64_t((b >> 4) & 0x0f0f0f0fu) << 32);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(u))));
        _mm256_storeu_ps(out + c * 8, _mm256_sub_ps(_mm256_mul_ps(f, s), z));
      }
    }
  }

  static void row_w8(const uint8_t* wt, int r, int64_t k, int64_t group, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const __m128 s = _mm_set1_ps(armserve::w8_scales(wt, g, group)[r]);
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        const int32_t b = armserve::load4(reinterpret_cast<const int8_t*>(armserve::chunk(wt, c, g)) + r * 4);
        const __m128 f = _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(b)));
        _mm_storeu_ps(out + c * 4, _mm_mul_ps(f, s));
      }
    }
  }
};

}  // namespace
