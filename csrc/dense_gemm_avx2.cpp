// Dense GEMM with AVX2 + FMA: a 16-column bf16 block is two ymm halves of 8 k-pair lanes, each
// widened to fp32 (<< 16 for even k, & 0xffff0000 for odd k) for two FMAs per activation row;
// float32 weights are loaded as they are.
#include <immintrin.h>

#include "dense_gemm_impl.h"

namespace {
#ifndef ARMSERVE_DENSE_AVX2_MR
#define ARMSERVE_DENSE_AVX2_MR 5
#endif
// F32: float32 weights (a block's k-pair: 16 even-k then 16 odd-k weights, two ymm each) and
// float32 activations, the same tiles with plain loads in place of the widening.
template <bool F32>
struct Avx2 : armserve_dense::PanelPrefetch<Avx2<F32>> {
  using Share = typename armserve_dense::PanelPrefetch<Avx2<F32>>::Share;
  static constexpr int kWeightBytes = F32 ? 4 : 2;
  static constexpr bool kDot = false;
  // 5 rows x 1 block, a pass: 10 accumulators + 2 weight halves + 1 broadcast of 16 ymm; 10
  // chains hide the FMA latency (4 rows: 8 chains, 76 GFLOP/s; 5 rows: 109 on Zen 5).
  static constexpr int MR = ARMSERVE_DENSE_AVX2_MR, NB = 1, kAlign = 1, kStreamRows = 0;
  // Each output sums in one order whatever the tile's shape, so that a row gets the same bits alone
  // (a decode step) as among others (a speculative verify step, a batch), which greedy decoding
  // with and without speculation needs (PanelPrefetch::run_in_order). Widened bf16: (even-k chain)
  // + (odd-k chain), both in registers for few accumulators (m = 1, 2: one chain of 2 FMAs a step
  // is latency-bound, 14 GB/s at m = 1), else in two passes over the panel, each widening only its
  // half. float32: one chain, even and odd k in turn (128 weight bytes a step: faster than memory).
  template <int R, int B, bool kStream>  // (the tile: PanelPrefetch::tile)
  static void run(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc, Share pf) {
    armserve_dense::PanelPrefetch<Avx2<F32>>::template run_in_order<R, B, kStream, F32, (R * 2 * B <= 4)>(xa, xs, w, kp, acc, pf);
  }
  // SET 0: the even-k chain into acc; 1: the odd-k chain added to acc; 2: both, in registers;
  // 3: one chain over both.
  template <int R, int B, bool kStream, int SET>
  static void pass(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc, Share pf) {
    const float* x = static_cast<const float*>(xa);
    const float* wf = reinterpret_cast<const float*>(w);
    const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
    constexpr int H = 2 * B;
    constexpr bool kEven = SET != 1, kOdd = SET != 0;
    __m256 c[R][H], d[R][H];
    ARMSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      ARMSERVE_UNROLL
      for (int h = 0; h < H; ++h) c[r][h] = d[r][h] = _mm256_setzero_ps();
    const int64_t bs = kp * 32;  // a block, in weights
    for (int64_t p = 0; p < kp; ++p) {
      __m256 we[H], wo[H];
      if (kStream)
        ARMSERVE_UNROLL
        for (int b = 0; b < B; ++b) {
          if constexpr (F32) {
            armserve_dense::prefetch_stream(wf + b * bs + p * 32);
            armserve_dense::prefetch_stream(wf + b * bs + p * 32 + 16);
          } else {
            armserve_dense::prefetch_stream(w + b * bs + p * 32);
          }
        }
      else if (SET != 1)
        pf.step();
      ARMSERVE_UNROLL
      for (int h = 0; h < H; ++h) {
        if constexpr (F32) {  // columns 8 (h % 2) .. + 7 of block h / 2
          const float* src = wf + (h / 2) * bs + p * 32 + (h % 2) * 8;
          if (kEven) we[h] = _mm256_loadu_ps(src);
          if (kOdd) wo[h] = _mm256_loadu_ps(src + 16);
        } else {
          const uint16_t* src = w + (h / 2) * bs + p * 32 + (h % 2) * 16;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
          if (kEven) we[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
          if (kOdd) wo[h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        }
      }
      ARMSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        __m256 x0, x1;
        if (kEven) x0 = _mm256_broadcast_ss(x + r * xs + 2 * p);
        if (kOdd) x1 = _mm256_broadcast_ss(x + r * xs + 2 * p + 1);
        ARMSERVE_UNROLL
        for (int h = 0; h < H; ++h) {
          if (kEven) c[r][h] = _mm256_fmadd_ps(we[h], x0, c[r][h]);
          if (SET == 3) c[r][h] = _mm256_fmadd_ps(wo[h], x1, c[r][h]);
          else if (kOdd) d[r][h] = _mm256_fmadd_ps(wo[h], x1, d[r][h]);
        }
      }
    }
    ARMSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      ARMSERVE_UNROLL
      for (int h = 0; h < H; ++h) {
        float* o = acc + r * B * 16 + h * 8;
        if (SET == 2) _mm256_storeu_ps(o, _mm256_add_ps(c[r][h], d[r][h]));
        if (SET == 0 || SET == 3) _mm256_storeu_ps(o, c[r][h]);
        if (SET == 1) _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), d[r][h]));
      }
  }
};
}  // namespace

extern "C" const DenseTable* armserve_dense_avx2() { return armserve_dense::DenseGemm<Avx2<false>>::table("avx2"); }

extern "C" const DenseTable* armserve_dense_avx2_f32() {
  return armserve_dense::DenseGemm<Avx2<true>>::table_f32("avx2");
}
