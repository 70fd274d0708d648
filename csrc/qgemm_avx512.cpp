// Quantized GEMM with AVX512-VNNI: vpdpbusd multiplies 4 unsigned by 4 signed bytes per
// 32-bit lane, so one instruction does 16 rows x 4 columns of a tile.
#include <immintrin.h>

#include "qgemm_impl.h"

namespace {
using armserve::load4;
using armserve::w4_chunk;
using armserve::w4_scales;

struct QAvx512 {
  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 facc[NT];
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      // Low and high nibbles accumulate separately: two dependency chains of vpdpbusd instead of
      // one, which otherwise caps a single token's tile at its latency, well below memory speed.
      __m512i ia[NT], ib[NT];
      for (int i = 0; i < NT; ++i) ia[i] = ib[i] = _mm512_setzero_si512();
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        const __m512i b = _mm512_loadu_si512(w4_chunk(wt, c, g));
        const __m512i lo = _mm512_and_si512(b, nib);  // weights are the unsigned operand
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
        for (int i = 0; i < NT; ++i) {
          ia[i] = _mm512_dpbusd_epi32(ia[i], lo, _mm512_set1_epi32(load4(q[i] + c * 8)));
          ib[i] = _mm512_dpbusd_epi32(ib[i], hi, _mm512_set1_epi32(load4(q[i] + c * 8 + 4)));
        }
      }
      for (int i = 0; i < NT; ++i) ia[i] = _mm512_add_epi32(ia[i], ib[i]);
      const uint16_t* h = w4_scales(wt, g, group);
      const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
      const __m512 z = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16)));
      for (int i = 0; i < NT; ++i) {
        const __m512 sa = _mm512_set1_ps(as[i][g]);
        facc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, sa), _mm512_cvtepi32_ps(ia[i]), facc[i]);
        facc[i] = _mm512_fnmadd_ps(z, _mm512_set1_ps(as[i][g] * float(gs[i][g])), facc[i]);
      }
    }
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(acc[i], facc[i]);
  }

  template <int NT>
  static void tile_w8(const uint8_t* wt, const float* sc, const int8_t* const* q, const float* const* as,
                      const int32_t* const* gs, int64_t k,
                      int64_t group, float (*acc)[16]) {
    (void)gs;
    // Activations become the unsigned operand by adding 128 (xor of the sign bit); the
    // packed `corr` = s * 128 * sum(w) takes the offset back out once per group.
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    __m512 facc[NT];
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      // even and odd chunks in two dependency chains (see tile_w4)
      __m512i ia[NT], ib[NT];
      for (int i = 0; i < NT; ++i) ia[i] = ib[i] = _mm512_setzero_si512();
      int64_t c = g * group / 4;
      const int64_t end = (g + 1) * group / 4;
      for (; c + 2 <= end; c += 2) {
        const __m512i b0 = _mm512_loadu_si512(wt + c * 64), b1 = _mm512_loadu_si512(wt + c * 64 + 64);
        for (int i = 0; i < NT; ++i) {
          ia[i] = _mm512_dpbusd_epi32(ia[i], _mm512_xor_si512(_mm512_set1_epi32(load4(q[i] + c * 4)), flip), b0);
          ib[i] = _mm512_dpbusd_epi32(ib[i], _mm512_xor_si512(_mm512_set1_epi32(load4(q[i] + c * 4 + 4)), flip), b1);
        }
      }
      if (c < end) {  // group of 4 columns (one chunk)
        const __m512i b = _mm512_loadu_si512(wt + c * 64);
        for (int i = 0; i < NT; ++i)
          ia[i] = _mm512_dpbusd_epi32(ia[i], _mm512_xor_si512(_mm512_set1_epi32(load4(q[i] + c * 4)), flip), b);
      }
      for (int i = 0; i < NT; ++i) ia[i] = _mm512_add_epi32(ia[i], ib[i]);
      const __m512 s = _mm512_loadu_ps(sc + g * 32), z = _mm512_loadu_ps(sc + g * 32 + 16);
      for (int i = 0; i < NT; ++i)
        facc[i] = _mm512_fmadd_ps(_mm512_set1_ps(as[i][g]), _mm512_fmsub_ps(s, _mm512_cvtepi32_ps(ia[i]), z), facc[i]);
    }
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(acc[i], facc[i]);
  }
};
}  // namespace

extern "C" const QKernelTable* armserve_qtable_avx512() {
  return armserve::QKernels<armserve::ScalarOps, QAvx512>::table("avx512_vnni");
}
