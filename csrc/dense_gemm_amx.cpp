// Dense bf16 GEMM with Intel AMX (TDPBF16PS): 16 x 16 fp32 += 16 x 32 bf16 times 32 x 16 bf16 per
// instruction, 16x the multiply-adds of a vdpbf16ps.
//
// The packed layout of dense_gemm.h is AMX's weight operand as it is: 16 consecutive k-pair rows of
// a column block (16 x 64 bytes, contiguous) are one B tile, so the weights need no repacking. The
// activations are bf16 pairs, rows padded to 16 pairs (a 64-byte A tile row) and to a multiple of
// 16 rows (an A tile's height), both with zeros, by the driver (kAlign, kRowPad). A tile of
// 32 rows x 2 column blocks keeps 4 C tiles (tmm0-3) over the whole K; tmm4-5 hold the two A
// tiles and tmm6-7 the two B tiles of a step.
//
// Linux hands AMX's tile data to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM): until
// then the first tile instruction is fatal. armserve_amx_ready() asks once; the table is picked
// only when it said yes (dense_dispatch.cpp). Every thread loads the tile configuration (amx.h) at
// the start of each panel and releases the tiles after it.
#include <immintrin.h>

#include <cstring>

#include "amx.h"
#include "dense_gemm_impl.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// Rows below this go to the AVX512-BF16 tiles, which stream the weights faster (measured on a
// Xeon with AMX, 1 thread, N x K = 1536 x 576 / 4864 x 896: 1 row 40 vs 51 us and 418 vs 388 us,
// 2 rows even, from 4 rows AMX ahead: 8 rows 53 vs 152 us, 32 rows 81 vs 575 us).
#ifndef ARMSERVE_AMX_MIN_ROWS
#define ARMSERVE_AMX_MIN_ROWS 3
#endif

struct AmxBf16 : armserve_dense::PanelPrefetch<AmxBf16> {
  static constexpr bool kDot = true, kSelfStream = false;
  static constexpr int MR = 32, NB = 2, kAlign = 16, kStreamRows = 0, kRowPad = 16;

  static void begin() { armserve_amx::begin(); }  // every tile 16 rows x 64 bytes (amx.h)
  static void end() {
    armserve_amx::end();
    pf_lines = 0;
  }

  // bf16 outputs through vcvtne2ps2bf16 (every AMX CPU has AVX512-BF16): round to nearest even,
  // one instruction per 32 outputs where the integer rounding of store_row takes ~12 per 16. NaN
  // becomes 0x7fc0 as in store_row and PyTorch; unlike them, the instruction flushes fp32 values
  // below 2^-126 to zero (sums that small do not occur in a layer's output).
  __attribute__((target("avx512bf16"))) static void store(int32_t out_dtype, const float* acc, int64_t stride,
                                                          int rows, void* out, int64_t ldo, int64_t cols) {
    if (out_dtype == AS_F32 || (cols != 32 && cols != 16)) {
      TileBase::store(out_dtype, acc, stride, rows, out, ldo, cols);
      return;
    }
    const __m512i qnan = _mm512_set1_epi16(0x7fc0);
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int r = 0; r < rows; ++r, acc += stride, o += ldo) {
      const __m512 lo = _mm512_loadu_ps(acc);
      const __mmask16 nlo = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q);
      if (cols == 32) {
        const __m512 hi = _mm512_loadu_ps(acc + 16);
        const __mmask32 nan = _mm512_kunpackw(_mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q), nlo);
        const __m512i v = _mm512_mask_mov_epi16((__m512i)_mm512_cvtne2ps_pbh(hi, lo), nan, qnan);
        _mm512_storeu_si512(o, v);
      } else {
        const __m256i v = _mm256_mask_mov_epi16((__m256i)_mm512_cvtneps_pbh(lo), nlo, _mm512_castsi512_si256(qnan));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), v);
      }
    }
  }

  // One K step of 16 pairs: A tiles at `xp` (rows `xstride` bytes apart), B tiles at `wp` and
  // `wp + bs` (rows 64 bytes apart).
  template <int RA, int B>
  __attribute__((target("amx-tile,amx-bf16"))) static inline void step(const char* xp, int64_t xstride,
                                                                         const char* wp, int64_t bs) {
    _tile_loadd(4, xp, xstride);
    if (RA > 1) _tile_loadd(5, xp + 16 * xstride, xstride);
    _tile_loadd(6, wp, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (RA > 1) _tile_dpbf16ps(2, 5, 6);
    if (B > 1) {
      _tile_loadd(7, wp + bs, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (RA > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }

  template <int R, int B>
  __attribute__((target("amx-tile,amx-bf16"))) static void tile(const void* xa, int64_t xs, const uint16_t* w,
                                                                 int64_t kp, float* acc) {
    constexpr int RA = (R + 15) / 16;  // rows past R are padding rows of the activations
    const char* x = static_cast<const char*>(xa);
    const char* wb = reinterpret_cast<const char*>(w);
    const int64_t xstride = xs * 4, bs = kp * 64, kfull = kp / 16 * 16;
    armserve_amx::fence();  // the activations may have been written just now (amx.h)
    _tile_zero(0);
    if (B > 1) _tile_zero(1);
    if (RA > 1) _tile_zero(2);
    if (RA > 1 && B > 1) _tile_zero(3);
    Share pf = take(kfull / 16 > 0 ? kfull / 16 : 1);  // the next panel, to L2 (PanelPrefetch)
    if (pf.left > 0) {
      for (int64_t p = 0; p < kfull; p += 16) {
        pf.step();
        step<RA, B>(x + p * 4, xstride, wb + p * 64, bs);
      }
    } else {
      for (int64_t p = 0; p < kfull; p += 16) step<RA, B>(x + p * 4, xstride, wb + p * 64, bs);
    }
    if (kp > kfull) {
      // K tail: the weight blocks end after kp pair rows, so the B tiles come from a zero-padded
      // copy (the activations there are padding zeros already, but whatever the weights would
      // read past their block is not: 0 x NaN).
      alignas(64) uint8_t tail[B][1024];
      for (int b = 0; b < B; ++b) {
        std::memcpy(tail[b], wb + b * bs + kfull * 64, size_t(kp - kfull) * 64);
        std::memset(tail[b] + (kp - kfull) * 64, 0, size_t(16 - (kp - kfull)) * 64);
      }
      armserve_amx::fence();
      step<RA, B>(x + kfull * 4, xstride, reinterpret_cast<const char*>(tail[0]), 1024);
    }
    // C tile (ra, b) -> acc[(16 ra + i) * B * 16 + 16 b + j]; acc holds MR x NB x 16 floats, so the
    // padding rows of a second A tile fit as well.
    _tile_stored(0, acc, B * 64);
    if (B > 1) _tile_stored(1, acc + 16, B * 64);
    if (RA > 1) _tile_stored(2, acc + 16 * B * 16, B * 64);
    if (RA > 1 && B > 1) _tile_stored(3, acc + 16 * B * 16 + 16, B * 64);
  }
};

using Amx = armserve_dense::DenseGemm<AmxBf16>;

const DenseTable* small() { return armserve_dense_avx512_bf16(); }

void gemm(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n, int64_t k,
          int64_t ldo) {
  if (m < ARMSERVE_AMX_MIN_ROWS)
    small()->gemm(out_dtype, out, x, packed, m, n, k, ldo);
  else
    Amx::gemm(out_dtype, out, x, packed, m, n, k, ldo);
}

void gemm_q(int32_t fmt, int32_t out_dtype, void* out, const void* x, const void* wq, int64_t m, int64_t n, int64_t k,
            int64_t group, int64_t ldo) {
  if (m < ARMSERVE_AMX_MIN_ROWS)
    small()->gemm_q(fmt, out_dtype, out, x, wq, m, n, k, group, ldo);
  else
    Amx::gemm_q(fmt, out_dtype, out, x, wq, m, n, k, group, ldo);
}

}  // namespace

extern "C" {

const DenseTable* armserve_dense_amx() {
  static const DenseTable t = {"amx_bf16", gemm, gemm_q};
  return &t;
}

int32_t armserve_amx_ready() {
  static const int32_t ready = [] {
    const CpuFeatures& f = *armserve_cpu();
    if (!f.amx || !f.amx_bf16 || !f.avx512_bf16) return 0;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
#else
    return 0;
#endif
  }();
  return ready;
}
}
