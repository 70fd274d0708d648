// Quantized GEMM with NEON SDOT (the dotprod extension: Neoverse N1 and later): vdotq_s32
// multiplies 4 signed bytes by 4 per 32-bit lane, so 4 registers cover a 16-row tile.
#include <arm_neon.h>

#include "qgemm_impl.h"

namespace {
using armserve::load4;
using armserve::w4_chunk;
using armserve::w4_scales;

struct QNeon {
  template <int NT>
  static void tile_w4(const uint8_t* wt, const int8_t* const* q, const float* const* as, const int32_t* const* gs,
                      int64_t k, int64_t group, float (*acc)[16]) {
    const uint8x16_t nib = vdupq_n_u8(0x0f);
    float32x4_t facc[NT][4];
    for (int i = 0; i < NT; ++i)
      for (int h = 0; h < 4; ++h) facc[i][h] = vdupq_n_f32(0.f);
    for (int64_t g = 0; g < k / group; ++g) {
      int32x4_t ia[NT][4];
      for (int i = 0; i < NT; ++i)
        for (int h = 0; h < 4; ++h) ia[i][h] = vdupq_n_s32(0);
      for (int64_t c = g * group / 8; c < (g + 1) * group / 8; ++c) {
        int8x16_t a0[NT], a1[NT];
        for (int i = 0; i < NT; ++i) {
          a0[i] = vreinterpretq_s8_s32(vdupq_n_s32(load4(q[i] + c * 8)));
          a1[i] = vreinterpretq_s8_s32(vdupq_n_s32(load4(q[i] + c * 8 + 4)));
        }
        for (int h = 0; h < 4; ++h) {  // rows 4h .. 4h+3
          const uint8x16_t b = vld1q_u8(w4_chunk(wt, c, g) + h * 16);
          const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(b, nib));
          const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(b, 4));
          for (int i = 0; i < NT; ++i) {
            ia[i][h] = vdotq_s32(ia[i][h], lo, a0[i]);
            ia[i][h] = vdotq_s32(ia[i][h], hi, a1[i]);
          }
        }
      }
      const float16_t* hs = reinterpret_cast<const float16_t*>(w4_scales(wt, g, group));
      for (int h = 0; h < 4; ++h) {
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
  static void tile_w8(const uint8_t* wt, const float* sc, const int8_t* const* q, const float* const* as,
                      const int32_t* const* gs, int64_t k,
                      int64_t group, float (*acc)[16]) {
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
          const int8x16_t w = vld1q_s8(reinterpret_cast<const int8_t*>(wt) + c * 64 + h * 16);
          for (int i = 0; i < NT; ++i) ia[i][h] = vdotq_s32(ia[i][h], w, a[i]);
        }
      }
      for (int h = 0; h < 4; ++h) {
        const float32x4_t s = vld1q_f32(sc + g * 32 + h * 4);
        for (int i = 0; i < NT; ++i) facc[i][h] = vfmaq_f32(facc[i][h], vmulq_n_f32(s, as[i][g]), vcvtq_f32_s32(ia[i][h]));
      }
    }
    for (int i = 0; i < NT; ++i)
      for (int h = 0; h < 4; ++h) vst1q_f32(acc[i] + h * 4, facc[i][h]);
  }
};
}  // namespace

extern "C" const QKernelTable* armserve_qtable_neon() {
  return armserve::QKernels<armserve::ScalarOps, QNeon>::table("neon_dotprod");
}
