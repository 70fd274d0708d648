// Quantized GEMM with AVX512-VNNI: vpdpbusd multiplies 4 unsigned by 4 signed bytes per
// 32-bit lane, so one instruction does 16 rows x 4 columns of a tile. The W5 / W6 tiles (GGUF
// Q5_0 / Q6_K) unpack each code with its high bits once per chunk, as AVX2's (qgemm_avx2.h), and
// then take every token's products with vpdpbusd; the embedding rows are AVX2's.
#include <immintrin.h>

#include "qgemm_avx2.h"

namespace {
// (load4, chunk, the scale and W5 layout helpers, prefetch_ahead: qgemm_avx2.h's usings)
struct QAvx512 : QAvx2 {
  // W5 takes up to 8 tokens a pass (its own tile_w5 below, as W6's; 8 x 2 int32 chains + 8 float
  // sums fit the 32 registers).
  static constexpr int kMaxTokens = 8;
  // W4 and W8 take up to 8 tokens a pass: 8 x 2 int32 chains + 8 float sums fit the 32 registers,
  // and past 4 tokens a second pass over each tile cost as much as the first.
  static constexpr int kMaxTokensW48 = 8;

  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    const __m512i nib = _mm512_set1_epi8(0x0f);
    __m512 facc[NT];
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      prefetch_ahead(chunk(wt, g * group / 8, g), (group / 8 + 1) * 64);
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

  // W5 (group 32, qgemm.h) and W6 (group 16): a chunk's low and high nibbles per row, each ORed with
  // its high bits from the group's plane (plane byte j of a row: bits kBits * cl of the low-nibble
  // code of byte j in chunk cl, 4 + kBits * cl of the high one; 16-bit shifts stay exact under the
  // mask), unsigned codes against the signed activations, then (u - offset) a as sum(u a) - offset
  // (code sum). The same integer sums as AVX2's maddubs tiles, folded the same way: the same
  // outputs, with a token's products one vpdpbusd per half chunk instead of 4 instructions.
  template <int F, int NT>
  static void tile_plane(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                         int64_t k, float (*acc)[16]) {
    using P = Plane<F>;
    const __m512i nib = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(char(((1 << P::kBits) - 1) << 4));
    __m512 facc[NT];
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / P::kGroup; ++g) {
      __m512i ia[NT], ib[NT];
      for (int i = 0; i < NT; ++i) ia[i] = ib[i] = _mm512_setzero_si512();
      prefetch_ahead(P::stream(wt, g), P::kStreamBytes);
      const __m512i pl = _mm512_loadu_si512(P::plane(wt, g)), pl4 = _mm512_slli_epi16(pl, 4);
#pragma GCC unroll 4
      for (int cl = 0; cl < P::kGroup / 8; ++cl) {
        const __m512i b = _mm512_loadu_si512(P::chunk(wt, g, cl));
        const __m128i sh = _mm_cvtsi32_si128(P::kBits * cl);
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(b, nib), _mm512_and_si512(_mm512_srl_epi16(pl4, sh), high));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), nib),
                                           _mm512_and_si512(_mm512_srl_epi16(pl, sh), high));
        const int64_t c = g * P::kGroup / 8 + cl;
        for (int i = 0; i < NT; ++i) {
          ia[i] = _mm512_dpbusd_epi32(ia[i], lo, _mm512_set1_epi32(load4(q[i] + c * 8)));
          ib[i] = _mm512_dpbusd_epi32(ib[i], hi, _mm512_set1_epi32(load4(q[i] + c * 8 + 4)));
        }
      }
      __m512 s;
      if constexpr (F == kW5) {
        s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w5_scales(wt, g))));
      } else {  // d * sc, exact
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w6_sc(wt, g)));
        s = _mm512_mul_ps(_mm512_loadu_ps(w6_d(wt, g)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      }
      for (int i = 0; i < NT; ++i) {
        const __m512i d =
            _mm512_sub_epi32(_mm512_add_epi32(ia[i], ib[i]), _mm512_set1_epi32(P::kOffset * gs[i][g]));
        facc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(as[i][g])), _mm512_cvtepi32_ps(d), facc[i]);
      }
    }
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(acc[i], facc[i]);
  }
  template <int NT>
  static void tile_w5(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    (void)group;
    tile_plane<kW5, NT>(wt, q, as, gs, k, acc);
  }
  template <int NT>
  static void tile_w6(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    (void)group;
    tile_plane<kW6, NT>(wt, q, as, gs, k, acc);
  }

  // (H: the W8H layout, float16 scales: the same sums and float ops)
  template <int NT, bool H = false>
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    // w * a = (w + 128) * a - 128 a: the weight bytes flipped to unsigned (one xor per chunk, shared
    // by every token) are VNNI's unsigned operand and the activations its signed one; vpdpbusd
    // sums into int32 without saturating, and the 128 * (the group's code sum) comes off once a
    // group. The same integer sums as sign-flipping each token's weights (|a| * (w * sign(a)), the
    // AVX2 way, 4 more instructions per token and chunk), so the same outputs: a verify step's 5 to
    // 13 rows cost 0.25-0.4x a one-row step each with it, ~1.1x without (Qwen2.5's LM head, Zen 5).
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    __m512 facc[NT];
    for (int i = 0; i < NT; ++i) facc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      __m512i ia[NT], ib[NT];  // even and odd chunks in two dependency chains (see tile_w4)
      for (int i = 0; i < NT; ++i) ia[i] = ib[i] = _mm512_setzero_si512();
      int64_t c = g * group / 4;
      const int64_t end = (g + 1) * group / 4;
      auto at = [&](int64_t cc) { return H ? w8h_chunk(wt, cc, g) : chunk(wt, cc, g); };
      prefetch_ahead(at(c), (group / 4 + 1) * 64);
#pragma GCC unroll 4
      for (; c + 2 <= end; c += 2) {
        const __m512i b0 = _mm512_xor_si512(_mm512_loadu_si512(at(c)), flip);
        const __m512i b1 = _mm512_xor_si512(_mm512_loadu_si512(at(c + 1)), flip);
        for (int i = 0; i < NT; ++i) {
          ia[i] = _mm512_dpbusd_epi32(ia[i], b0, _mm512_set1_epi32(load4(q[i] + c * 4)));
          ib[i] = _mm512_dpbusd_epi32(ib[i], b1, _mm512_set1_epi32(load4(q[i] + c * 4 + 4)));
        }
      }
      if (c < end) {
        const __m512i b = _mm512_xor_si512(_mm512_loadu_si512(at(c)), flip);
        for (int i = 0; i < NT; ++i) ia[i] = _mm512_dpbusd_epi32(ia[i], b, _mm512_set1_epi32(load4(q[i] + c * 4)));
      }
      const __m512 s =
          H ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w8h_scales(wt, g, group))))
            : _mm512_loadu_ps(w8_scales(wt, g, group));
      for (int i = 0; i < NT; ++i) {
        const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(ia[i], ib[i]), _mm512_set1_epi32(128 * gs[i][g]));
        facc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(as[i][g])), _mm512_cvtepi32_ps(isum), facc[i]);
      }
    }
    for (int i = 0; i < NT; ++i) _mm512_storeu_ps(acc[i], facc[i]);
  }
  template <int NT>
  static void tile_w8h(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    tile_w8<NT, true>(wt, q, as, gs, k, group, acc);
  }

};
}  // namespace

extern "C" const QKernelTable* armserve_qtable_avx512() {
  return armserve::QKernels<armserve::ScalarOps, QAvx512>::table("avx512_vnni");
}
