// Quantized GEMM with AVX512-VNNI: vpdpbusd multiplies 4 unsigned by 4 signed bytes per
// 32-bit lane, so one instruction does 16 rows x 4 columns of a tile. The W5 tiles (GGUF Q5_0)
// are the AVX2 ones (qgemm_avx2.h), inherited: decode streams them at memory speed either way, and
// a body no machine of ours can run is never shipped untested.
#include <immintrin.h>

#include "qgemm_avx2.h"

namespace {
using armserve::load4;
using armserve::chunk;
using armserve::w4_scales;
using armserve::w8_scales;

struct QAvx512 : QAvx2 {
  // (VNNI's tiles below, and the W5 ones they inherit, take up to 4 tokens a pass, as when they
  // were measured; AVX2's 6 are for its costlier unpacking)
  static constexpr int kMaxTokens = 4;

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
      // Unrolled (group 32: 4 chunks): the rolled loop kept shuffling the accumulators between
      // registers and cost ~15% of the tile at 1 thread (perf annotate).
#pragma GCC unroll 4
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        const __m512i b = _mm512_loadu_si512(chunk(wt, c, g));
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
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    (void)gs;
    // a * w = |a| * (w * sign(a)): |a| is VNNI's unsigned operand and the weight bytes facing a
    // negative activation are negated (|a|, |w| <= 127: no overflow), so no offset correction.
    __m512 facc[NT];
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      __m512i ia[NT], ib[NT];  // even and odd chunks in two dependency chains (see tile_w4)
      for (int i = 0; i < NT; ++i) ia[i] = ib[i] = _mm512_setzero_si512();
      int64_t c = g * group / 4;
      const int64_t end = (g + 1) * group / 4;
#pragma GCC unroll 4
      for (; c + 2 <= end; c += 2) {
        const __m512i b0 = _mm512_loadu_si512(chunk(wt, c, g)), b1 = _mm512_loadu_si512(chunk(wt, c + 1, g));
        for (int i = 0; i < NT; ++i) {
          ia[i] = step(ia[i], b0, load4(q[i] + c * 4));
          ib[i] = step(ib[i], b1, load4(q[i] + c * 4 + 4));
        }
      }
      if (c < end) {
        const __m512i b = _mm512_loadu_si512(chunk(wt, c, g));
        for (int i = 0; i < NT; ++i) ia[i] = step(ia[i], b, load4(q[i] + c * 4));
      }
      const __m512 s = _mm512_loadu_ps(w8_scales(wt, g, group));
      for (int i = 0; i < NT; ++i)
        facc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(as[i][g])),
                                  _mm512_cvtepi32_ps(_mm512_add_epi32(ia[i], ib[i])), facc[i]);
    }
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(acc[i], facc[i]);
  }

  static __m512i step(__m512i acc, __m512i w, int32_t a4) {
    const __m512i a = _mm512_set1_epi32(a4);
    const __m512i ws = _mm512_mask_sub_epi8(w, _mm512_movepi8_mask(a), _mm512_setzero_si512(), w);
    return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(a), ws);
  }
};
}  // namespace

extern "C" const QKernelTable* armserve_qtable_avx512() {
  return armserve::QKernels<armserve::ScalarOps, QAvx512>::table("avx512_vnni");
}
