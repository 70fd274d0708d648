// NEON (AdvSIMD) variant: every ARMv8-A server core (Ampere Altra, Graviton2+, Grace).
// NOTE: bf16 is widened by a 16-bit shift and all math runs in fp32 FMAs, so cores without
// the BF16 extension (Neoverse N1) take the same exact path.
#include <arm_neon.h>

#include "kernels_impl.h"

namespace {
using armserve::ScalarOps;
using armserve::dtype_size;

struct IsaNeon {
  // bf16/f16/f32 -> fp32 in registers (fused into the FMAs of dot_w).
  static float32x4_t wload(int dtype, const void* w, int64_t i) {
    if (dtype == AS_BF16)
      return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(w) + i), 16));
    if (dtype == AS_F16) return vcvt_f32_f16(vld1_f16(static_cast<const float16_t*>(w) + i));
    return vld1q_f32(static_cast<const float*>(w) + i);
  }
  // BF16 extension (Graviton3/4, Grace): BFDOT multiplies bf16 pairs and accumulates in fp32, no
  // widening step. Only called when the CPU has it (armserve_bf16_dot, dispatch.cpp); the
  // attribute keeps the instruction out of every other function of this file.
  __attribute__((target("arch=armv8.2-a+bf16"))) static float dot_bf16(const uint16_t* w, const uint16_t* x,
                                                                       int64_t k) {
    float32x4_t a0 = vdupq_n_f32(0.f), a1 = vdupq_n_f32(0.f), a2 = vdupq_n_f32(0.f), a3 = vdupq_n_f32(0.f);
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      a0 = vbfdotq_f32(a0, vreinterpretq_bf16_u16(vld1q_u16(w + i)), vreinterpretq_bf16_u16(vld1q_u16(x + i)));
      a1 = vbfdotq_f32(a1, vreinterpretq_bf16_u16(vld1q_u16(w + i + 8)), vreinterpretq_bf16_u16(vld1q_u16(x + i + 8)));
      a2 = vbfdotq_f32(a2, vreinterpretq_bf16_u16(vld1q_u16(w + i + 16)),
                       vreinterpretq_bf16_u16(vld1q_u16(x + i + 16)));
      a3 = vbfdotq_f32(a3, vreinterpretq_bf16_u16(vld1q_u16(w + i + 24)),
                       vreinterpretq_bf16_u16(vld1q_u16(x + i + 24)));
    }
    for (; i + 8 <= k; i += 8)
      a0 = vbfdotq_f32(a0, vreinterpretq_bf16_u16(vld1q_u16(w + i)), vreinterpretq_bf16_u16(vld1q_u16(x + i)));
    const float s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
    return i < k ? s + ScalarOps::dot_w(AS_BF16, w + i, x + i, k - i) : s;
  }
  static float dot_w(int dtype, const void* w, const void* x, int64_t k) {
    if (dtype == AS_BF16 && armserve_bf16_dot)
      return dot_bf16(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(x), k);
    // 4 accumulators: enough FMAs in flight to keep up with the memory stream.
    float32x4_t a0 = vdupq_n_f32(0.f), a1 = vdupq_n_f32(0.f), a2 = vdupq_n_f32(0.f), a3 = vdupq_n_f32(0.f);
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      a0 = vfmaq_f32(a0, wload(dtype, w, i), wload(dtype, x, i));
      a1 = vfmaq_f32(a1, wload(dtype, w, i + 4), wload(dtype, x, i + 4));
      a2 = vfmaq_f32(a2, wload(dtype, w, i + 8), wload(dtype, x, i + 8));
      a3 = vfmaq_f32(a3, wload(dtype, w, i + 12), wload(dtype, x, i + 12));
    }
    for (; i + 4 <= k; i += 4) a0 = vfmaq_f32(a0, wload(dtype, w, i), wload(dtype, x, i));
    const float s = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a1), vaddq_f32(a2, a3)));
    if (i == k) return s;
    const int es = dtype_size(dtype);
    return s + ScalarOps::dot_w(dtype, static_cast<const char*>(w) + i * es, static_cast<const char*>(x) + i * es, k - i);
  }
  static float dot(const float* a, const float* b, int64_t n) {
    float32x4_t acc0 = vdupq_n_f32(0.f), acc1 = vdupq_n_f32(0.f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
      acc1 = vfmaq_f32(acc1, vld1q_f32(a + i + 4), vld1q_f32(b + i + 4));
    }
    for (; i + 4 <= n; i += 4) acc0 = vfmaq_f32(acc0, vld1q_f32(a + i), vld1q_f32(b + i));
    float s = vaddvq_f32(vaddq_f32(acc0, acc1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* y, float a, const float* x, int64_t n) {
    const float32x4_t va = vdupq_n_f32(a);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) vst1q_f32(y + i, vfmaq_f32(vld1q_f32(y + i), va, vld1q_f32(x + i)));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  // 4 rows side by side: 4 accumulators over k, then one transposing reduction (pairwise adds).
  static void dots(const float* rows, int64_t ld, const float* v, int64_t k, float* out, int64_t n) {
    const int64_t k4 = k & ~int64_t(3);
    int64_t c = 0;
    if (k4 == k)
      for (; c + 4 <= n; c += 4) {
        const float* r = rows + c * ld;
        float32x4_t a0 = vdupq_n_f32(0.f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < k4; i += 4) {
          const float32x4_t vi = vld1q_f32(v + i);
          a0 = vfmaq_f32(a0, vld1q_f32(r + i), vi);
          a1 = vfmaq_f32(a1, vld1q_f32(r + ld + i), vi);
          a2 = vfmaq_f32(a2, vld1q_f32(r + 2 * ld + i), vi);
          a3 = vfmaq_f32(a3, vld1q_f32(r + 3 * ld + i), vi);
        }
        vst1q_f32(out + c, vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3)));
      }
    if (c < n) ScalarOps::dots(rows + c * ld, ld, v, k, out + c, n - c);
  }
  static void load(int dtype, const void* src, float* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == AS_BF16) {
      auto s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8) {
        uint16x8_t w = vld1q_u16(s + i);
        vst1q_f32(dst + i, vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(w), 16)));
        vst1q_f32(dst + i + 4, vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(w), 16)));
      }
    } else if (dtype == AS_F16) {
      auto s = reinterpret_cast<const float16_t*>(src);
      for (; i + 8 <= n; i += 8) {
        float16x8_t h = vld1q_f16(s + i);
        vst1q_f32(dst + i, vcvt_f32_f16(vget_low_f16(h)));
        vst1q_f32(dst + i + 4, vcvt_high_f32_f16(h));
      }
    }
    if (i < n) ScalarOps::load(dtype, static_cast<const char*>(src) + i * (dtype == AS_F32 ? 4 : 2), dst + i, n - i);
  }
  static void store(int dtype, const float* src, void* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == AS_BF16) {
      auto d = static_cast<uint16_t*>(dst);
      const uint32x4_t bias = vdupq_n_u32(0x7fff), one = vdupq_n_u32(1), qnan = vdupq_n_u32(0x7fc0);
      for (; i + 4 <= n; i += 4) {
        float32x4_t f = vld1q_f32(src + i);
        uint32x4_t u = vreinterpretq_u32_f32(f);
        uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(bias, vandq_u32(vshrq_n_u32(u, 16), one))), 16);
        r = vbslq_u32(vceqq_f32(f, f), r, qnan);  // lanes that are not equal to themselves are NaN
        vst1_u16(d + i, vmovn_u32(r));
      }
    } else if (dtype == AS_F16) {
      auto d = reinterpret_cast<float16_t*>(dst);
      for (; i + 4 <= n; i += 4) vst1_f16(d + i, vcvt_f16_f32(vld1q_f32(src + i)));
    }
    if (i < n) ScalarOps::store(dtype, src + i, static_cast<char*>(dst) + i * (dtype == AS_F32 ? 4 : 2), n - i);
  }
  static void load_i8(const int8_t* src, float scale, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const int16x8_t w = vmovl_s8(vld1_s8(src + i));  // sign-extend 8 -> 16 -> 32 bits
      vst1q_f32(dst + i, vmulq_n_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), scale));
      vst1q_f32(dst + i + 4, vmulq_n_f32(vcvtq_f32_s32(vmovl_high_s16(w)), scale));
    }
    if (i < n) ScalarOps::load_i8(src + i, scale, dst + i, n - i);
  }
};
}  // namespace

extern "C" const KernelTable* armserve_table_neon() { return armserve::Kernels<IsaNeon>::table("neon"); }
