// Dense bf16 GEMM driver (dense_gemm.h), written once; each dense_gemm_<isa>.cpp supplies a
// primitive struct P with
//   static constexpr bool kDot    activations as bf16 pairs (one uint32 per k-pair) for a bf16 dot
//                                 instruction, else as fp32 (two floats per k-pair)
//   static constexpr int MR, NB   largest tile: MR rows of x times NB column blocks of 16
//   static constexpr int kAlign   activation rows are padded (with zeros) to a multiple of kAlign pairs
//   static constexpr int kStreamRows  up to this many rows, panels are 1 block wide (see gemm)
//   template <int R, int B> tile(xa, xs, w, kp, acc)
//       acc[r * B * 16 + j] = sum over all kp pairs of row r of the activations (`xs` elements
//       apart: uint32 pairs or floats) times column j of the B consecutive packed blocks at `w`
//       (blocks kp * 32 uint16 apart), accumulated in registers over the whole K.
// Same rule as kernels_impl.h: everything sits in an anonymous namespace and no std:: templates,
// since each ISA TU is compiled with different flags.
//
// Work split: OpenMP static over panels of NB blocks, so each thread streams its weight range front
// to back (decode is bound by that stream); inside a panel the rows of x go by in tiles of <= MR,
// the panel (NB * 16 columns x K) staying in L1/L2 while every row of x passes by it.
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "dense_gemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace armserve_dense {
namespace {

static inline float bf16f(uint16_t h) { return __builtin_bit_cast(float, uint32_t(h) << 16); }

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7fc0 (kernels_impl.h's f32_to_bf16, as PyTorch).
static inline uint16_t to_bf16(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t(0x7fc0) : uint16_t(r);
}

// One output row segment: plain loops that each TU's flags vectorise (the scalar TU does not).
static inline void store_row(int32_t out_dtype, const float* src, void* dst, int64_t n) {
  if (out_dtype == AS_F32) {
    std::memcpy(dst, src, size_t(n) * 4);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = to_bf16(src[i]);
  }
}

// Thread-local activation buffer, grown on demand (64-byte aligned).
struct XBuf {
  void* p = nullptr;
  int64_t bytes = 0;
  ~XBuf() { std::free(p); }
};

static inline void* xbuf(int64_t bytes) {
  thread_local XBuf b;
  if (b.bytes < bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, size_t((bytes + 63) / 64 * 64));
    b.bytes = bytes;
  }
  return b.p;
}

// W [n, k] bf16 (row-major) -> the packed layout of dense_gemm.h.
static inline void pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t kp = (k + 1) / 2, nb = (n + 15) / 16;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nb; ++b) {
    uint16_t* blk = packed + b * kp * 32;
    for (int c = 0; c < 16; ++c) {
      const int64_t row = b * 16 + c;
      if (row >= n) {
        for (int64_t p = 0; p < kp; ++p) blk[p * 32 + 2 * c] = blk[p * 32 + 2 * c + 1] = 0;
        continue;
      }
      const uint16_t* wr = w + row * k;
      for (int64_t p = 0; p < k / 2; ++p) {
        blk[p * 32 + 2 * c] = wr[2 * p];
        blk[p * 32 + 2 * c + 1] = wr[2 * p + 1];
      }
      if (k & 1) {
        blk[(kp - 1) * 32 + 2 * c] = wr[k - 1];
        blk[(kp - 1) * 32 + 2 * c + 1] = 0;
      }
    }
  }
}

template <class P>
struct DenseGemm {
  using TileFn = void (*)(const void*, int64_t, const uint16_t*, int64_t, float*);

  template <int R, int B>
  static TileFn find(int r, int b) {
    if (r == R && b == B) return &P::template tile<R, B>;
    if constexpr (B > 1)
      return find<R, B - 1>(r, b);
    else if constexpr (R > 1)
      return find<R - 1, P::NB>(r, b);
    else
      return nullptr;
  }

  struct Tiles {
    TileFn fn[P::MR + 1][P::NB + 1];
    Tiles() {
      for (int r = 0; r <= P::MR; ++r)
        for (int b = 0; b <= P::NB; ++b) fn[r][b] = (r && b) ? find<P::MR, P::NB>(r, b) : nullptr;
    }
  };

  static void gemm(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n, int64_t k,
                   int64_t ldo) {
    static const Tiles tiles;
    if (m <= 0 || n <= 0) return;
    const int64_t kp = (k + 1) / 2, nb = (n + 15) / 16;
    const int64_t kpa = (kp + P::kAlign - 1) / P::kAlign * P::kAlign;
    const uint16_t* xs16 = static_cast<const uint16_t*>(x);
    const uint16_t* w = static_cast<const uint16_t*>(packed);
    // Activations in the form the tiles read, converted once per call.
    const void* xa;
    int64_t xs;  // row stride in activation elements
    if (P::kDot) {
      xs = kpa;
      if (k % 2 == 0 && kpa == kp) {
        xa = x;  // already bf16 pairs
      } else {
        uint16_t* buf = static_cast<uint16_t*>(xbuf(m * kpa * 4));
        for (int64_t r = 0; r < m; ++r) {
          std::memcpy(buf + r * kpa * 2, xs16 + r * k, size_t(k) * 2);
          std::memset(buf + r * kpa * 2 + k, 0, size_t(kpa * 2 - k) * 2);
        }
        xa = buf;
      }
    } else {
      xs = kpa * 2;
      float* buf = static_cast<float*>(xbuf(m * kpa * 8));
#pragma omp parallel for schedule(static) if (m * k >= (1 << 17))
      for (int64_t r = 0; r < m; ++r) {
        float* d = buf + r * xs;
        const uint16_t* s = xs16 + r * k;
        for (int64_t i = 0; i < k; ++i) d[i] = bf16f(s[i]);
        for (int64_t i = k; i < xs; ++i) d[i] = 0.f;
      }
      xa = buf;
    }
    const int es = out_dtype == AS_F32 ? 4 : 2;
    // Rows in tiles of at most MR, balanced (17 rows at MR = 8: 6 + 6 + 5, not 8 + 8 + 1).
    const int64_t nrt = (m + P::MR - 1) / P::MR, rbase = m / nrt, rextra = m % nrt;
    // Panel width: NB blocks, or 1 block for a few rows (up to kStreamRows), where the call is
    // bound by the weight stream and one block at a time reads it strictly front to back (Zen 5,
    // m = 1: 37 GB/s against 23 with 4 interleaved block streams). Beyond 2 rows only while the
    // activations (re-read for every block) take at most half of a 48 KiB L1: at m = 4, K = 4864
    // the 4-block panels measured faster, at K = 576 / 896 the 1-block ones.
    const bool stream = m <= P::kStreamRows && (m <= 2 || m * xs * 4 <= 24576);
    const int nbp = stream ? 1 : P::NB;
    const int64_t panels = (nb + nbp - 1) / nbp;
#pragma omp parallel for schedule(static)
    for (int64_t pn = 0; pn < panels; ++pn) {
      const int64_t b0 = pn * nbp;
      const int bc = int(nb - b0 < nbp ? nb - b0 : nbp);
      const int64_t c0 = b0 * 16;
      const int64_t cols = n - c0 < bc * 16 ? n - c0 : bc * 16;
      const uint16_t* wp = w + b0 * kp * 32;
      alignas(64) float acc[P::MR * P::NB * 16];
      int64_t r0 = 0;
      for (int64_t t = 0; t < nrt; ++t) {
        const int rows = int(rbase + (t < rextra ? 1 : 0));
        tiles.fn[rows][bc](static_cast<const char*>(xa) + r0 * xs * 4, xs, wp, kp, acc);  // 4-byte elements
        for (int r = 0; r < rows; ++r)
          store_row(out_dtype, acc + r * bc * 16, static_cast<char*>(out) + ((r0 + r) * ldo + c0) * es, cols);
        r0 += rows;
      }
    }
  }

  static const DenseTable* table(const char* name) {
    static const DenseTable t = {name, gemm};
    return &t;
  }
};

// Portable reference tiles (the scalar variant): the same sums in the same order as the widening
// SIMD tiles, one fp32 multiply-add per element.
struct ScalarP {
  static constexpr bool kDot = false;
  static constexpr int MR = 4, NB = 1, kAlign = 1, kStreamRows = 0;
  template <int R, int B>
  static void tile(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc) {
    const float* x = static_cast<const float*>(xa);
    for (int i = 0; i < R * B * 16; ++i) acc[i] = 0.f;
    for (int b = 0; b < B; ++b) {
      const uint16_t* wb = w + b * kp * 32;
      for (int64_t p = 0; p < kp; ++p)
        for (int c = 0; c < 16; ++c) {
          const float we = bf16f(wb[p * 32 + 2 * c]), wo = bf16f(wb[p * 32 + 2 * c + 1]);
          for (int r = 0; r < R; ++r) {
            float& a = acc[r * B * 16 + b * 16 + c];
            a += we * x[r * xs + 2 * p];
            a += wo * x[r * xs + 2 * p + 1];
          }
        }
    }
  }
};

}  // namespace
}  // namespace armserve_dense
