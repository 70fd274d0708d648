// Quantized GEMM driver, written once; each qgemm_<isa>.cpp supplies a struct with
//   template <int NT> tile_w4(wt, q[NT], as[NT], gsum[NT], k, group, acc[NT][16])
//   template <int NT> tile_w8(wt, q[NT], as[NT], gsum[NT], k, group, acc[NT][16])
//   template <int NT> tile_w5(wt, q[NT], as[NT], gsum[NT], k, group, acc[NT][16])   (group 32)
//   template <int NT> tile_w6(wt, q[NT], as[NT], gsum[NT], k, group, acc[NT][16])   (group 16)
//   template <int NT> tile_w8h(wt, q[NT], as[NT], gsum[NT], k, group, acc[NT][16])
// computing, for one 16-row weight tile and NT tokens, the 16 outputs (`as` are each token's
// per-group activation scales). See qgemm.h for the packed layout. Same anonymous-namespace rule as
// kernels_impl.h: nothing here may be merged across TUs compiled with different flags.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gguf_rows.h"
#include "kernels_impl.h"
#include "qgemm.h"

namespace armserve {
namespace {

static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Packed tile layout (qgemm.h): 64-byte chunk c (global index) of group g, then each group's
// 64-byte scale block: W4's 16 + 16 float16 (s, szp), W8's 16 float32 s.
static inline const uint8_t* chunk(const uint8_t* wt, int64_t c, int64_t g) { return wt + (c + g) * 64; }
static inline const uint16_t* w4_scales(const uint8_t* wt, int64_t g, int64_t group) {
  return reinterpret_cast<const uint16_t*>(wt + ((g + 1) * (group / 8) + g) * 64);
}
static inline const float* w8_scales(const uint8_t* wt, int64_t g, int64_t group) {
  return reinterpret_cast<const float*>(wt + ((g + 1) * (group / 4) + g) * 64);
}

// The packed formats (qgemm.h; 2 is the fused MoE's bf16 blocks, not a qgemm tile).
enum : int32_t { kW4 = 0, kW8 = 1, kW5 = 3, kW6 = 4, kW8H = 5 };
// W8H: W8's chunks with float16 scales, two groups' in one 64-byte block after the pair's chunks
// (an even number of groups): chunk c of group g at 64 * (c + g / 2).
static inline const uint8_t* w8h_chunk(const uint8_t* wt, int64_t c, int64_t g) { return chunk(wt, c, g >> 1); }
static inline const uint16_t* w8h_scales(const uint8_t* wt, int64_t g, int64_t group) {
  const int64_t p = g >> 1;
  return reinterpret_cast<const uint16_t*>(wt + ((p + 1) * 2 * (group / 4) + p) * 64 + (g & 1) * 32);
}
// W5 (group 32 only): per group 352 bytes: chunks cl = 0..3 of low nibbles, the bit-4 plane, 16 float16 s.
constexpr int64_t kW5Group = 32, kW5GroupBytes = 352;
static inline const uint8_t* w5_chunk(const uint8_t* wt, int64_t g, int64_t cl) {
  return wt + g * kW5GroupBytes + cl * 64;
}
static inline const uint8_t* w5_plane(const uint8_t* wt, int64_t g) { return wt + g * kW5GroupBytes + 256; }
static inline const uint16_t* w5_scales(const uint8_t* wt, int64_t g) {
  return reinterpret_cast<const uint16_t*>(wt + g * kW5GroupBytes + 320);
}
// W6 (group 16, k a multiple of 256): per super-block of 16 groups 3392 bytes: the groups' chunks
// cl = 0, 1 and plane (192 bytes each), then int8 sub-scales [16 groups][16 rows], then float32 d[16].
constexpr int64_t kW6Group = 16, kW6Super = 256, kW6SuperBytes = 3392;
static inline const uint8_t* w6_super(const uint8_t* wt, int64_t g) { return wt + (g >> 4) * kW6SuperBytes; }
static inline const uint8_t* w6_chunk(const uint8_t* wt, int64_t g, int64_t cl) {
  return w6_super(wt, g) + (g & 15) * 192 + cl * 64;
}
static inline const uint8_t* w6_plane(const uint8_t* wt, int64_t g) { return w6_chunk(wt, g, 2); }
static inline const int8_t* w6_sc(const uint8_t* wt, int64_t g) {
  return reinterpret_cast<const int8_t*>(w6_super(wt, g) + 3072 + (g & 15) * 16);
}
static inline const float* w6_d(const uint8_t* wt, int64_t g) {
  return reinterpret_cast<const float*>(w6_super(wt, g) + 3328);
}

// W5 and W6, the plane formats: W4's chunks of low nibbles, a plane of each code's high kBits bits
// (chunk cl's at bits kBits * cl of a plane byte for the low nibble's code, 4 + kBits * cl for the
// high one's), w = s * (u - kOffset). The kernels take their layout from here; the other formats
// have no plane (kBits 0).
template <int F>
struct Plane {
  static constexpr int kBits = 0, kOffset = 0;
};
template <>
struct Plane<kW5> {
  static constexpr int kBits = 1, kOffset = 16;
  static constexpr int64_t kGroup = kW5Group;
  static const uint8_t* chunk(const uint8_t* wt, int64_t g, int64_t cl) { return w5_chunk(wt, g, cl); }
  static const uint8_t* plane(const uint8_t* wt, int64_t g) { return w5_plane(wt, g); }
  static float scale(const uint8_t* wt, int64_t g, int r) { return f16_to_f32(w5_scales(wt, g)[r]); }
  static const uint8_t* stream(const uint8_t* wt, int64_t g) { return w5_chunk(wt, g, 0); }  // (prefetch)
  static constexpr int64_t kStreamBytes = kW5GroupBytes;                                    // per group
};
template <>
struct Plane<kW6> {
  static constexpr int kBits = 2, kOffset = 32;
  static constexpr int64_t kGroup = kW6Group;
  static const uint8_t* chunk(const uint8_t* wt, int64_t g, int64_t cl) { return w6_chunk(wt, g, cl); }
  static const uint8_t* plane(const uint8_t* wt, int64_t g) { return w6_plane(wt, g); }
  static float scale(const uint8_t* wt, int64_t g, int r) { return w6_d(wt, g)[r] * float(w6_sc(wt, g)[r]); }
  // a super-block's bytes in 16 equal runs, sub-scales and d included
  static const uint8_t* stream(const uint8_t* wt, int64_t g) { return w6_super(wt, g) + (g & 15) * kStreamBytes; }
  static constexpr int64_t kStreamBytes = kW6SuperBytes / 16;
};
// The code of chunk byte b's low nibble (column j) or high nibble (j + 4) in chunk cl, plane byte p.
template <int F>
static inline int plane_lo(uint8_t b, uint8_t p, int64_t cl) {
  return (b & 15) | (((p >> (Plane<F>::kBits * cl)) & ((1 << Plane<F>::kBits) - 1)) << 4);
}
template <int F>
static inline int plane_hi(uint8_t b, uint8_t p, int64_t cl) {
  return (b >> 4) | (((p >> (4 + Plane<F>::kBits * cl)) & ((1 << Plane<F>::kBits) - 1)) << 4);
}
// The tiles prefetch each group's bytes this far ahead of the group they compute: several tokens'
// activation rows, scales and code sums are read beside the weights, more streams than the
// hardware prefetchers follow. Zen 5, AVX512-VNNI: batch-1 decode +11% (Qwen2.5-Coder Q4_K_M
// 66.8 -> 74-75 tok/s); Qwen2.5's 12 down projections (896 x 4864, W4) at 5 tokens 2.5 -> 1.1 ms.
constexpr int64_t kPrefetchAhead = 8192;
static inline void prefetch_ahead(const uint8_t* group, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(group + kPrefetchAhead + i, 0, 3);
}

// Portable reference of the tile products, used by the scalar variant and as the fallback.
// Also the reference of one table row's dequantization (`row_w4`, `row_w8`: row r < 16 of tile
// wt into out [k] float32; w4 scales from `exact` [k / group][2] when given, else inline). Every
// variant computes float(u) * s - szp and float(q) * s with one multiply and one subtract (no
// FMA), so all give the same bits as the PyTorch reference.
struct ScalarQ {
  static void row_w4(const uint8_t* wt, int r, int64_t k, int64_t group, const float* exact, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* h = w4_scales(wt, g, group);
      const float s = exact ? exact[2 * g] : f16_to_f32(h[r]), z = exact ? exact[2 * g + 1] : f16_to_f32(h[16 + r]);
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        const uint8_t* b = chunk(wt, c, g) + r * 4;
        for (int j = 0; j < 4; ++j) {
          out[c * 8 + j] = float(b[j] & 15) * s - z;
          out[c * 8 + 4 + j] = float(b[j] >> 4) * s - z;
        }
      }
    }
  }

  static void row_w8(const uint8_t* wt, int r, int64_t k, int64_t group, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const float s = w8_scales(wt, g, group)[r];
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        const int8_t* b = reinterpret_cast<const int8_t*>(chunk(wt, c, g)) + r * 4;
        for (int j = 0; j < 4; ++j) out[c * 4 + j] = float(b[j]) * s;
      }
    }
  }

  static void row_w8h(const uint8_t* wt, int r, int64_t k, int64_t group, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const float s = f16_to_f32(w8h_scales(wt, g, group)[r]);
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        const int8_t* b = reinterpret_cast<const int8_t*>(w8h_chunk(wt, c, g)) + r * 4;
        for (int j = 0; j < 4; ++j) out[c * 4 + j] = float(b[j]) * s;
      }
    }
  }

  // W5 / W6 rows as W8 rows of the same blocks: float(u - offset) * s (every variant uses this one:
  // an embedding gathers a few rows a step).
  template <int F>
  static void row_plane(const uint8_t* wt, int r, int64_t k, float* out) {
    using P = Plane<F>;
    for (int64_t g = 0; g < k / P::kGroup; ++g) {
      const float s = P::scale(wt, g, r);
      const uint8_t* p = P::plane(wt, g) + r * 4;
      for (int64_t cl = 0; cl < P::kGroup / 8; ++cl) {
        const uint8_t* b = P::chunk(wt, g, cl) + r * 4;
        float* o = out + g * P::kGroup + cl * 8;
        for (int j = 0; j < 4; ++j) {
          o[j] = float(plane_lo<F>(b[j], p[j], cl) - P::kOffset) * s;
          o[4 + j] = float(plane_hi<F>(b[j], p[j], cl) - P::kOffset) * s;
        }
      }
    }
  }

  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    for (int i = 0; i < NT; ++i)
      for (int r = 0; r < 16; ++r) acc[i][r] = 0.f;
    for (int64_t g = 0; g < k / group; ++g) {
      int32_t ia[NT][16] = {};
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        const uint8_t* b = chunk(wt, c, g);
        for (int r = 0; r < 16; ++r)
          for (int j = 0; j < 4; ++j) {
            const int lo = b[r * 4 + j] & 15, hi = b[r * 4 + j] >> 4;
            for (int i = 0; i < NT; ++i) ia[i][r] += lo * q[i][c * 8 + j] + hi * q[i][c * 8 + 4 + j];
          }
      }
      const uint16_t* h = w4_scales(wt, g, group);
      for (int i = 0; i < NT; ++i)
        for (int r = 0; r < 16; ++r)
          acc[i][r] += as[i][g] * (f16_to_f32(h[r]) * float(ia[i][r]) - f16_to_f32(h[16 + r]) * float(gs[i][g]));
    }
  }

  // (H: the W8H layout, float16 scales: the same integer sums and float ops)
  template <int NT, bool H = false>
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    (void)gs;
    for (int i = 0; i < NT; ++i)
      for (int r = 0; r < 16; ++r) acc[i][r] = 0.f;
    for (int64_t g = 0; g < k / group; ++g) {
      int32_t ia[NT][16] = {};
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        const int8_t* w = reinterpret_cast<const int8_t*>(H ? w8h_chunk(wt, c, g) : chunk(wt, c, g));
        for (int r = 0; r < 16; ++r)
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < NT; ++i) ia[i][r] += int32_t(w[r * 4 + j]) * q[i][c * 4 + j];
      }
      float s[16];
      for (int r = 0; r < 16; ++r) s[r] = H ? f16_to_f32(w8h_scales(wt, g, group)[r]) : w8_scales(wt, g, group)[r];
      for (int i = 0; i < NT; ++i)
        for (int r = 0; r < 16; ++r) acc[i][r] += as[i][g] * s[r] * float(ia[i][r]);
    }
  }
  template <int NT>
  static void tile_w8h(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    tile_w8<NT, true>(wt, q, as, gs, k, group, acc);
  }

  // sum(u * a) - offset * sum(a) = sum((u - offset) * a) exactly, then tile_w8's float ops (qgemm.h
  // W5, W6).
  template <int F, int NT>
  static void tile_plane(const uint8_t* wt, const int8_t* const* q, const float* const* as,
                         const int32_t* const* gs, int64_t k, float (*acc)[16]) {
    using P = Plane<F>;
    for (int i = 0; i < NT; ++i)
      for (int r = 0; r < 16; ++r) acc[i][r] = 0.f;
    for (int64_t g = 0; g < k / P::kGroup; ++g) {
      int32_t ia[NT][16] = {};
      const uint8_t* p = P::plane(wt, g);
      for (int64_t cl = 0; cl < P::kGroup / 8; ++cl) {
        const uint8_t* b = P::chunk(wt, g, cl);
        const int64_t c = g * P::kGroup / 8 + cl;
        for (int r = 0; r < 16; ++r)
          for (int j = 0; j < 4; ++j) {
            const uint8_t bb = b[r * 4 + j], pb = p[r * 4 + j];
            const int lo = plane_lo<F>(bb, pb, cl), hi = plane_hi<F>(bb, pb, cl);
            for (int i = 0; i < NT; ++i) ia[i][r] += lo * q[i][c * 8 + j] + hi * q[i][c * 8 + 4 + j];
          }
      }
      float s[16];
      for (int r = 0; r < 16; ++r) s[r] = P::scale(wt, g, r);
      for (int i = 0; i < NT; ++i)
        for (int r = 0; r < 16; ++r) acc[i][r] += as[i][g] * s[r] * float(ia[i][r] - P::kOffset * gs[i][g]);
    }
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
};

template <class Isa, class IsaQ>
struct Moe;  // moe_impl.h

// Tokens one tile pass of a variant takes (its tile templates' largest NT): W5 `kMaxTokens` and W4 /
// W8 `kMaxTokensW48` where the variant declares them (AVX2: 6 and 4, a verify step's W5 rows
// unpacking each weight once; AVX512-VNNI: 8 and 8), else 4 and 4.
template <class Q, class = void>
struct PassTokens {
  static constexpr int w5 = 4, w48 = 4;
};
template <class Q>
struct PassTokens<Q, std::void_t<decltype(Q::kMaxTokens)>> {
  static constexpr int w5 = Q::kMaxTokens, w48 = Q::kMaxTokensW48;
};

template <class Isa, class IsaQ>
struct QKernels {
  // One token's row: int8 codes, per-group scales and code sums.
  static void quantize_row(int32_t dtype, const void* x, int64_t k, int64_t group, int8_t* qr, float* scale,
                           int32_t* gsum) {
    float* row = scratch(0, k);
    Isa::load(dtype, x, row, k);
    const int64_t ng = k / group;
    for (int64_t g = 0; g < ng; ++g) {
      const float* xg = row + g * group;
      // |x| compared as integers: for non-negative floats the bit patterns sort like the values,
      // and an integer max reduction vectorises where a float one (NaN rules) does not.
      uint32_t mbits = 0;
      for (int64_t i = 0; i < group; ++i) {
        const uint32_t b = __builtin_bit_cast(uint32_t, xg[i]) & 0x7fffffffu;
        mbits = b > mbits ? b : mbits;
      }
      const float amax = __builtin_bit_cast(float, mbits);
      const float inv = amax > 0.f ? 127.0f / amax : 1.0f;
      int32_t sum = 0;
      for (int64_t i = 0; i < group; ++i) {
        // round half to even with the 1.5 * 2^23 trick (|x * inv| <= 127)
        const int8_t v = int8_t((xg[i] * inv + 12582912.0f) - 12582912.0f);
        qr[g * group + i] = v;
        sum += v;
      }
      scale[g] = amax > 0.f ? amax / 127.0f : 1.0f;
      gsum[g] = sum;
    }
  }

  static void quantize_act(int32_t dtype, const void* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* scale,
                           int32_t* gsum) {
    const int es = dtype_size(dtype);
    const int64_t ng = k / group;
    // (decode, m * k < 2^16: not worth waking the thread pool, unless it is awake: a graph replay)
    armserve_par::for_static(m, m * k >= (1 << 16), [&](int64_t t) {
      quantize_row(dtype, static_cast<const char*>(x) + t * k * es, k, group, q + t * k, scale + t * ng,
                   gsum + t * ng);
    });
  }

  template <int F, int NT>
  static void tile(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                   int64_t k, int64_t group, float (*acc)[16]) {
    if constexpr (F == kW4)
      IsaQ::template tile_w4<NT>(wt, q, as, gs, k, group, acc);
    else if constexpr (F == kW5)
      IsaQ::template tile_w5<NT>(wt, q, as, gs, k, group, acc);
    else if constexpr (F == kW6)
      IsaQ::template tile_w6<NT>(wt, q, as, gs, k, group, acc);
    else if constexpr (F == kW8H)
      IsaQ::template tile_w8h<NT>(wt, q, as, gs, k, group, acc);
    else
      IsaQ::template tile_w8<NT>(wt, q, as, gs, k, group, acc);
  }

  // One 16-row weight tile `wt` (its first `cols` output columns) times m activation rows: row i is
  // quantized row idx[i] (i itself without idx) of q / ascale / agsum; outputs to out + i * ldo.
  template <int F>
  static void tile_rows(int32_t dtype, void* out, int64_t ldo, const int8_t* q, const float* ascale,
                        const int32_t* agsum, const int32_t* idx, int64_t m, const uint8_t* wt, int cols, int64_t k,
                        int64_t group) {
    // (W6 takes W4's count: AVX2's wider W5 passes sum 2 chunks in int16, which W6's codes overflow)
    constexpr int kMax = F == kW5 ? PassTokens<IsaQ>::w5 : PassTokens<IsaQ>::w48;
    const int es = dtype_size(dtype);
    const int64_t ng = k / group;
    // past 4 a pass: as few passes as kMax allows, of even sizes (each unpacks the tile once)
    const int64_t passes = (m + kMax - 1) / kMax, per = kMax > 4 ? (m + passes - 1) / passes : kMax;
    float acc[kMax][16];
    for (int64_t m0 = 0; m0 < m; m0 += per) {
      const int nt = int(m - m0 < per ? m - m0 : per);
      const int8_t* qs[kMax];
      const float* as[kMax];
      const int32_t* gs[kMax];
      for (int i = 0; i < nt; ++i) {
        const int64_t r = idx ? idx[m0 + i] : m0 + i;
        qs[i] = q + r * k;
        as[i] = ascale + r * ng;
        gs[i] = agsum + r * ng;
      }
      // (2 or 3 tokens in one pass too, and up to kMax: a speculative verify step's rows)
      switch (nt) {
        case 8: if constexpr (kMax >= 8) tile<F, 8>(wt, qs, as, gs, k, group, acc); break;
        case 7: if constexpr (kMax >= 7) tile<F, 7>(wt, qs, as, gs, k, group, acc); break;
        case 6: if constexpr (kMax >= 6) tile<F, 6>(wt, qs, as, gs, k, group, acc); break;
        case 5: if constexpr (kMax >= 5) tile<F, 5>(wt, qs, as, gs, k, group, acc); break;
        case 4: tile<F, 4>(wt, qs, as, gs, k, group, acc); break;
        case 3: tile<F, 3>(wt, qs, as, gs, k, group, acc); break;
        case 2: tile<F, 2>(wt, qs, as, gs, k, group, acc); break;
        default: tile<F, 1>(wt, qs, as, gs, k, group, acc); break;
      }
      for (int i = 0; i < nt; ++i) Isa::store(dtype, acc[i], static_cast<char*>(out) + (m0 + i) * ldo * es, cols);
    }
  }

  // Bytes of one 16-row tile of a packed w4 / w8 / w5 / w6 weight with k columns (qgemm.h).
  static int64_t tile_bytes(int32_t fmt, int64_t k, int64_t group) {
    if (fmt == kW5) return k / kW5Group * kW5GroupBytes;
    if (fmt == kW6) return k / kW6Super * kW6SuperBytes;
    if (fmt == kW8H) return 16 * k + 32 * (k / group);
    return (fmt == kW4 ? 8 * k : 16 * k) + 64 * (k / group);
  }

  template <int F>
  static void gemm(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                   const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
    const int es = dtype_size(dtype);
    const int64_t tiles = (n + 15) / 16, tb = tile_bytes(F, k, group);
    armserve_par::for_static(tiles, true, [&](int64_t t) {
      const int rows = int(n - t * 16 < 16 ? n - t * 16 : 16);
      tile_rows<F>(dtype, static_cast<char*>(out) + t * 16 * es, ldo, q, ascale, agsum, nullptr, m, w + t * tb, rows,
                    k, group);
    });
  }

  static void gemm_w4(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
    gemm<kW4>(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
  }

  static void gemm_w5(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
    gemm<kW5>(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
  }

  static void gemm_w6(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
    gemm<kW6>(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
  }

  static void gemm_w8h(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                       const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
    gemm<kW8H>(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
  }

  static void gemm_w8(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const int8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
    gemm<kW8>(dtype, out, q, ascale, agsum, reinterpret_cast<const uint8_t*>(w), m, n, k, group, ldo);
  }

  // Embedding rows of a packed table (api.h, armserve_qembedding): each row is dequantized into a
  // float32 scratch row by the variant's row_w4 / row_w8, then stored in dtype.
  static void qembedding(int32_t fmt, int32_t dtype, void* out, const void* w, const float* exact,
                         const int64_t* ids, int64_t m, int64_t start, int64_t n, int64_t k, int64_t group) {
    const int es = dtype_size(dtype);
    const int64_t tb = tile_bytes(fmt, k, group), ng = k / group;
    armserve_par::for_static(m, m * k >= (1 << 16), [&](int64_t i) {
      char* o = static_cast<char*>(out) + i * k * es;
      const int64_t r = ids[i] - start;
      if (r < 0 || r >= n) {  // another rank's row (or an id the caller let through): zeros, never a stray read
        std::memset(o, 0, k * es);
        return;
      }
      float* row = scratch(0, k);
      const uint8_t* wt = static_cast<const uint8_t*>(w) + (r / 16) * tb;
      if (fmt == kW4)
        IsaQ::row_w4(wt, int(r % 16), k, group, exact ? exact + r * ng * 2 : nullptr, row);
      else if (fmt == kW5)
        ScalarQ::row_plane<kW5>(wt, int(r % 16), k, row);
      else if (fmt == kW6)
        ScalarQ::row_plane<kW6>(wt, int(r % 16), k, row);
      else if (fmt == kW8H)
        ScalarQ::row_w8h(wt, int(r % 16), k, group, row);
      else
        IsaQ::row_w8(wt, int(r % 16), k, group, row);
      Isa::store(dtype, row, o, k);
    });
  }

  // Embedding rows of a GGUF table where the file's memory map has it (api.h, armserve_gguf_embedding):
  // each row dequantized into a float32 scratch row by gguf_rows.h, then stored in dtype.
  static void gguf_embedding(int32_t type, int32_t dtype, void* out, const void* blocks, int64_t row_bytes,
                             const int64_t* ids, int64_t m, int64_t start, int64_t n, int64_t k) {
    const int es = dtype_size(dtype);
    armserve_par::for_static(m, m * k >= (1 << 16), [&](int64_t i) {
      char* o = static_cast<char*>(out) + i * k * es;
      const int64_t r = ids[i] - start;
      float* row = scratch(0, k);
      // another rank's row (or an id the caller let through): zeros, never a stray read
      if (r < 0 || r >= n || !gguf_row(type, static_cast<const uint8_t*>(blocks) + r * row_bytes, k, row)) {
        std::memset(o, 0, k * es);
        return;
      }
      Isa::store(dtype, row, o, k);
    });
  }

  static const QKernelTable* table(const char* name) {
    static const QKernelTable t = {name,    quantize_act,        gemm_w4,    gemm_w8,       gemm_w5, gemm_w6,
                                   gemm_w8h, Moe<Isa, IsaQ>::run, qembedding, gguf_embedding};
    return &t;
  }
};

}  // namespace
}  // namespace armserve

#include "moe_impl.h"
