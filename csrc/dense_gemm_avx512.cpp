// Dense GEMM with AVX-512: one zmm holds a 64-byte row of the packed bf16 layout (16 columns x one
// k-pair). With AVX512-BF16, vdpbf16ps multiplies it by the broadcast activation pair directly;
// without, the pair lanes widen to fp32 (<< 16, & 0xffff0000) for two FMAs. Float32 weights run
// the widening tiles with two plain loads in place of the widening.
#include <immintrin.h>

#include "dense_gemm_impl.h"

namespace {

#ifndef ARMSERVE_DENSE_AVX512_MR
#define ARMSERVE_DENSE_AVX512_MR 6
#define ARMSERVE_DENSE_AVX512_NB 4
#define ARMSERVE_DENSE_AVX512F_MR 4
#define ARMSERVE_DENSE_AVX512F_NB 4
#endif
#ifndef ARMSERVE_DENSE_STREAM_ROWS
#define ARMSERVE_DENSE_STREAM_ROWS 4
#endif

// AVX512-BF16. The attribute keeps vdpbf16ps out of every other function of this file; the table
// is only picked when the CPU has the instruction (dense_dispatch.cpp).
struct Avx512Bf16 : armserve_dense::PanelPrefetch<Avx512Bf16> {
  static constexpr bool kDot = true;
  // 6 x 4 accumulators (24 zmm) + 4 weight rows + a broadcast: 2 vdpbf16ps per cycle need ~12
  // independent chains in flight, and 10 loads per 24 vdpbf16ps stay well below the load ports
  // (measured on Zen 5 against 8 x 3, 12 x 2 and 4 x 4: within 3%, 6 x 4 best at m >= 16).
  static constexpr int MR = ARMSERVE_DENSE_AVX512_MR, NB = ARMSERVE_DENSE_AVX512_NB, kAlign = 1;
  static constexpr int kStreamRows = ARMSERVE_DENSE_STREAM_ROWS;
  template <int R, int B, bool kStream>  // (the tile: PanelPrefetch::tile)
  __attribute__((target("avx512f,avx512bf16"))) static void run(const void* xa, int64_t xs, const uint16_t* w,
                                                                 int64_t kp, float* acc, Share pf) {
    const uint32_t* x = static_cast<const uint32_t*>(xa);
    // One accumulator per (row, block), even at m = 1 where that is a single dependency chain:
    // its ~6-cycle latency still outpaces memory, and on a Xeon (1 thread, Qwen2.5-0.5B's layers)
    // it streamed 14.5 GB/s where 4 interleaved chains over consecutive k-pairs (an earlier choice,
    // from Zen 5) streamed 10.7; with the L2 prefetch (prefetch_stream) 17.4 against 12.9.
    __m512 c[R][B];
    ARMSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      ARMSERVE_UNROLL
      for (int b = 0; b < B; ++b) c[r][b] = _mm512_setzero_ps();
    const int64_t bs = kp * 32;
    for (int64_t p = 0; p < kp; ++p) {
      if (!kStream) pf.step();
      __m512bh wv[B];
      ARMSERVE_UNROLL
      for (int b = 0; b < B; ++b) {
        if (kStream) armserve_dense::prefetch_stream(w + b * bs + p * 32);
        wv[b] = (__m512bh)_mm512_loadu_si512(w + b * bs + p * 32);
      }
      ARMSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(int(x[r * xs + p]));
        ARMSERVE_UNROLL
        for (int b = 0; b < B; ++b) c[r][b] = _mm512_dpbf16_ps(c[r][b], wv[b], xv);
      }
    }
    ARMSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      ARMSERVE_UNROLL
      for (int b = 0; b < B; ++b) _mm512_storeu_ps(acc + (r * B + b) * 16, c[r][b]);
  }
};

// F32: float32 weights (the float32 layout: a k-pair is two zmm, 16 even-k then 16 odd-k
// weights) and float32 activations, the same tiles without the widening.
template <bool F32>
struct Avx512 : armserve_dense::PanelPrefetch<Avx512<F32>> {
  using Share = typename armserve_dense::PanelPrefetch<Avx512<F32>>::Share;
  static constexpr int kWeightBytes = F32 ? 4 : 2;
  static constexpr bool kDot = false;
  // Widening: 2 FMAs and 2 integer ops per weight row, R * B + 2 B + 2 = 26 registers at 4 x 4
  // (FMA-bound: ~245 GFLOP/s on Zen 5, half of vdpbf16ps; 4 x 4 beat 6 x 3, 8 x 2 and 6 x 2).
  static constexpr int MR = ARMSERVE_DENSE_AVX512F_MR, NB = ARMSERVE_DENSE_AVX512F_NB, kAlign = 1;
  static constexpr int kStreamRows = ARMSERVE_DENSE_STREAM_ROWS;
  // Each output sums in one order whatever the tile's shape, so that a row gets the same bits
  // alone as among others (avx2's tile says why). Widened bf16: (even-k chain) + (odd-k chain),
  // both in registers for a few accumulators (m = 1, 2), in two passes over the panel for larger
  // tiles. float32: one chain, even and odd k in turn (SET 3): two passes cost the 4 x 4 tile
  // 12-18% (252 -> 223 GFLOP/s at 128 x 1536 x 384, Zen 5), and one chain of a one-row tile still
  // streams 64 bytes of weights per 4-cycle FMA, faster than memory.
  template <int R, int B, bool kStream>  // (the tile: PanelPrefetch::tile)
  static void run(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc, Share pf) {
    armserve_dense::PanelPrefetch<Avx512<F32>>::template run_in_order<R, B, kStream, F32, (R * B <= 8)>(xa, xs, w, kp, acc, pf);
  }
  // SET 0: the even-k chain into acc; 1: the odd-k chain added to acc; 2: both, in registers;
  // 3: one chain over both.
  template <int R, int B, bool kStream, int SET>
  static void pass(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc, Share pf) {
    const float* x = static_cast<const float*>(xa);
    const float* wf = reinterpret_cast<const float*>(w);
    const __m512i hi = _mm512_set1_epi32(int(0xffff0000u));
    constexpr bool kEven = SET != 1, kOdd = SET != 0;
    __m512 c[R][B], d[R][B];
    ARMSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      ARMSERVE_UNROLL
      for (int b = 0; b < B; ++b) c[r][b] = d[r][b] = _mm512_setzero_ps();
    const int64_t bs = kp * 32;  // a block, in weights
    for (int64_t p = 0; p < kp; ++p) {
      if (!kStream && SET != 1) pf.step();
      __m512 we[B], wo[B];
      ARMSERVE_UNROLL
      for (int b = 0; b < B; ++b) {
        if constexpr (F32) {
          const float* src = wf + b * bs + p * 32;
          if (kStream) {
            armserve_dense::prefetch_stream(src);
            armserve_dense::prefetch_stream(src + 16);
          }
          if (kEven) we[b] = _mm512_loadu_ps(src);
          if (kOdd) wo[b] = _mm512_loadu_ps(src + 16);
        } else {
          if (kStream) armserve_dense::prefetch_stream(w + b * bs + p * 32);
          const __m512i v = _mm512_loadu_si512(w + b * bs + p * 32);
          if (kEven) we[b] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
          if (kOdd) wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        }
      }
      ARMSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        __m512 x0, x1;
        if (kEven) x0 = _mm512_set1_ps(x[r * xs + 2 * p]);
        if (kOdd) x1 = _mm512_set1_ps(x[r * xs + 2 * p + 1]);
        ARMSERVE_UNROLL
        for (int b = 0; b < B; ++b) {
          if (kEven) c[r][b] = _mm512_fmadd_ps(we[b], x0, c[r][b]);
          if (SET == 3) c[r][b] = _mm512_fmadd_ps(wo[b], x1, c[r][b]);
          else if (kOdd) d[r][b] = _mm512_fmadd_ps(wo[b], x1, d[r][b]);
        }
      }
    }
    ARMSERVE_UNROLL
    for (int r = 0; r < R; ++r)
      ARMSERVE_UNROLL
      for (int b = 0; b < B; ++b) {
        float* o = acc + (r * B + b) * 16;
        if (SET == 2) _mm512_storeu_ps(o, _mm512_add_ps(c[r][b], d[r][b]));
        if (SET == 0 || SET == 3) _mm512_storeu_ps(o, c[r][b]);
        if (SET == 1) _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), d[r][b]));
      }
  }
};
}  // namespace

extern "C" const DenseTable* armserve_dense_avx512() {
  return armserve_dense::DenseGemm<Avx512<false>>::table("avx512");
}

extern "C" const DenseTable* armserve_dense_avx512_f32() {
  return armserve_dense::DenseGemm<Avx512<true>>::table_f32("avx512");
}

extern "C" const DenseTable* armserve_dense_avx512_bf16() {
  return armserve_dense::DenseGemm<Avx512Bf16>::table("avx512_bf16");
}
