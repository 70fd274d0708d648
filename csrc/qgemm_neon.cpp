// Quantized GEMM with NEON SDOT (the dotprod extension: Neoverse N1 and later): vdotq_s32
// multiplies 4 signed bytes by 4 per 32-bit lane, so 4 registers cover a 16-row tile.
#include <arm_neon.h>

#include "qgemm_impl.h"

namespace {
using armserve::load4;
using armserve::chunk;
using armserve::w4_scales;
using armserve::w8_scales;
using armserve::w8h_chunk;
using armserve::w8h_scales;
using armserve::w5_scales;
using armserve::w6_sc;
using armserve::w6_d;
using armserve::Plane;
using armserve::kW4;
using armserve::kW5;
using armserve::kW6;

struct QNeon {
  // One table row dequantized (qgemm_impl.h ScalarQ has the reference and the rules): 4 bytes of
  // each 64-byte chunk of its tile.
  static void row_w4(const uint8_t* wt, int r, int64_t k, int64_t group, const float* exact, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const uint16_t* h = w4_scales(wt, g, group);
      const float32x4_t s = vdupq_n_f32(exact ? exact[2 * g] : armserve::f16_to_f32(h[r]));
      const float32x4_t z = vdupq_n_f32(exact ? exact[2 * g + 1] : armserve::f16_to_f32(h[16 + r]));
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        const uint32_t b = uint32_t(load4(reinterpret_cast<const int8_t*>(chunk(wt, c, g)) + r * 4));
        // lanes 0-3: the low nibbles (columns 8c .. 8c+3), lanes 4-7: the high ones
        const uint64_t u = uint64_t(b & 0x0f0f0f0fu) | (uint64_t((b >> 4) & 0x0f0f0f0fu) << 32);
        const uint16x8_t w = vmovl_u8(vcreate_u8(u));
        const float32x4_t lo = vcvtq_f32_u32(vmovl_u16(vget_low_u16(w)));
        const float32x4_t hi = vcvtq_f32_u32(vmovl_u16(vget_high_u16(w)));
        vst1q_f32(out + c * 8, vsubq_f32(vmulq_f32(lo, s), z));
        vst1q_f32(out + c * 8 + 4, vsubq_f32(vmulq_f32(hi, s), z));
      }
    }
  }

  static void row_w8(const uint8_t* wt, int r, int64_t k, int64_t group, float* out) {
    for (int64_t g = 0; g < k / group; ++g) {
      const float32x4_t s = vdupq_n_f32(w8_scales(wt, g, group)[r]);
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        const uint32_t b = uint32_t(load4(reinterpret_cast<const int8_t*>(chunk(wt, c, g)) + r * 4));
        const int16x8_t w = vmovl_s8(vcreate_s8(uint64_t(b)));
        vst1q_f32(out + c * 4, vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), s));
      }
    }
  }

  // W4, and W5 (F = kW5, group 32) and W6 (kW6, group 16): each code's high bits ORed in from the
  // group's plane (qgemm.h). Codes 0..63 are valid signed SDOT operands.
  template <int NT, int F>
  static void tile_nib(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    constexpr bool PL = Plane<F>::kBits > 0;
    constexpr int kBits = Plane<F>::kBits, kOffset = Plane<F>::kOffset;
    const uint8x16_t nib = vdupq_n_u8(0x0f), high = vdupq_n_u8(uint8_t(((1 << kBits) - 1) << 4));
    float32x4_t facc[NT][4];
    for (int i = 0; i < NT; ++i)
      for (int h = 0; h < 4; ++h) facc[i][h] = vdupq_n_f32(0.f);
    for (int64_t g = 0; g < k / group; ++g) {
      int32x4_t ia[NT][4];
      for (int i = 0; i < NT; ++i)
        for (int h = 0; h < 4; ++h) ia[i][h] = vdupq_n_s32(0);
      uint8x16_t pl[4], pl4[4];  // the plane's rows 4h .. 4h+3, and shifted to put chunk 0's low code bits at 4
      if constexpr (PL)
        for (int h = 0; h < 4; ++h) {
          pl[h] = vld1q_u8(Plane<F>::plane(wt, g) + h * 16);
          pl4[h] = vshlq_n_u8(pl[h], 4);
        }
      const int64_t c_first = g * group / 8;
      for (int64_t c = c_first; c < (g + 1) * group / 8; ++c) {
        int8x16_t a0[NT], a1[NT];
        for (int i = 0; i < NT; ++i) {
          a0[i] = vreinterpretq_s8_s32(vdupq_n_s32(load4(q[i] + c * 8)));
          a1[i] = vreinterpretq_s8_s32(vdupq_n_s32(load4(q[i] + c * 8 + 4)));
        }
        const uint8_t* cp;
        if constexpr (PL)
          cp = Plane<F>::chunk(wt, g, c - c_first);
        else
          cp = chunk(wt, c, g);
        const int8x16_t right = vdupq_n_s8(int8_t(kBits * (c_first - c)));  // (vshlq by a negative count: right)
        for (int h = 0; h < 4; ++h) {  // rows 4h .. 4h+3
          const uint8x16_t b = vld1q_u8(cp + h * 16);
          uint8x16_t ulo = vandq_u8(b, nib), uhi = vshrq_n_u8(b, 4);
          if constexpr (PL) {
            ulo = vorrq_u8(ulo, vandq_u8(vshlq_u8(pl4[h], right), high));
            uhi = vorrq_u8(uhi, vandq_u8(vshlq_u8(pl[h], right), high));
          }
          const int8x16_t lo = vreinterpretq_s8_u8(ulo), hi = vreinterpretq_s8_u8(uhi);
          for (int i = 0; i < NT; ++i) {
            ia[i][h] = vdotq_s32(ia[i][h], lo, a0[i]);
            ia[i][h] = vdotq_s32(ia[i][h], hi, a1[i]);
          }
        }
      }
      for (int h = 0; h < 4; ++h) {
        if constexpr (PL) {  // the integer dot of (u - offset) and a, folded as tile_w8 folds its own
          float32x4_t s;
          if constexpr (F == kW6)  // d * sc, exact
            s = vmulq_f32(vld1q_f32(w6_d(wt, g) + h * 4),
                          vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(w6_sc(wt, g) + h * 4))))));
          else
            s = vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(w5_scales(wt, g)) + h * 4));
          for (int i = 0; i < NT; ++i) {
            const int32x4_t d = vsubq_s32(ia[i][h], vdupq_n_s32(kOffset * gs[i][g]));
            facc[i][h] = vfmaq_f32(facc[i][h], vmulq_n_f32(s, as[i][g]), vcvtq_f32_s32(d));
          }
          continue;
        }
        const float16_t* hs = reinterpret_cast<const float16_t*>(w4_scales(wt, g, group));
        const float32x4_t s = vcvt_f32_f16(vld1_f16(hs + h * 4)), z = vcvt_f32_f16(vld1_f16(hs + 16 + h * 4));
        for (int i = 0; i < NT; ++i) {
          facc[i][h] = vfmaq_f32(facc[i][h], vmulq_n_f32(s, as[i][g]), vcvtq_f32_s32(ia[i][h]));
          facc[i][h] = vfmsq_f32(facc[i][h], z, vdupq_n_f32(as[i][g] * float(gs[i][g])));
        }
      }
    }
    for (int i = 0; i < NT; ++i)
      for (int h = 0; h < 4; ++h) vst1q_f32(acc[i] + h * 4, facc[i][h]);
  }

  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile_nib<NT, kW4>(wt, q, as, gs, k, group, acc);
  }
  // (the i8mm variant too: its SMMLA tiles are W4 / W8 only, and the folds agree bit for bit; W6, W8H alike)
  template <int NT>
  static void tile_w5(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile_nib<NT, kW5>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w6(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    tile_nib<NT, kW6>(wt, q, as, gs, k, group, acc);
  }

  // (H: the W8H layout, float16 scales: the same sums and float ops)
  template <int NT, bool H = false>
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    (void)gs;  // signed x signed: no offset to correct
    float32x4_t facc[NT][4];
    for (int i = 0; i < NT; ++i)
      for (int h = 0; h < 4; ++h) facc[i][h] = vdupq_n_f32(0.f);
    for (int64_t g = 0; g < k / group; ++g) {
      int32x4_t ia[NT][4];
      for (int i = 0; i < NT; ++i)
        for (int h = 0; h < 4; ++h) ia[i][h] = vdupq_n_s32(0);
      for (int64_t c = g * group / 4; c < (g + 1) * group / 4; ++c) {
        int8x16_t a[NT];
        for (int i = 0; i < NT; ++i) a[i] = vreinterpretq_s8_s32(vdupq_n_s32(load4(q[i] + c * 4)));
        for (int h = 0; h < 4; ++h) {
          const uint8_t* cp = H ? w8h_chunk(wt, c, g) : chunk(wt, c, g);
          const int8x16_t w = vld1q_s8(reinterpret_cast<const int8_t*>(cp) + h * 16);
          for (int i = 0; i < NT; ++i) ia[i][h] = vdotq_s32(ia[i][h], w, a[i]);
        }
      }
      for (int h = 0; h < 4; ++h) {
        const float32x4_t s =
            H ? vcvt_f32_f16(vld1_f16(reinterpret_cast<const float16_t*>(w8h_scales(wt, g, group)) + h * 4))
              : vld1q_f32(w8_scales(wt, g, group) + h * 4);
        for (int i = 0; i < NT; ++i) facc[i][h] = vfmaq_f32(facc[i][h], vmulq_n_f32(s, as[i][g]), vcvtq_f32_s32(ia[i][h]));
      }
    }
    for (int i = 0; i < NT; ++i)
      for (int h = 0; h < 4; ++h) vst1q_f32(acc[i] + h * 4, facc[i][h]);
  }
  template <int NT>
  static void tile_w8h(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                       int64_t k, int64_t group, float (*acc)[16]) {
    tile_w8<NT, true>(wt, q, as, gs, k, group, acc);
  }

};

// i8mm (Graviton3/4, Grace, Neoverse N2/V1): SMMLA multiplies a 2x8 int8 matrix (2 tokens x 8
// columns) by an 8x2 one (8 columns x 2 weight rows) into a 2x2 int32 block, twice the
// multiply-adds of SDOT per instruction. Prefill tiles (4 tokens) use it; decode (1 token) keeps
// SDOT, where SMMLA would waste half its lanes. Rows of the SDOT layout are regrouped into
// row pairs with one zip per 4 rows, so the packed layout stays the same.
struct QNeonI8mm : QNeon {
  template <bool W4>
  __attribute__((target("arch=armv8.2-a+dotprod+i8mm"))) static void tile4_mmla(
      const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs, int64_t k,
      int64_t group, float (*acc)[16]) {
    const uint8x16_t nib = vdupq_n_u8(0x0f);
    for (int half = 0; half < 2; ++half) {  // rows 8 * half .. 8 * half + 7 (keeps registers < 32)
      float32x4_t facc[4][2];
      for (int i = 0; i < 4; ++i) facc[i][0] = facc[i][1] = vdupq_n_f32(0.f);
      for (int64_t g = 0; g < k / group; ++g) {
        int32x4_t ia[2][4];  // [token pair][row pair]: lanes (t0 r0, t0 r1, t1 r0, t1 r1)
        for (int t = 0; t < 2; ++t)
          for (int r = 0; r < 4; ++r) ia[t][r] = vdupq_n_s32(0);
        for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {  // 8 columns per step
          const int8x16_t a0 = vcombine_s8(vld1_s8(q[0] + c * 8), vld1_s8(q[1] + c * 8));
          const int8x16_t a1 = vcombine_s8(vld1_s8(q[2] + c * 8), vld1_s8(q[3] + c * 8));
          for (int h = 0; h < 2; ++h) {  // 4 rows: columns 0-3 in `lo`, 4-7 in `hi`, 4 bytes a row
            int8x16_t lo, hi;
            if (W4) {
              const uint8x16_t b = vld1q_u8(chunk(wt, c, g) + half * 32 + h * 16);
              lo = vreinterpretq_s8_u8(vandq_u8(b, nib));
              hi = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
            } else {  // two 4-column chunks
              lo = vld1q_s8(reinterpret_cast<const int8_t*>(chunk(wt, 2 * c, g)) + half * 32 + h * 16);
              hi = vld1q_s8(reinterpret_cast<const int8_t*>(chunk(wt, 2 * c + 1, g)) + half * 32 + h * 16);
            }
            const int32x4_t l32 = vreinterpretq_s32_s8(lo), h32 = vreinterpretq_s32_s8(hi);
            const int8x16_t b01 = vreinterpretq_s8_s32(vzip1q_s32(l32, h32));  // rows 0, 1 x 8 columns
            const int8x16_t b23 = vreinterpretq_s8_s32(vzip2q_s32(l32, h32));  // rows 2, 3
            ia[0][2 * h] = vmmlaq_s32(ia[0][2 * h], a0, b01);
            ia[0][2 * h + 1] = vmmlaq_s32(ia[0][2 * h + 1], a0, b23);
            ia[1][2 * h] = vmmlaq_s32(ia[1][2 * h], a1, b01);
            ia[1][2 * h + 1] = vmmlaq_s32(ia[1][2 * h + 1], a1, b23);
          }
        }
        for (int h = 0; h < 2; ++h) {
          const int row = half * 8 + h * 4;
          float32x4_t s, z = vdupq_n_f32(0.f);
          if (W4) {
            const float16_t* hs = reinterpret_cast<const float16_t*>(w4_scales(wt, g, group));
            s = vcvt_f32_f16(vld1_f16(hs + row));
            z = vcvt_f32_f16(vld1_f16(hs + 16 + row));
          } else {
            s = vld1q_f32(w8_scales(wt, g, group) + row);
          }
          for (int t = 0; t < 2; ++t) {
            // rows 4h..4h+3 of the pair's first token (low halves) and second token (high halves)
            const int32x4_t v[2] = {vcombine_s32(vget_low_s32(ia[t][2 * h]), vget_low_s32(ia[t][2 * h + 1])),
                                    vcombine_s32(vget_high_s32(ia[t][2 * h]), vget_high_s32(ia[t][2 * h + 1]))};
            for (int u = 0; u < 2; ++u) {
              const int i = 2 * t + u;
              facc[i][h] = vfmaq_f32(facc[i][h], vmulq_n_f32(s, as[i][g]), vcvtq_f32_s32(v[u]));
              if (W4) facc[i][h] = vfmsq_f32(facc[i][h], z, vdupq_n_f32(as[i][g] * float(gs[i][g])));
            }
          }
        }
      }
      for (int i = 0; i < 4; ++i) {
        vst1q_f32(acc[i] + half * 8, facc[i][0]);
        vst1q_f32(acc[i] + half * 8 + 4, facc[i][1]);
      }
    }
  }

  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    if constexpr (NT == 4)
      tile4_mmla<true>(wt, q, as, gs, k, group, acc);
    else
      QNeon::tile_w4<NT>(wt, q, as, gs, k, group, acc);
  }
  template <int NT>
  static void tile_w8(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    if constexpr (NT == 4) {
      if (group % 8 == 0) return tile4_mmla<false>(wt, q, as, gs, k, group, acc);
    }
    QNeon::tile_w8<NT>(wt, q, as, gs, k, group, acc);
  }
};
}  // namespace

extern "C" const QKernelTable* armserve_qtable_neon() {
  return armserve::QKernels<armserve::ScalarOps, QNeon>::table("neon_dotprod");
}

extern "C" const QKernelTable* armserve_qtable_neon_i8mm() {
  return armserve::QKernels<armserve::ScalarOps, QNeonI8mm>::table("neon_i8mm");
}
