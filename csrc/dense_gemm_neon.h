// Dense bf16 GEMM tiles for NEON, shared by dense_gemm_neon.cpp and dense_gemm_sve.cpp (see there).
// A 16-column block of the packed layout is four q registers of 4 k-pair lanes. The activations
// are loaded 2 (fp32) or 4 (bf16) k-pairs at a time and picked by lane (fmla / bfdot by element),
// so no broadcast instruction is needed.
#pragma once
#include <arm_neon.h>

#include "dense_gemm_impl.h"

namespace armserve_dense {
namespace {

// Without BF16: each 32-bit pair lane widens to fp32 (<< 16 even k, & 0xffff0000 odd k).
// F32: float32 weights (a block's k-pair: 16 even-k then 16 odd-k weights) loaded as they are.
template <bool F32 = false>
struct NeonP : TileBase {
  static constexpr int kWeightBytes = F32 ? 4 : 2;
  static constexpr bool kDot = false;
  // 4 rows x 1 block: 16 accumulators + 4 activation registers + 3 temporaries of 32.
  static constexpr int MR = 4, NB = 1, kAlign = 2, kStreamRows = 0;
  // Each output is (even-k chain) + (odd-k chain) whatever the tile's shape, so that a row gets
  // the same bits alone (a decode step) as among others (a speculative verify step, a batch):
  // both chains in registers for a few accumulators (m = 1, 2: two dependency chains, not one),
  // two passes over the panel for larger tiles.
  template <int R, int B>
  static void tile(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc) {
    if constexpr (R * 4 * B <= 8) {
      pass<R, B, 2>(xa, xs, w, kp, acc);
    } else {
      pass<R, B, 0>(xa, xs, w, kp, acc);
      pass<R, B, 1>(xa, xs, w, kp, acc);
    }
  }
  // SET 0: the even-k chain into acc; 1: the odd-k chain added to acc; 2: both, in registers.
  template <int R, int B, int SET>
  static void pass(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc) {
    const float* x = static_cast<const float*>(xa);
    constexpr int H = 4 * B;
    constexpr bool kEven = SET != 1, kOdd = SET != 0;
    float32x4_t c[R][H], d[R][H];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) c[r][h] = d[r][h] = vdupq_n_f32(0.f);
    const uint32x4_t hi = vdupq_n_u32(0xffff0000u);
    const float* wf = reinterpret_cast<const float*>(w);
    (void)hi;
    (void)wf;
    const int64_t bs = kp * 32;  // a block, in weights
#define ARMSERVE_NEON_STEP(J)                                                                       \
  for (int h = 0; h < H; ++h) {                                                                     \
    float32x4_t we, wo;                                                                             \
    if constexpr (F32) {                                                                            \
      const float* src = wf + (h / 4) * bs + (p + J) * 32 + (h % 4) * 4;                            \
      if (kEven) we = vld1q_f32(src);                                                               \
      if (kOdd) wo = vld1q_f32(src + 16);                                                           \
    } else {                                                                                        \
      const uint32x4_t v = vld1q_u32(reinterpret_cast<const uint32_t*>(w + (h / 4) * bs + (p + J) * 32 + (h % 4) * 8)); \
      if (kEven) we = vreinterpretq_f32_u32(vshlq_n_u32(v, 16));                                    \
      if (kOdd) wo = vreinterpretq_f32_u32(vandq_u32(v, hi));                                       \
    }                                                                                               \
    for (int r = 0; r < R; ++r) {                                                                   \
      if (kEven) c[r][h] = vfmaq_laneq_f32(c[r][h], we, xv[r], 2 * J);                              \
      if (kOdd) d[r][h] = vfmaq_laneq_f32(d[r][h], wo, xv[r], 2 * J + 1);                           \
    }                                                                                               \
  }
    int64_t p = 0;
    for (; p + 2 <= kp; p += 2) {
      float32x4_t xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vld1q_f32(x + r * xs + 2 * p);
      ARMSERVE_NEON_STEP(0)
      ARMSERVE_NEON_STEP(1)
    }
    if (p < kp) {  // one pair left; the activation rows are padded to 2 pairs
      float32x4_t xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vld1q_f32(x + r * xs + 2 * p);
      ARMSERVE_NEON_STEP(0)
    }
#undef ARMSERVE_NEON_STEP
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) {
        float* o = acc + r * B * 16 + h * 4;
        if (SET == 2) vst1q_f32(o, vaddq_f32(c[r][h], d[r][h]));
        if (SET == 0) vst1q_f32(o, c[r][h]);
        if (SET == 1) vst1q_f32(o, vaddq_f32(vld1q_f32(o), d[r][h]));
      }
  }
};

// BF16 (Neoverse V1/N2 and later, HWCAP2_BF16): BFDOT by element multiplies a block register by
// one activation pair of a 4-pair register. The attribute keeps BFDOT out of every other function;
// the table is only picked when the CPU has it (dense_dispatch.cpp).
struct NeonBf16P : TileBase {
  static constexpr bool kDot = true;
  // 4 rows x 1 block: 16 accumulators + 4 activation registers + 1 weight register.
  static constexpr int MR = 4, NB = 1, kAlign = 4, kStreamRows = 0;
  // The 4 pairs of a step go into 4 sets (set j: pairs p = j mod 4), each one chain in k order,
  // added set after set: with few accumulators each takes one BFDOT a step, not a chain of 4
  // (llvm-mca, benchmarks/arm_model.py: at m = 1 one chain held Neoverse V1 to 16 cycles a step
  // where its pipes need 5.7; with 4 sets the loads set the pace, 6.4 cycles). Tiles with more
  // accumulators take the sets in 2 or 4 passes over the panel (SP sets a pass), so that every
  // tile shape sums in the same order: a row gets the same bits alone (a decode step) as among
  // others (a speculative verify step, a batch).
  template <int R, int B>
  static void tile(const void* xa, int64_t xs, const uint16_t* w, int64_t kp, float* acc) {
    constexpr int SP = R * 4 * B <= 4 ? 4 : (R * 4 * B <= 8 ? 2 : 1);
    pass<R, B, SP, 0>(xa, xs, w, kp, acc);
    if constexpr (SP < 4) pass<R, B, SP, 1>(xa, xs, w, kp, acc);
    if constexpr (SP < 2) {
      pass<R, B, SP, 2>(xa, xs, w, kp, acc);
      pass<R, B, SP, 3>(xa, xs, w, kp, acc);
    }
  }
  // Sets [G * SP, (G + 1) * SP): written to acc (G = 0) or added to it.
  template <int R, int B, int SP, int G>
  __attribute__((target("arch=armv8.2-a+bf16"))) static void pass(const void* xa, int64_t xs, const uint16_t* w,
                                                                   int64_t kp, float* acc) {
    const bfloat16_t* x = reinterpret_cast<const bfloat16_t*>(xa);  // rows xs pairs = 2 xs bf16 apart
    const bfloat16_t* wb = reinterpret_cast<const bfloat16_t*>(w);
    constexpr int H = 4 * B, J0 = G * SP;
    float32x4_t c[SP][R][H];
    for (int s = 0; s < SP; ++s)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) c[s][r][h] = vdupq_n_f32(0.f);
    const int64_t bs = kp * 32;
#define ARMSERVE_BFDOT_STEP(J)                                                                  \
  if (J >= J0 && J < J0 + SP)                                                                   \
    for (int h = 0; h < H; ++h) {                                                               \
      const bfloat16x8_t v = vld1q_bf16(wb + (h / 4) * bs + (p + J) * 32 + (h % 4) * 8);          \
      for (int r = 0; r < R; ++r)                                                               \
        c[(J - J0) % SP][r][h] = vbfdotq_laneq_f32(c[(J - J0) % SP][r][h], v, xv[r], J);        \
    }
    int64_t p = 0;
    for (; p + 4 <= kp; p += 4) {
      bfloat16x8_t xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vld1q_bf16(x + r * xs * 2 + 2 * p);
      ARMSERVE_BFDOT_STEP(0)
      ARMSERVE_BFDOT_STEP(1)
      ARMSERVE_BFDOT_STEP(2)
      ARMSERVE_BFDOT_STEP(3)
    }
    if (p < kp) {  // 1-3 pairs left; the activation rows are padded to 4 pairs
      bfloat16x8_t xv[R];
      for (int r = 0; r < R; ++r) xv[r] = vld1q_bf16(x + r * xs * 2 + 2 * p);
      ARMSERVE_BFDOT_STEP(0)
      if (p + 1 < kp) {
        ARMSERVE_BFDOT_STEP(1)
      }
      if (p + 2 < kp) {
        ARMSERVE_BFDOT_STEP(2)
      }
    }
#undef ARMSERVE_BFDOT_STEP
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) {
        float* o = acc + r * B * 16 + h * 4;
        float32x4_t t = G == 0 ? c[0][r][h] : vaddq_f32(vld1q_f32(o), c[0][r][h]);
        for (int s = 1; s < SP; ++s) t = vaddq_f32(t, c[s][r][h]);
        vst1q_f32(o, t);
      }
  }
};

}  // namespace
}  // namespace armserve_dense
