// Quantized GEMM with SVE SDOT, vector-length agnostic: a 64-byte tile chunk (16 rows x 4
// columns) is walked in pieces of one vector (4 rows at 128-bit SVE, 16 rows at 512-bit).
#include <arm_sve.h>

#include "qgemm_impl.h"

namespace {
using armserve::load4;
using armserve::chunk;
using armserve::w4_scales;
using armserve::w8_scales;
using armserve::w5_scales;
using armserve::w6_sc;
using armserve::w6_d;
using armserve::Plane;
using armserve::kW4;
using armserve::kW5;
using armserve::kW6;
using armserve::kW8;
using armserve::kW8H;
using armserve::w8h_chunk;
using armserve::w8h_scales;

struct QSve {
  // One table row dequantized (qgemm_impl.h ScalarQ has the reference and the rules): its codes,
  // 4 bytes of each 64-byte chunk of its tile, unpacked group by group into bytes, then widened
  // and scaled one vector of float32 lanes at a time.
  static void row_w4(const uint8_t* wt, int r, int64_t k, int64_t group, const float* exact, float* out) {
    uint8_t u[256];
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* h = w4_scales(wt, g, group);
      const svfloat32_t s = svdup_f32(exact ? exact[2 * g] : armserve::f16_to_f32(h[r]));
      const svfloat32_t z = svdup_f32(exact ? exact[2 * g + 1] : armserve::f16_to_f32(h[16 + r]));
      for (int64_t g0 = 0; g0 < group; g0 += 256) {  // (groups of more than 256 columns in pieces)
        const int64_t len = group - g0 < 256 ? group - g0 : 256;
        for (int64_t j = 0; j < len; j += 8) {
          const uint8_t* b = chunk(wt, (g * group + g0 + j) / 8, g) + r * 4;
          for (int i = 0; i < 4; ++i) {
            u[j + i] = b[i] & 15;
            u[j + 4 + i] = b[i] >> 4;
          }
        }
        float* o = out + g * group + g0;
        for (int64_t j = 0; j < len; j += svcntw()) {
          const svbool_t p = svwhilelt_b32(j, len);
          const svfloat32_t f = svcvt_f32_u32_x(p, svld1ub_u32(p, u + j));
          svst1_f32(p, o + j, svsub_f32_x(p, svmul_f32_x(p, f, s), z));
        }
      }
    }
  }

  static void row_w8(const uint8_t* wt, int r, int64_t k, int64_t group, float* out) {
    int8_t q[256];
    for (int64_t g = 0; g < k / group; ++g) {
      const svfloat32_t s = svdup_f32(w8_scales(wt, g, group)[r]);
      for (int64_t g0 = 0; g0 < group; g0 += 256) {
        const int64_t len = group - g0 < 256 ? group - g0 : 256;
        for (int64_t j = 0; j < len; j += 4)
          std::memcpy(q + j, chunk(wt, (g * group + g0 + j) / 4, g) + r * 4, 4);
        float* o = out + g * group + g0;
        for (int64_t j = 0; j < len; j += svcntw()) {
          const svbool_t p = svwhilelt_b32(j, len);
          svst1_f32(p, o + j, svmul_f32_x(p, svcvt_f32_s32_x(p, svld1sb_s32(p, q + j)), s));
        }
      }
    }
  }

  // The two code vectors of a W4 / W5 / W6 chunk byte vector b (low nibbles: columns 8c..8c+3,
  // high: 8c+4..8c+7); W5 and W6 OR in their high bits from the plane (qgemm.h: pl, and pl4 = pl << 4,
  // chunk cl's bits at kBits * cl).
  template <int F>
  static inline void codes(svbool_t p8, svuint8_t b, svuint8_t pl, svuint8_t pl4, int64_t cl, svint8_t& lo,
                           svint8_t& hi) {
    svuint8_t ulo = svand_n_u8_x(p8, b, 0x0f), uhi = svlsr_n_u8_x(p8, b, 4);
    if constexpr (Plane<F>::kBits > 0) {
      constexpr int kBits = Plane<F>::kBits;
      const uint8_t high = uint8_t(((1 << kBits) - 1) << 4), sh = uint8_t(kBits * cl);
      ulo = svorr_u8_x(p8, ulo, svand_n_u8_x(p8, svlsr_n_u8_x(p8, pl4, sh), high));
      uhi = svorr_u8_x(p8, uhi, svand_n_u8_x(p8, svlsr_n_u8_x(p8, pl, sh), high));
    }
    lo = svreinterpret_s8_u8(ulo);
    hi = svreinterpret_s8_u8(uhi);
  }

  // Chunk c (global index; cl = c - c0 within its group g) of a tile's bytes.
  template <int F>
  static inline const uint8_t* chunk_at(const uint8_t* wt, int64_t c, int64_t g, int64_t c0) {
    if constexpr (Plane<F>::kBits > 0)
      return Plane<F>::chunk(wt, g, c - c0);
    else if constexpr (F == kW8H)
      return w8h_chunk(wt, c, g);
    else
      return chunk(wt, c, g);
  }

  // F: kW4, kW8, kW8H (W8's loop, float16 scales), kW5 (group 32) or kW6 (group 16; W5 and W6:
  // W4's loop with the high bits from the plane, W8's fold after the integer dot of (u - offset) and a).
  template <int F, int NT>
  static void tile(const uint8_t* wt, const int8_t* const* q, const float* const* as,
                      const int32_t* const* gs, int64_t k,
                   int64_t group, float (*acc)[16]) {
    constexpr bool W4 = F == kW4, PL = Plane<F>::kBits > 0, NIB = F != kW8 && F != kW8H;
    constexpr int kOffset = Plane<F>::kOffset;
    const int64_t vb = svcntb() < 64 ? int64_t(svcntb()) : 64;  // bytes of a chunk per piece
    const svbool_t p8 = svwhilelt_b8(int64_t(0), vb);
    const svbool_t p32 = svwhilelt_b32(int64_t(0), vb / 4);
    const int64_t cols = NIB ? 8 : 4;  // columns per 64-byte chunk
    for (int64_t piece = 0; piece < 64; piece += vb) {
      svfloat32_t f0 = svdup_f32(0.f), f1 = svdup_f32(0.f), f2 = svdup_f32(0.f), f3 = svdup_f32(0.f);
      for (int64_t g = 0; g < k / group; ++g) {
        svint32_t i0 = svdup_s32(0), i1 = svdup_s32(0), i2 = svdup_s32(0), i3 = svdup_s32(0);
        const int64_t c0 = g * group / cols, c1 = (g + 1) * group / cols;
        svuint8_t pl = svdup_u8(0), pl4 = svdup_u8(0);
        if constexpr (PL) {
          pl = svld1_u8(p8, Plane<F>::plane(wt, g) + piece);
          pl4 = svlsl_n_u8_x(p8, pl, 4);
        }
        // chunk c of this group's tile bytes, this piece of it
        auto at = [&](int64_t c) { return chunk_at<F>(wt, c, g, c0) + piece; };
        if (NT == 1) {
          // Decode: two chunks a step into four chains (low / high nibbles x even / odd chunk; w8:
          // two), summed once per group (integer sums: the same result). One chain of SDOTs held
          // Neoverse V1 to 6 cycles a chunk where its pipes need 2 (llvm-mca, benchmarks/arm_model.py).
#define ARMSERVE_DECODE_STEP(C, A, B)                                                             \
  {                                                                                               \
    const svuint8_t b = svld1_u8(p8, at(C));                                                      \
    if (NIB) {                                                                                    \
      svint8_t lo, hi;                                                                            \
      codes<F>(p8, b, pl, pl4, (C) - c0, lo, hi);                                                 \
      A = svdot_s32(A, lo, svreinterpret_s8_s32(svdup_n_s32(load4(q[0] + (C) * 8))));             \
      B = svdot_s32(B, hi, svreinterpret_s8_s32(svdup_n_s32(load4(q[0] + (C) * 8 + 4))));         \
    } else {                                                                                      \
      A = svdot_s32(A, svreinterpret_s8_u8(b), svreinterpret_s8_s32(svdup_n_s32(load4(q[0] + (C) * 4)))); \
    }                                                                                             \
  }
          int64_t c = c0;
          for (; c + 2 <= c1; c += 2) {
            ARMSERVE_DECODE_STEP(c, i0, i1)
            ARMSERVE_DECODE_STEP(c + 1, i2, i3)
          }
          if (c < c1) ARMSERVE_DECODE_STEP(c, i0, i1)
#undef ARMSERVE_DECODE_STEP
          i0 = svadd_s32_x(p32, svadd_s32_x(p32, i0, i1), svadd_s32_x(p32, i2, i3));
        }
        for (int64_t c = c0; NT > 1 && c < c1; ++c) {
          const svuint8_t b = svld1_u8(p8, at(c));
          if (NIB) {
            svint8_t lo, hi;
            codes<F>(p8, b, pl, pl4, c - c0, lo, hi);
#define ARMSERVE_W4_STEP(I, ACC)                                                              \
  if (NT > I) {                                                                               \
    ACC = svdot_s32(ACC, lo, svreinterpret_s8_s32(svdup_n_s32(load4(q[I] + c * 8))));         \
    ACC = svdot_s32(ACC, hi, svreinterpret_s8_s32(svdup_n_s32(load4(q[I] + c * 8 + 4))));     \
  }
            ARMSERVE_W4_STEP(0, i0) ARMSERVE_W4_STEP(1, i1) ARMSERVE_W4_STEP(2, i2) ARMSERVE_W4_STEP(3, i3)
#undef ARMSERVE_W4_STEP
          } else {
            const svint8_t w = svreinterpret_s8_u8(b);
#define ARMSERVE_W8_STEP(I, ACC) \
  if (NT > I) ACC = svdot_s32(ACC, w, svreinterpret_s8_s32(svdup_n_s32(load4(q[I] + c * 4))));
            ARMSERVE_W8_STEP(0, i0) ARMSERVE_W8_STEP(1, i1) ARMSERVE_W8_STEP(2, i2) ARMSERVE_W8_STEP(3, i3)
#undef ARMSERVE_W8_STEP
          }
        }
        svfloat32_t s, z = svdup_f32(0.f);
        if constexpr (F == kW6) {  // d * sc, exact
          s = svmul_f32_x(p32, svld1_f32(p32, w6_d(wt, g) + piece / 4),
                          svcvt_f32_s32_x(p32, svld1sb_s32(p32, w6_sc(wt, g) + piece / 4)));
        } else if constexpr (NIB) {  // float16 scales inline (qgemm.h)
          const uint16_t* h = (F == kW5 ? w5_scales(wt, g) : w4_scales(wt, g, group)) + piece / 4;
          s = svcvt_f32_f16_x(p32, svreinterpret_f16_u32(svld1uh_u32(p32, h)));
          if (W4) z = svcvt_f32_f16_x(p32, svreinterpret_f16_u32(svld1uh_u32(p32, h + 16)));
        } else {
          if constexpr (F == kW8H)
            s = svcvt_f32_f16_x(p32, svreinterpret_f16_u32(svld1uh_u32(p32, w8h_scales(wt, g, group) + piece / 4)));
          else
            s = svld1_f32(p32, w8_scales(wt, g, group) + piece / 4);
          z = svdup_f32(0.f);  // unused: signed x signed needs no offset
        }
#define ARMSERVE_FOLD(I, ACC, F)                                                     \
  if (NT > I) {                                                                      \
    if (PL) ACC = svsub_n_s32_x(p32, ACC, kOffset * gs[I][g]); /* the dot of (u - offset) and a */ \
    F = svmla_f32_x(p32, F, svmul_n_f32_x(p32, s, as[I][g]), svcvt_f32_s32_x(p32, ACC)); \
    if (W4) F = svmls_n_f32_x(p32, F, z, as[I][g] * float(gs[I][g]));                 \
  }
        ARMSERVE_FOLD(0, i0, f0) ARMSERVE_FOLD(1, i1, f1) ARMSERVE_FOLD(2, i2, f2) ARMSERVE_FOLD(3, i3, f3)
#undef ARMSERVE_FOLD
      }
      if (NT > 0) svst1_f32(p32, acc[0] + piece / 4, f0);
      if (NT > 1) svst1_f32(p32, acc[1] + piece / 4, f1);
      if (NT > 2) svst1_f32(p32, acc[2] + piece / 4, f2);
      if (NT > 3) svst1_f32(p32, acc[3] + piece / 4, f3);
    }
  }

  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile<kW4, NT>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile<kW8, NT>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w8h(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    tile<kW8H, NT>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w5(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile<kW5, NT>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w6(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile<kW6, NT>(wt, q, as, gs, k, group, acc);
  }
};
}  // namespace

extern "C" const QKernelTable* armserve_qtable_sve() {
  return armserve::QKernels<armserve::ScalarOps, QSve>::table("sve");
}
