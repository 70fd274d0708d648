// Dense GEMM driver (dense_gemm.h), written once for bf16 and float32 weights; each
// dense_gemm_<isa>.cpp supplies primitive structs P with
//   static constexpr int kWeightBytes  2: bf16 weights in the packed layout, bf16 activations;
//                                 4: float32 weights in the float32 layout, float32 activations
//                                 (TileBase: 2)
//   static constexpr bool kDot    activations as bf16 pairs (one uint32 per k-pair) for a bf16 dot
//                                 instruction, else as fp32 (two floats per k-pair)
//   static constexpr int MR, NB   largest tile: MR rows of x times NB column blocks of 16
//   static constexpr int kAlign   activation rows are padded (with zeros) to a multiple of kAlign pairs
//   static constexpr int kStreamRows  up to this many rows, panels are 1 block wide (see gemm)
//   static constexpr int kRowPad  activation rows are padded (with zero rows) to a multiple of
//                                 kRowPad, and row tiles are MR rows but the last (tile
//                                 registers of a fixed height: AMX); 1 = no padding, balanced tiles
//   static void begin(), end()    around a panel's tiles on the thread that runs them (AMX tile
//                                 configuration); TileBase supplies kRowPad = 1 and no-ops
//   static void store(...)        a tile's sums to the output (TileBase: store_row per row)
//   template <int R, int B> tile(xa, xs, w, kp, acc)
//       acc[r * B * 16 + j] = sum over all kp pairs of row r of the activations (`xs` elements
//       apart: uint32 pairs or floats) times column j of the B consecutive packed blocks at `w`
//       (blocks kp * 32 weights apart; `w` is a uint16 pointer for both weight types),
//       accumulated in registers over the whole K.
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
#include "float_conv.h"
#include "parallel.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// Before each loop over a tile's rows, blocks or vector halves (its accumulators c[R][B]):
// GCC keeps such an array of vectors in memory unless the loops over it are unrolled before its
// scalar replacement of aggregates runs, and then stored every accumulator after each multiply-add
// (the AVX-512 tiles one store per FMA; AVX2's float32 5 x 16 tile at 57 GFLOP/s on Zen 3, 1
// thread, and 77-83 with the loops unrolled early, all-MiniLM-L6-v2's shapes).
#define ARMSERVE_UNROLL _Pragma("GCC unroll 16")

namespace armserve_dense {
namespace {

using namespace armserve_conv;  // bf16_to_f32, f32_to_bf16, f16_to_f32

// One output row segment: plain loops that each TU's flags vectorise (the scalar TU does not).
static inline void store_row(int32_t out_dtype, const float* src, void* dst, int64_t n) {
  if (out_dtype == AS_F32) {
    std::memcpy(dst, src, size_t(n) * 4);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
  }
}

// A thread-local buffer, grown on demand (64-byte aligned).
struct XBuf {
  void* p = nullptr;
  int64_t bytes = 0;
  ~XBuf() { std::free(p); }
};

// Thread-local buffers: 0 the activations, 1 a dequantized weight panel (both live at once).
static inline void* tbuf(int which, int64_t bytes) {
  thread_local XBuf bufs[2];
  XBuf& b = bufs[which];
  if (b.bytes < bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, size_t((bytes + 63) / 64 * 64));
    b.bytes = bytes;
  }
  return b.p;
}
static inline void* xbuf(int64_t bytes) { return tbuf(0, bytes); }
static inline void* wbuf(int64_t bytes) { return tbuf(1, bytes); }

// Column block t (16 weight rows) of qgemm.h's packed quantized tiles -> the dense layout's block
// [k / 2][16][2] of bf16: w = code * s - s * zero (w4), code * s (w8) or (code - offset) * s (w5:
// 16, w6: 32, as the w8 tiles of the same Q5_0 / Q6_K blocks gave), in fp32 as
// QuantizedTensor.dequantize computes it (no fused multiply-add), rounded to nearest even.
// Per group: the code chunks (w4 / w5 / w6: 8 columns per chunk, 4 bytes per row, column j in the
// low nibble of byte j and column j + 4 in its high nibble; w8: 4 columns, one byte each), w5's /
// w6's plane of the high bits, then the scales (w4: float16 s[16], s * zero[16]; w8: float32 s[16];
// w5: float16 s[16]; w6: per super-block of 16 groups, int8 sub-scales and float32 d after the
// groups, s = d * sc; w8h: w8's chunks, float16 s[16] of a pair of groups after the pair). Loops
// run over the 16 rows innermost, which the TU's flags vectorise: a row is a lane of the dot
// instructions.
static inline void dequant_block(int32_t fmt, const uint8_t* wq, int64_t t, int64_t k, int64_t group, uint16_t* dst) {
  const bool w4 = fmt == 0, w5 = fmt == 3, w6 = fmt == 4, w8h = fmt == 5, nib = w4 || w5 || w6, plane = w5 || w6;
  const int64_t ng = k / group, per = nib ? 8 : 4, chunks = group / per;
  const int64_t planes = plane ? 64 : 0, gbytes = chunks * 64 + planes + (w6 ? 0 : w5 || w8h ? 32 : 64);
  const int bits = w6 ? 2 : 1, offset = w6 ? 32 : 16;
  const uint8_t* tile = wq + t * (w6 ? k / 256 * 3392 : ng * gbytes);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);  // one (even, odd) column pair per weight row
  for (int64_t g = 0; g < ng; ++g) {
    // (w8h: a pair of groups' chunks, then their two scale halves)
    const uint8_t* gp = w6    ? tile + (g >> 4) * 3392 + (g & 15) * gbytes
                        : w8h ? tile + (g >> 1) * 2 * gbytes + (g & 1) * chunks * 64
                              : tile + g * gbytes;
    float s[16], z[16];
    uint32_t pw[16] = {};  // w5 / w6: row r's 4 plane bytes (qgemm.h)
    if (w8h) {
      uint16_t h[16];
      std::memcpy(h, tile + (g >> 1) * 2 * gbytes + 2 * chunks * 64 + (g & 1) * 32, 32);
      for (int r = 0; r < 16; ++r) s[r] = f16_to_f32(h[r]), z[r] = 0.f;
    } else if (w6) {
      const uint8_t* sb = tile + (g >> 4) * 3392;
      int8_t sc[16];
      std::memcpy(sc, sb + 3072 + (g & 15) * 16, 16);
      std::memcpy(s, sb + 3328, 64);
      for (int r = 0; r < 16; ++r) s[r] *= float(sc[r]), z[r] = 0.f;
      std::memcpy(pw, gp + chunks * 64, 64);
    } else if (nib) {
      uint16_t h[32];
      std::memcpy(h, gp + chunks * 64 + planes, w5 ? 32 : 64);
      for (int r = 0; r < 16; ++r) s[r] = f16_to_f32(h[r]), z[r] = w5 ? 0.f : f16_to_f32(h[16 + r]);
      if (w5) std::memcpy(pw, gp + chunks * 64, 64);
    } else {
      std::memcpy(s, gp + chunks * 64, 64);
      for (int r = 0; r < 16; ++r) z[r] = 0.f;
    }
    const uint32_t mask = (1u << bits) - 1;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      uint32_t u[16];
      std::memcpy(u, gp + ch * 64, 64);
      uint32_t* o = d + (g * group + ch * per) / 2 * 16;
      if (plane) {
        // the same pairs as w4 below; a code's high bits sit at bit sh + bits * ch of its row's plane word
        for (int q = 0; q < 4; ++q)
          for (int r = 0; r < 16; ++r) {
            const int sh = (q & 1) * 16 + (q >> 1) * 4;
            const int ca = int(((u[r] >> sh) & 15u) | ((pw[r] >> (sh + bits * ch)) & mask) << 4);
            const int cb = int(((u[r] >> (sh + 8)) & 15u) | ((pw[r] >> (sh + 8 + bits * ch)) & mask) << 4);
            const float a = float(ca - offset) * s[r], b = float(cb - offset) * s[r];
            o[q * 16 + r] = uint32_t(f32_to_bf16(a)) | uint32_t(f32_to_bf16(b)) << 16;
          }
      } else if (w4) {
        for (int q = 0; q < 4; ++q)  // pairs (2q', 2q' + 1): low nibbles for q < 2, high ones after
          for (int r = 0; r < 16; ++r) {
            const int sh = (q & 1) * 16 + (q >> 1) * 4;
            const float a = float((u[r] >> sh) & 15u) * s[r] - z[r];
            const float b = float((u[r] >> (sh + 8)) & 15u) * s[r] - z[r];
            o[q * 16 + r] = uint32_t(f32_to_bf16(a)) | uint32_t(f32_to_bf16(b)) << 16;
          }
      } else {
        for (int q = 0; q < 2; ++q)
          for (int r = 0; r < 16; ++r) {
            const float a = float(int8_t(u[r] >> (16 * q))) * s[r];
            const float b = float(int8_t(u[r] >> (16 * q + 8))) * s[r];
            o[q * 16 + r] = uint32_t(f32_to_bf16(a)) | uint32_t(f32_to_bf16(b)) << 16;
          }
      }
    }
  }
}

// W [n, k] (row-major) -> the packed layouts of dense_gemm.h: blocks of 16 rows (columns of the
// output) x ceil(k / 2) k-pairs of 32 elements, zero-padded in n and k. Within a k-pair, column c's
// weights at k = 2p and 2p + 1 sit at 2c and 2c + 1 (kInterleaved: bf16, the dot instructions'
// operand) or at c and 16 + c (float32: one 16-lane vector per k).
template <class T, bool kInterleaved>
static inline void pack_blocks(const T* w, int64_t n, int64_t k, T* packed) {
  const int64_t kp = (k + 1) / 2, nb = (n + 15) / 16;
  armserve_par::for_static(nb, true, [&](int64_t b) {
    T* blk = packed + b * kp * 32;
    for (int c = 0; c < 16; ++c) {
      const int64_t row = b * 16 + c, len = row < n ? k : 0;  // (rows past n: all padding)
      T* even = blk + (kInterleaved ? 2 * c : c);
      T* odd = even + (kInterleaved ? 1 : 16);
      const T* wr = w + row * k;
      int64_t p = 0;
      for (; 2 * p + 1 < len; ++p) {
        even[p * 32] = wr[2 * p];
        odd[p * 32] = wr[2 * p + 1];
      }
      for (; p < kp; ++p) {  // the K tail: an odd k's last weight, then zeros
        even[p * 32] = 2 * p < len ? wr[2 * p] : T(0);
        odd[p * 32] = T(0);
      }
    }
  });
}
static inline void pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
  pack_blocks<uint16_t, true>(w, n, k, packed);
}
static inline void pack_f32(const float* w, int64_t n, int64_t k, float* packed) {
  pack_blocks<float, false>(w, n, k, packed);
}

// Decode reads each weight once, front to back, and is bound by how many of its lines are in
// flight: on a Xeon (1 thread, m = 1) the hardware prefetchers alone held the stream to ~11 GB/s,
// and a software prefetch into L2 16 KiB ahead of the loads raised it to ~13.5 (Qwen2.5-0.5B's
// layers 65 -> 53 ms, its LM head 24 -> 19 ms; 8 to 64 KiB measured alike, into L1 worse).
// x86 tiles of few rows call it once per 64-byte weight row they load (beyond the end of a block
// it fetches the next block's start, which follows in the packed layout; a prefetch never faults).
constexpr int64_t kStreamPrefetchBytes = 16384;
#ifndef ARMSERVE_DENSE_PREFETCH_ROWS
#define ARMSERVE_DENSE_PREFETCH_ROWS 4
#endif
constexpr int kStreamPrefetchMaxRows = ARMSERVE_DENSE_PREFETCH_ROWS;  // beyond this the tiles are no longer bound by the stream
static inline void prefetch_stream(const void* w) {
  __builtin_prefetch(static_cast<const char*>(w) + kStreamPrefetchBytes, 0, 2);  // prefetcht1: to L2
}

// Defaults for the optional members of a primitive.
struct TileBase {
  static constexpr int kWeightBytes = 2;
  static constexpr int kRowPad = 1;
  // The tiles call prefetch_stream themselves when alone on a panel of few rows (PanelPrefetch).
  static constexpr bool kSelfStream = false;
  static void begin() {}
  static void end() {}
  // The next tile call may fetch [p, p + bytes) into the cache as it goes (AMX: the next panel's
  // weights while this panel's row tiles compute from cache).
  static void prefetch_during_next_tile(const void*, int64_t) {}
  // rows x cols of a tile's acc (rows `stride` floats apart) to `out` (rows `ldo` elements apart).
  static void store(int32_t out_dtype, const float* acc, int64_t stride, int rows, void* out, int64_t ldo,
                    int64_t cols) {
    const int es = out_dtype == AS_F32 ? 4 : 2;
    for (int r = 0; r < rows; ++r) store_row(out_dtype, acc + r * stride, static_cast<char*>(out) + r * ldo * es, cols);
  }
};

// For tiles that run several row tiles over one panel (more rows than one tile holds): the next
// panel's weights are fetched into L2 during this panel's tiles, spread over their K steps, so the
// memory works while the later row tiles compute from cache. Without it a panel's first row tile
// waits on memory and the others on the multiplies, one after the other: on Zen 4 (1 thread,
// SmolLM2's 30 layers, weights cold) m = 8 took 15.2 ms, about the sum of streaming the weights
// (9.3) and the multiplies at peak (7.7).
template <class Self>
struct PanelPrefetch : TileBase {
  static constexpr bool kSelfStream = true;
  static inline thread_local const char* pf_next = nullptr;
  static inline thread_local int64_t pf_lines = 0;
  static void prefetch_during_next_tile(const void* p, int64_t bytes) {
    pf_next = static_cast<const char*>(p);
    pf_lines = bytes / 64;
  }
  // One tile's share: `per` lines at each of its steps (step()), until `left` runs out.
  struct Share {
    const char* p;
    int64_t left, per;
    inline void step() {
      for (int64_t i = 0; i < per && left > 0; ++i, --left, p += 64) __builtin_prefetch(p, 0, 2);  // to L2
    }
  };
  // Takes what prefetch_during_next_tile asked for, over `steps` steps.
  static Share take(int64_t steps) {
    Share s{pf_next, pf_lines, 0};
    s.per = steps > 0 ? (s.left + steps - 1) / steps : s.left;
    pf_lines = 0;
    return s;
  }
  // The x86 primitives' one summation order for every tile shape (dense_gemm_avx2.cpp says why), by
  // `Self::pass<R, B, kStream, SET>`: float32 weights one chain over even and odd k in turn (SET 3);
  // widened bf16 the even-k chain plus the odd-k chain, both in registers where `kBoth` (SET 2),
  // else in two passes over the panel (SET 0, then 1 adding to acc).
  template <int R, int B, bool kStream, bool kF32, bool kBoth, class Sh>
  static void run_in_order(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc, Sh pf) {
    if constexpr (kF32) {
      Self::template pass<R, B, kStream, 3>(xa, xs, w, kp, acc, pf);
    } else if constexpr (kBoth) {
      Self::template pass<R, B, kStream, 2>(xa, xs, w, kp, acc, pf);
    } else {
      Self::template pass<R, B, kStream, 0>(xa, xs, w, kp, acc, pf);
      Self::template pass<R, B, false, 1>(xa, xs, w, kp, acc, Sh{nullptr, 0, 0});
    }
  }
  // The tile of the primitive's `run<R, B, kStream>(xa, xs, w, kp, acc, share)` over kp k-pairs:
  // a panel of one row tile streams its own weights (kStream: prefetch_stream as it loads them);
  // with more row tiles, the next panel comes in during them (share.step() once per k-pair).
  template <int R, int B>
  static void tile(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc) {
    Share pf = take(kp);
    if (R <= kStreamPrefetchMaxRows && pf.left == 0)
      Self::template run<R, B, true>(xa, xs, w, kp, acc, pf);
    else
      Self::template run<R, B, false>(xa, xs, w, kp, acc, pf);
  }
};

template <class P>
struct DenseGemm {
  using TileFn = void (*)(const void*, int64_t, const uint16_t*, int64_t, float*);
  // A column block's k-pair in uint16 units (`w` pointers) and in bytes: 16 columns x 2 weights.
  static constexpr int64_t kPairU16 = 16 * P::kWeightBytes, kPairBytes = 32 * P::kWeightBytes;

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

  // The activations in the form the tiles read (`xs`: row stride in activation elements),
  // converted once per call where they are not already.
  static const void* activations(const void* x, int64_t m, int64_t k, int64_t* xs) {
    const int64_t kp = (k + 1) / 2, kpa = (kp + P::kAlign - 1) / P::kAlign * P::kAlign;
    if constexpr (P::kWeightBytes == 4) {  // float32 rows: used in place unless K needs padding
      *xs = kpa * 2;
      if (k == kpa * 2) return x;
      float* buf = static_cast<float*>(xbuf(m * kpa * 8));
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(buf + r * kpa * 2, static_cast<const float*>(x) + r * k, size_t(k) * 4);
        for (int64_t i = k; i < kpa * 2; ++i) buf[r * kpa * 2 + i] = 0.f;
      }
      return buf;
    }
    const uint16_t* xs16 = static_cast<const uint16_t*>(x);
    if (P::kDot) {
      *xs = kpa;
      const int64_t mp = (m + P::kRowPad - 1) / P::kRowPad * P::kRowPad;
      if (k % 2 == 0 && kpa == kp && mp == m) return x;  // already bf16 pairs
      uint16_t* buf = static_cast<uint16_t*>(xbuf(mp * kpa * 4));
      for (int64_t r = 0; r < m; ++r) {
        std::memcpy(buf + r * kpa * 2, xs16 + r * k, size_t(k) * 2);
        std::memset(buf + r * kpa * 2 + k, 0, size_t(kpa * 2 - k) * 2);
      }
      std::memset(buf + m * kpa * 2, 0, size_t((mp - m) * kpa) * 4);
      return buf;
    }
    *xs = kpa * 2;
    float* buf = static_cast<float*>(xbuf(m * kpa * 8));
    const int64_t w = *xs;
    // NOTE: a region of its own even in a team (nested: one thread), not a share of the team's
    // loop: the buffer is thread-local, so every thread of a team converts every row into its own.
#pragma omp parallel for schedule(static) if (m * k >= (1 << 17))
    for (int64_t r = 0; r < m; ++r) {
      float* d = buf + r * w;
      const uint16_t* s = xs16 + r * k;
      for (int64_t i = 0; i < k; ++i) d[i] = bf16_to_f32(s[i]);
      for (int64_t i = k; i < w; ++i) d[i] = 0.f;
    }
    return buf;
  }

  // Every row of x against one panel: `bc` column blocks at `wp` (kp * kPairU16 apart), output
  // columns [c0, c0 + cols); rows in tiles of at most MR, balanced (17 rows at MR = 8: 6 + 6 + 5,
  // not 8 + 8 + 1) unless the rows are padded (kRowPad: full tiles, then the rest).
  static void panel(int32_t out_dtype, void* out, const void* xa, int64_t xs, const uint16_t* wp, int64_t kp,
                    int bc, int64_t c0, int64_t cols, int64_t m, int64_t ldo, bool prefetch_next = true,
                    bool configure = true) {
    static const Tiles tiles;
    const int es = out_dtype == AS_F32 ? 4 : 2;
    const int64_t nrt = (m + P::MR - 1) / P::MR, rbase = m / nrt, rextra = m % nrt;
    alignas(64) float acc[P::MR * P::NB * 16];
    if (configure) P::begin();
    int64_t r0 = 0;
    // The next panel's weights (adjacent in the packed layout) come in while this panel's row
    // tiles run: the first row tile reads this panel from memory, the others from cache, and
    // without this the memory idles while they compute (the prefetchers do not run that far ahead).
    const int64_t next_bytes = int64_t(bc) * kp * kPairBytes;
    const char* next = reinterpret_cast<const char*>(wp) + next_bytes;
    // (A lone tile of a few rows streams its panel with prefetch_stream instead, where it can.)
    if (P::kSelfStream && nrt == 1 && m <= kStreamPrefetchMaxRows) prefetch_next = false;
    for (int64_t t = 0; t < nrt; ++t) {
      const int rows = P::kRowPad > 1 ? int(m - r0 < P::MR ? m - r0 : P::MR) : int(rbase + (t < rextra ? 1 : 0));
      if (prefetch_next)
        P::prefetch_during_next_tile(next + next_bytes * t / nrt, next_bytes * (t + 1) / nrt - next_bytes * t / nrt);
      tiles.fn[rows][bc](static_cast<const char*>(xa) + r0 * xs * 4, xs, wp, kp, acc);  // 4-byte elements
      P::store(out_dtype, acc, bc * 16, rows, static_cast<char*>(out) + (r0 * ldo + c0) * es, ldo, cols);
      r0 += rows;
    }
    if (configure) P::end();
  }

  // Padded row tiles (AMX): every row tile across panels [p0, p1) of NB blocks (weights at `wg`,
  // the first of them), so that a row's outputs are written left to right. Column by column down
  // the rows (panel()), each tile's 32 output rows are 32 lines a row stride apart that the stores
  // must first fetch: the prefetchers do not follow that, and at m x n = 2048 x 3072 the stores
  // held the multiplies to half their speed (645 against 1280 GFLOP/s with the stores going to one
  // row). The callers keep a group's weights to ~1 MiB (kGroupBytes), so they stay in L2 while the
  // row tiles pass.
  static constexpr int64_t kGroupBytes = 1 << 20;
  // Below this many rows the weights, not the stores, set the pace (they stream from memory, once
  // per call): panel() then reads each panel once for every row tile while the prefetchers fetch
  // the next, where blocks() waits for a group's weights, then computes without loads. Measured on
  // a Xeon with AMX, a model's 30 layers of SmolLM2 shapes with the weights cold, 1 thread: m = 64
  // 29.6 (panel) vs 38.7 ms (blocks), 256: 71 vs 83, 512: even, 1024: 333 vs 266, 2048: 948 vs 651.
  static constexpr int64_t kBlocksMinRows = 512;
  static int64_t group_panels(int64_t kp) {
    const int64_t g = kGroupBytes / (int64_t(P::NB) * kp * kPairBytes);
    return g > 1 ? g : 1;
  }
  static void blocks(int32_t out_dtype, void* out, const void* xa, int64_t xs, const uint16_t* wg, int64_t kp,
                     int64_t nb, int64_t p0, int64_t p1, int64_t n, int64_t m, int64_t ldo) {
    static const Tiles tiles;
    const int es = out_dtype == AS_F32 ? 4 : 2;
    alignas(64) float acc[2][P::MR * P::NB * 16];
    // A tile's sums go out after the next tile's multiplies are under way: a load of what a tile
    // store has just written waits until the store reaches the cache (no forwarding).
    int cur = 0, pend_rows = 0, pend_bc = 0;
    char* pend_out = nullptr;
    int64_t pend_cols = 0;
    P::begin();
    for (int64_t r0 = 0; r0 < m; r0 += P::MR) {
      const int rows = int(m - r0 < P::MR ? m - r0 : P::MR);
      for (int64_t pn = p0; pn < p1; ++pn) {
        const int64_t b0 = pn * P::NB;
        const int bc = int(nb - b0 < P::NB ? nb - b0 : P::NB);
        const int64_t c0 = b0 * 16, cols = n - c0 < bc * 16 ? n - c0 : bc * 16;
        tiles.fn[rows][bc](static_cast<const char*>(xa) + r0 * xs * 4, xs, wg + (pn - p0) * P::NB * kp * kPairU16, kp,
                           acc[cur]);
        if (pend_rows) P::store(out_dtype, acc[cur ^ 1], pend_bc * 16, pend_rows, pend_out, ldo, pend_cols);
        pend_out = static_cast<char*>(out) + (r0 * ldo + c0) * es;
        pend_rows = rows;
        pend_cols = cols;
        pend_bc = bc;
        cur ^= 1;
      }
    }
    if (pend_rows) P::store(out_dtype, acc[cur ^ 1], pend_bc * 16, pend_rows, pend_out, ldo, pend_cols);
    P::end();
  }

  // Panels [0, panels) in one contiguous range per thread (`f(p0, p1)`), for blocks().
  template <class F>
  static void per_thread_ranges(int64_t panels, F&& f) {
    const int64_t chunks = armserve_par::team_size() < panels ? armserve_par::team_size() : panels;
    armserve_par::for_static(chunks, true, [&](int64_t ch) { f(panels * ch / chunks, panels * (ch + 1) / chunks); });
  }

  // Rows per chunk of x in gemm(): all of them while their activations fit in kRowChunkBytes,
  // else as many whole row tiles as fit. A panel's row tiles read every row of x, and x larger
  // than L2 came from L3 again for every panel: all-MiniLM-L6-v2's layers on a 2048-token step
  // (K = 384 / 1536, float32, Zen 3, 1 thread) ran at 43-52 GFLOP/s against 56-60 at 128 rows.
  static constexpr int64_t kRowChunkBytes = 256 << 10;
  static int64_t row_chunk(int64_t m, int64_t xs) {
    const int64_t row_bytes = xs * 4, fit = kRowChunkBytes / row_bytes / P::MR * P::MR;
    if (m * row_bytes <= kRowChunkBytes || P::kRowPad > 1) return m;
    return fit > P::MR ? fit : P::MR;
  }

  static void gemm(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n, int64_t k,
                   int64_t ldo) {
    if (m <= 0 || n <= 0) return;
    const int64_t kp = (k + 1) / 2, nb = (n + 15) / 16;
    const uint16_t* w = static_cast<const uint16_t*>(packed);
    int64_t xs;
    const void* xa = activations(x, m, k, &xs);
    // Panel width: NB blocks, or 1 block for a few rows (up to kStreamRows), where the call is
    // bound by the weight stream and one block at a time reads it strictly front to back (Zen 5,
    // m = 1: 37 GB/s against 23 with 4 interleaved block streams). Beyond 2 rows only while the
    // activations (re-read for every block) take at most half of a 48 KiB L1: at m = 4, K = 4864
    // the 4-block panels measured faster, at K = 576 / 896 the 1-block ones.
    const bool stream = m <= P::kStreamRows && (m <= 2 || m * xs * 4 <= 24576);
    const int nbp = stream ? 1 : P::NB;
    const int64_t panels = (nb + nbp - 1) / nbp;
    if (P::kRowPad > 1 && m > kBlocksMinRows) {
      const int64_t group = group_panels(kp);
      per_thread_ranges(panels, [&](int64_t p0, int64_t p1) {
        for (int64_t g0 = p0; g0 < p1; g0 += group)
          blocks(out_dtype, out, xa, xs, w + g0 * P::NB * kp * kPairU16, kp, nb, g0, g0 + group < p1 ? g0 + group : p1, n, m,
                 ldo);
      });
      return;
    }
    // One contiguous range of panels per thread (as a static loop would give it), with the tile
    // configuration loaded once for the range, not around every panel (AMX, Qwen2.5-0.5B's
    // layers at 4-32 rows, 1 thread: 2-4% faster). Many rows go in chunks of row_chunk() rows,
    // each chunk across the thread's panels before the next.
    const int64_t mc = row_chunk(m, xs), es = out_dtype == AS_F32 ? 4 : 2;
    per_thread_ranges(panels, [&](int64_t p0, int64_t p1) {
      P::begin();
      for (int64_t r0 = 0; r0 < m; r0 += mc) {
        const int64_t rows = m - r0 < mc ? m - r0 : mc;
        for (int64_t pn = p0; pn < p1; ++pn) {
          const int64_t b0 = pn * nbp;
          const int bc = int(nb - b0 < nbp ? nb - b0 : nbp);
          const int64_t c0 = b0 * 16, cols = n - c0 < bc * 16 ? n - c0 : bc * 16;
          panel(out_dtype, static_cast<char*>(out) + r0 * ldo * es, static_cast<const char*>(xa) + r0 * xs * 4, xs,
                w + b0 * kp * kPairU16, kp, bc, c0, cols, rows, ldo, true, false);
        }
      }
      P::end();
    });
  }

  // Quantized weights: each thread dequantizes a panel (NB column blocks, NB * 16 x K bf16: 112 KiB
  // at K = 896) into its own buffer and runs every row of x against it, so the dequantization is
  // paid once per weight and call, shared by all the rows (this path is for prefill-sized m).
  static void gemm_q(int32_t fmt, int32_t out_dtype, void* out, const void* x, const void* wq, int64_t m, int64_t n,
                     int64_t k, int64_t group, int64_t ldo) {
    if (m <= 0 || n <= 0) return;
    const int64_t kp = k / 2, nb = (n + 15) / 16, panels = (nb + P::NB - 1) / P::NB;
    int64_t xs;
    const void* xa = activations(x, m, k, &xs);
    if (P::kRowPad > 1 && m > kBlocksMinRows) {
      // A group of panels dequantized at a time (~1 MiB of bf16), then every row across it.
      const int64_t gp = group_panels(kp);
      per_thread_ranges(panels, [&](int64_t p0, int64_t p1) {
        for (int64_t g0 = p0; g0 < p1; g0 += gp) {
          const int64_t g1 = g0 + gp < p1 ? g0 + gp : p1, bend = g1 * P::NB < nb ? g1 * P::NB : nb;
          uint16_t* wp = static_cast<uint16_t*>(wbuf((bend - g0 * P::NB) * kp * 64));
          for (int64_t b = g0 * P::NB; b < bend; ++b)
            dequant_block(fmt, static_cast<const uint8_t*>(wq), b, k, group, wp + (b - g0 * P::NB) * kp * 32);
          blocks(out_dtype, out, xa, xs, wp, kp, nb, g0, g1, n, m, ldo);
        }
      });
      return;
    }
    armserve_par::for_static(panels, true, [&](int64_t pn) {
      const int64_t b0 = pn * P::NB;
      const int bc = int(nb - b0 < P::NB ? nb - b0 : P::NB);
      const int64_t c0 = b0 * 16, cols = n - c0 < bc * 16 ? n - c0 : bc * 16;
      uint16_t* wp = static_cast<uint16_t*>(wbuf(int64_t(bc) * kp * 64));
      for (int b = 0; b < bc; ++b)
        dequant_block(fmt, static_cast<const uint8_t*>(wq), b0 + b, k, group, wp + b * kp * 32);
      panel(out_dtype, out, xa, xs, wp, kp, bc, c0, cols, m, ldo, false);  // (the next panel is not dequantized yet)
    });
  }

  // Column blocks [b0, b1) of out = x @ W^T on this thread (DenseTable::cols), panel by panel with
  // the next one prefetched as in gemm().
  static void cols(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n, int64_t k,
                   int64_t ldo, int64_t b0, int64_t b1) {
    if (m <= 0 || b1 <= b0) return;
    const int64_t kp = (k + 1) / 2;
    const uint16_t* w = static_cast<const uint16_t*>(packed);
    int64_t xs;
    const void* xa = activations(x, m, k, &xs);
    P::begin();
    for (int64_t b = b0; b < b1; b += P::NB) {
      const int bc = int(b1 - b < P::NB ? b1 - b : P::NB);
      const int64_t c0 = b * 16, ncols = n - c0 < bc * 16 ? n - c0 : bc * 16;
      panel(out_dtype, out, xa, xs, w + b * kp * kPairU16, kp, bc, c0 - b0 * 16, ncols, m, ldo, b + bc < b1, false);
    }
    P::end();
  }

  static const DenseTable* table(const char* name) {
    static const DenseTable t = {name, gemm, gemm_q, cols};
    return &t;
  }
  // Float32 weights (kWeightBytes 4): no quantized panels.
  static const DenseTable* table_f32(const char* name) {
    static_assert(P::kWeightBytes == 4, "float32 primitives only");
    static const DenseTable t = {name, gemm, nullptr, cols};
    return &t;
  }
};

// The (even k, odd k) weights of column c < 16 at k-pair p of a block: bf16 pairs interleaved by
// column, or float32 halves (16 even, then 16 odd).
template <bool F32>
static inline void pair_weights(const uint16_t* wb, int64_t p, int c, float* we, float* wo) {
  if constexpr (F32) {
    const float* f = reinterpret_cast<const float*>(wb) + p * 32;
    *we = f[c];
    *wo = f[16 + c];
  } else {
    *we = bf16_to_f32(wb[p * 32 + 2 * c]);
    *wo = bf16_to_f32(wb[p * 32 + 2 * c + 1]);
  }
}

// Portable reference tiles (the scalar variant): the same sums in the same order as the widening
// SIMD tiles, one fp32 multiply-add per element; F32: float32 weights.
template <bool F32 = false>
struct ScalarP : TileBase {
  static constexpr int kWeightBytes = F32 ? 4 : 2;
  static constexpr bool kDot = false;
  static constexpr int MR = 4, NB = 1, kAlign = 1, kStreamRows = 0;
  template <int R, int B>
  static void tile(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc) {
    const float* x = static_cast<const float*>(xa);
    for (int i = 0; i < R * B * 16; ++i) acc[i] = 0.f;
    for (int b = 0; b < B; ++b) {
      const uint16_t* wb = w + b * kp * 16 * kWeightBytes;
      for (int64_t p = 0; p < kp; ++p)
        for (int c = 0; c < 16; ++c) {
          float we, wo;
          pair_weights<F32>(wb, p, c, &we, &wo);
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
