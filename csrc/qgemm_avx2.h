// Quantized GEMM tiles with AVX2: vpmaddubsw + vpmaddwd stand in for the VNNI dot product. A
// header so that the AVX-512 variant (qgemm_avx512.cpp) takes its W5 tiles from here: the one W5
// tile body on x86, run on this AVX2 code path wherever it is compiled (qgemm_avx2.cpp's table).
#pragma once
#include <immintrin.h>

#include "qembed_x86.h"
#include "qgemm_impl.h"

namespace {
using armserve::load4;
using armserve::chunk;
using armserve::w4_scales;
using armserve::w8_scales;
using armserve::w8h_chunk;
using armserve::w8h_scales;
using armserve::w5_chunk;
using armserve::w5_plane;
using armserve::w5_scales;
using armserve::kW5Group;
using armserve::kW5GroupBytes;
using armserve::w6_sc;
using armserve::w6_d;
using armserve::Plane;
using armserve::kW4;
using armserve::kW5;
using armserve::kW6;
using armserve::prefetch_ahead;

// Scales of 8 rows (h = 0: rows 0-7, 1: 8-15) of a W5 / W6 group g: float16 s, or d * sc (exact).
template <int F>
static inline __m256 plane_scales8(const uint8_t* wt, int64_t g, int h) {
  if constexpr (F == kW5)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w5_scales(wt, g) + h * 8)));
  const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w6_sc(wt, g) + h * 8));
  return _mm256_mul_ps(_mm256_loadu_ps(w6_d(wt, g) + h * 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
}

static inline __m256i dot4(__m256i u8, __m256i s8) {
  // u8 x s8 pairs summed to int16 (no saturation: |u| <= 127 or <= 15 here), then pairs to int32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1));
}

struct QAvx2 : EmbedRowsAvx2 {
  // NOTE: a vpmaddubsw lane (u4 x s8 pairs) is at most 2 * 15 * 127 = 3810 in magnitude, so the
  // lo and hi products of 4 chunks (8 lanes' worth, <= 30480) add up exactly in int16 and are
  // widened with one vpmaddwd per 4 chunks instead of one per product: on Zen 3 the two share
  // the multiply ports, which bound this loop once several tokens reuse each unpacked weight
  // (a speculative verify step, prefill). Integer sums: the result is unchanged, bit for bit.
  // W5 (F = kW5, group 32) and W6 (kW6, group 16): the same loop with each code's high bits ORed in
  // from the group's plane (qgemm.h); 16-bit shifts are exact here, as the mask keeps bits of the
  // byte's own only. u5 products reach 2 * 31 * 127 = 7874 a lane, so int16 sums span 2 chunks
  // instead of 4; u6 ones 2 * 63 * 127 = 16002, so 1 (a chunk's low and high products: 32004).
  template <int NT, int F>
  static void tile_nib(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    constexpr bool PL = Plane<F>::kBits > 0;
    constexpr int kBits = Plane<F>::kBits, kOffset = Plane<F>::kOffset;
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1),
                  high = _mm256_set1_epi8(char(((1 << kBits) - 1) << 4));
    constexpr int64_t kStep = F == kW6 ? 1 : F == kW5 ? 2 : 4;
    __m256 facc[NT][2];
    for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      __m256i ia[NT][2];
      for (int i = 0; i < NT; ++i) ia[i][0] = ia[i][1] = _mm256_setzero_si256();
      if constexpr (PL)
        prefetch_ahead(Plane<F>::stream(wt, g), Plane<F>::kStreamBytes);
      else
        prefetch_ahead(chunk(wt, g * group / 8, g), (group / 8 + 1) * 64);
      __m256i pl[2], pl4[2];  // W5 / W6: the plane's rows 0-7, 8-15, and shifted to put chunk 0's low code bits at 4
      if constexpr (PL)
        for (int h = 0; h < 2; ++h) {
          pl[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(Plane<F>::plane(wt, g) + h * 32));
          pl4[h] = _mm256_slli_epi16(pl[h], 4);
        }
      const int64_t c_first = g * group / 8, c_end = (g + 1) * group / 8;
      for (int64_t c0 = c_first; c0 < c_end; c0 += kStep) {
        const int64_t c1 = c0 + kStep < c_end ? c0 + kStep : c_end;
        __m256i s16[NT][2];
        for (int i = 0; i < NT; ++i) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
        for (int64_t c = c0; c < c1; ++c) {
          __m256i lo[2], hi[2];
          const uint8_t* cp;
          if constexpr (PL)
            cp = Plane<F>::chunk(wt, g, c - c_first);
          else
            cp = chunk(wt, c, g);
          for (int h = 0; h < 2; ++h) {  // rows 0-7, 8-15
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + h * 32));
            lo[h] = _mm256_and_si256(b, nib);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
            if constexpr (PL) {
              const __m128i cl = _mm_cvtsi64_si128(kBits * (c - c_first));
              lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(_mm256_srl_epi16(pl4[h], cl), high));
              hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(_mm256_srl_epi16(pl[h], cl), high));
            }
          }
          for (int i = 0; i < NT; ++i) {
            const __m256i qa = _mm256_set1_epi32(load4(q[i] + c * 8)), qb = _mm256_set1_epi32(load4(q[i] + c * 8 + 4));
            for (int h = 0; h < 2; ++h)
              s16[i][h] = _mm256_add_epi16(
                  s16[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], qa), _mm256_maddubs_epi16(hi[h], qb)));
          }
        }
        for (int i = 0; i < NT; ++i)
          for (int h = 0; h < 2; ++h) ia[i][h] = _mm256_add_epi32(ia[i][h], _mm256_madd_epi16(s16[i][h], ones));
      }
      for (int h = 0; h < 2; ++h) {
        if constexpr (PL) {  // the integer dot of (u - offset) and a, folded as tile_w8 folds its own
          const __m256 s = plane_scales8<F>(wt, g, h);
          for (int i = 0; i < NT; ++i) {
            const __m256i d = _mm256_sub_epi32(ia[i][h], _mm256_set1_epi32(kOffset * gs[i][g]));
            facc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(as[i][g])), _mm256_cvtepi32_ps(d), facc[i][h]);
          }
          continue;
        }
        const uint16_t* hs = w4_scales(wt, g, group);
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hs + h * 8)));
        const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hs + 16 + h * 8)));
        for (int i = 0; i < NT; ++i) {
          const __m256 sa = _mm256_set1_ps(as[i][g]);
          facc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, sa), _mm256_cvtepi32_ps(ia[i][h]), facc[i][h]);
          facc[i][h] = _mm256_fnmadd_ps(z, _mm256_set1_ps(as[i][g] * float(gs[i][g])), facc[i][h]);
        }
      }
    }
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(acc[i], facc[i][0]);
      _mm256_storeu_ps(acc[i] + 8, facc[i][1]);
    }
  }

  // Tokens one W5 tile pass takes (qgemm_impl.h tile_rows, which balances the passes: 8 rows go as
  // 4 + 4, 13 as 5 + 4 + 4), and one W4, W6 or W8 pass.
  static constexpr int kMaxTokens = 6, kMaxTokensW48 = 4;

  // W5 at 5-6 tokens: 16 registers hold the int16 sums of 4 tokens, so the tokens go in blocks of
  // at most 4 over each pair of chunks, whose weights are unpacked once (W5's unpacking, with its
  // bit plane, costs about as much as a token's products) into `wv` for both blocks: ~11% less
  // than 4 tokens and then the rest at 5 and 6 (Zen 3; at 7-8 the spilled sums cost more than a
  // second unpacking, hence kMaxTokens 6). W4 and W8 passes stay at 4 tokens: their weights cost
  // little to unpack or none, and each pass re-reads the 16-row tile from L1. The same integer sums
  // in another order (exact), then tile_nib's float folding: bit for bit the same outputs.
  template <int B>
  static void w5_block(__m256i (*wv)[2][2], const int8_t* const* q, int64_t c0, __m256i (*ia)[2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s16[B][2];
    for (int i = 0; i < B; ++i) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
    for (int c = 0; c < 2; ++c)
      for (int i = 0; i < B; ++i) {
        const __m256i qa = _mm256_set1_epi32(load4(q[i] + (c0 + c) * 8)),
                      qb = _mm256_set1_epi32(load4(q[i] + (c0 + c) * 8 + 4));
        for (int h = 0; h < 2; ++h)
          s16[i][h] = _mm256_add_epi16(s16[i][h], _mm256_add_epi16(_mm256_maddubs_epi16(wv[c][h][0], qa),
                                                                   _mm256_maddubs_epi16(wv[c][h][1], qb)));
      }
    for (int i = 0; i < B; ++i)
      for (int h = 0; h < 2; ++h) ia[i][h] = _mm256_add_epi32(ia[i][h], _mm256_madd_epi16(s16[i][h], ones));
  }

  template <int NT>
  static void tile_w5_wide(const uint8_t* wt, const int8_t* const* q, const float* const* as,
                           const int32_t* const* gs, int64_t k, float (*acc)[16]) {
    static_assert(NT > 4 && NT <= 8, "tile_nib takes up to 4 tokens, w5_block 4");
    const __m256i nib = _mm256_set1_epi8(0x0f), bit4 = _mm256_set1_epi8(0x10);
    __m256 facc[NT][2];
    for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / kW5Group; ++g) {
      __m256i ia[NT][2];
      for (int i = 0; i < NT; ++i) ia[i][0] = ia[i][1] = _mm256_setzero_si256();
      prefetch_ahead(w5_chunk(wt, g, 0), kW5GroupBytes);
      __m256i pl[2], pl4[2];
      for (int h = 0; h < 2; ++h) {
        pl[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w5_plane(wt, g) + h * 32));
        pl4[h] = _mm256_slli_epi16(pl[h], 4);
      }
      for (int64_t cl0 = 0; cl0 < 4; cl0 += 2) {  // (int16 sums span 2 chunks: tile_nib)
        __m256i wv[2][2][2];  // [chunk][rows 0-7, 8-15][low, high nibble codes with bit 4]
        for (int c = 0; c < 2; ++c) {
          const __m128i cl = _mm_cvtsi64_si128(cl0 + c);
          for (int h = 0; h < 2; ++h) {
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w5_chunk(wt, g, cl0 + c) + h * 32));
            wv[c][h][0] = _mm256_or_si256(_mm256_and_si256(b, nib), _mm256_and_si256(_mm256_srl_epi16(pl4[h], cl), bit4));
            wv[c][h][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nib),
                                          _mm256_and_si256(_mm256_srl_epi16(pl[h], cl), bit4));
          }
        }
        w5_block<4>(wv, q, g * 4 + cl0, ia);
        w5_block<NT - 4>(wv, q + 4, g * 4 + cl0, ia + 4);
      }
      const uint16_t* hs = w5_scales(wt, g);
      for (int h = 0; h < 2; ++h) {  // (tile_nib's W5 folding)
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hs + h * 8)));
        for (int i = 0; i < NT; ++i) {
          const __m256i d = _mm256_sub_epi32(ia[i][h], _mm256_set1_epi32(16 * gs[i][g]));
          facc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(as[i][g])), _mm256_cvtepi32_ps(d), facc[i][h]);
        }
      }
    }
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(acc[i], facc[i][0]);
      _mm256_storeu_ps(acc[i] + 8, facc[i][1]);
    }
  }

  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile_nib<NT, kW4>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w5(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    if constexpr (NT > 4)
      tile_w5_wide<NT>(wt, q, as, gs, k, acc);
    else
      tile_nib<NT, kW5>(wt, q, as, gs, k, group, acc);
  }
  // (W6 passes take at most 4 tokens: qgemm_impl.h tile_rows)
  template <int NT>
  static void tile_w6(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile_nib<NT, kW6>(wt, q, as, gs, k, group, acc);
  }

  // (H: the W8H layout, float16 scales: the same sums and float ops)
  template <int NT, bool H = false>
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    (void)gs;
    __m256 facc[NT][2];
    for (int i = 0; i < NT; ++i) facc[i][0] = facc[i][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / group; ++g) {
      __m256i ia[NT][2];
      for (int i = 0; i < NT; ++i) ia[i][0] = ia[i][1] = _mm256_setzero_si256();
      const int64_t c0 = g * group / 4;
      prefetch_ahead(H ? w8h_chunk(wt, c0, g) : chunk(wt, c0, g), (group / 4 + 1) * 64);
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        for (int h = 0; h < 2; ++h) {
          const uint8_t* cp = H ? w8h_chunk(wt, c, g) : chunk(wt, c, g);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp + h * 32));
          for (int i = 0; i < NT; ++i) {
            // a * w = |a| * (w * sign(a)): keeps maddubs' unsigned operand within 0..127
            const __m256i a = _mm256_set1_epi32(load4(q[i] + c * 4));
            ia[i][h] = _mm256_add_epi32(ia[i][h], dot4(_mm256_abs_epi8(a), _mm256_sign_epi8(w, a)));
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 s =
            H ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w8h_scales(wt, g, group) + h * 8)))
              : _mm256_loadu_ps(w8_scales(wt, g, group) + h * 8);
        for (int i = 0; i < NT; ++i)
          facc[i][h] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(as[i][g])), _mm256_cvtepi32_ps(ia[i][h]),
                                       facc[i][h]);
      }
    }
    for (int i = 0; i < NT; ++i) {
      _mm256_storeu_ps(acc[i], facc[i][0]);
      _mm256_storeu_ps(acc[i] + 8, facc[i][1]);
    }
  }
  template <int NT>
  static void tile_w8h(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    tile_w8<NT, true>(wt, q, as, gs, k, group, acc);
  }

};
}  // namespace
