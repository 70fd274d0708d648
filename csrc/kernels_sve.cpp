// SVE variant, vector-length agnostic: the same binary runs 128-bit (Graviton4, Grace),
// 256-bit (Graviton3) and 512-bit SVE; every loop is predicated with whilelt.
#include <arm_sve.h>

#include "kernels_impl.h"

namespace {
using armserve::ScalarOps;

struct IsaSve {
  // bf16/f16/f32 -> fp32 in registers (fused into the FMAs of dot_w), vector-length agnostic.
  static svfloat32_t wload(int dtype, svbool_t pg, const void* w, int64_t i) {
    if (dtype == AS_F32) return svld1_f32(pg, static_cast<const float*>(w) + i);
    const svuint32_t h = svld1uh_u32(pg, static_cast<const uint16_t*>(w) + i);
    if (dtype == AS_BF16) return svreinterpret_f32_u32(svlsl_n_u32_x(pg, h, 16));
    return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
  }
  // SVE BF16 (Graviton3, Grace): BFDOT on whole vectors of bf16 pairs, fp32 accumulation. Only
  // called when the CPU has it (armserve_bf16_dot, dispatch.cpp); the attribute keeps the
  // instruction out of every other function of this file. Inactive lanes load as zero.
  __attribute__((target("arch=armv8.2-a+sve+bf16"))) static float dot_bf16(const uint16_t* w, const uint16_t* x,
                                                                           int64_t k) {
    svfloat32_t a0 = svdup_f32(0.f), a1 = svdup_f32(0.f);
    const int64_t vl = svcnth();
    for (int64_t i = 0; i < k; i += 2 * vl) {
      const svbool_t p0 = svwhilelt_b16(i, k), p1 = svwhilelt_b16(i + vl, k);
      a0 = svbfdot_f32(a0, svreinterpret_bf16_u16(svld1_u16(p0, w + i)), svreinterpret_bf16_u16(svld1_u16(p0, x + i)));
      a1 = svbfdot_f32(a1, svreinterpret_bf16_u16(svld1_u16(p1, w + i + vl)),
                       svreinterpret_bf16_u16(svld1_u16(p1, x + i + vl)));
    }
    return svaddv_f32(svptrue_b32(), svadd_f32_x(svptrue_b32(), a0, a1));
  }
  static float dot_w(int dtype, const void* w, const void* x, int64_t k) {
    if (dtype == AS_BF16 && armserve_bf16_dot)
      return dot_bf16(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(x), k);
    // 4 accumulators: enough FMAs in flight to keep up with the memory stream (128-bit SVE
    // would otherwise retire one vector of 4 per FMA latency).
    svfloat32_t a0 = svdup_f32(0.f), a1 = svdup_f32(0.f), a2 = svdup_f32(0.f), a3 = svdup_f32(0.f);
    const int64_t vl = svcntw();
    for (int64_t i = 0; i < k; i += 4 * vl) {
      const svbool_t p0 = svwhilelt_b32(i, k), p1 = svwhilelt_b32(i + vl, k), p2 = svwhilelt_b32(i + 2 * vl, k),
                     p3 = svwhilelt_b32(i + 3 * vl, k);
      a0 = svmla_f32_m(p0, a0, wload(dtype, p0, w, i), wload(dtype, p0, x, i));
      a1 = svmla_f32_m(p1, a1, wload(dtype, p1, w, i + vl), wload(dtype, p1, x, i + vl));
      a2 = svmla_f32_m(p2, a2, wload(dtype, p2, w, i + 2 * vl), wload(dtype, p2, x, i + 2 * vl));
      a3 = svmla_f32_m(p3, a3, wload(dtype, p3, w, i + 3 * vl), wload(dtype, p3, x, i + 3 * vl));
    }
    const svbool_t all = svptrue_b32();
    return svaddv_f32(all, svadd_f32_x(all, svadd_f32_x(all, a0, a1), svadd_f32_x(all, a2, a3)));
  }
  static float dot(const float* a, const float* b, int64_t n) {
    svfloat32_t acc = svdup_f32(0.f);
    for (int64_t i = 0; i < n; i += svcntw()) {
      svbool_t pg = svwhilelt_b32(i, n);
      acc = svmla_f32_m(pg, acc, svld1_f32(pg, a + i), svld1_f32(pg, b + i));
    }
    return svaddv_f32(svptrue_b32(), acc);
  }
  static void axpy(float* y, float a, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += svcntw()) {
      svbool_t pg = svwhilelt_b32(i, n);
      svst1_f32(pg, y + i, svmla_n_f32_x(pg, svld1_f32(pg, y + i), svld1_f32(pg, x + i), a));
    }
  }
  // One row per predicated vector loop and a reduction each (ranks are short: one or two vectors).
  static void dots(const float* rows, int64_t ld, const float* v, int64_t k, float* out, int64_t n) {
    const int64_t vl = svcntw();
    for (int64_t c = 0; c < n; ++c) {
      const float* r = rows + c * ld;
      svfloat32_t a = svdup_f32(0.f);
      for (int64_t i = 0; i < k; i += vl) {
        const svbool_t pg = svwhilelt_b32(i, k);
        a = svmla_f32_m(pg, a, svld1_f32(pg, r + i), svld1_f32(pg, v + i));
      }
      out[c] = svaddv_f32(svptrue_b32(), a);
    }
  }
  static void load(int dtype, const void* src, float* dst, int64_t n) {
    if (dtype == AS_F32) {
      std::memcpy(dst, src, n * 4);
      return;
    }
    auto s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; i += svcntw()) {
      svbool_t pg = svwhilelt_b32(i, n);
      svuint32_t w = svld1uh_u32(pg, s + i);  // zero-extend 16 -> 32 bits
      if (dtype == AS_BF16) {
        svst1_f32(pg, dst + i, svreinterpret_f32_u32(svlsl_n_u32_x(pg, w, 16)));
      } else {
        svfloat16_t h = svreinterpret_f16_u32(w);  // each half in the low 16 bits of its lane
        svst1_f32(pg, dst + i, svcvt_f32_f16_x(pg, h));
      }
    }
  }
  static void store(int dtype, const float* src, void* dst, int64_t n) {
    if (dtype == AS_F32) {
      std::memcpy(dst, src, n * 4);
      return;
    }
    auto d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; i += svcntw()) {
      svbool_t pg = svwhilelt_b32(i, n);
      svfloat32_t f = svld1_f32(pg, src + i);
      svuint32_t r;
      if (dtype == AS_BF16) {
        svuint32_t u = svreinterpret_u32_f32(f);
        svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 1);
        r = svlsr_n_u32_x(pg, svadd_u32_x(pg, u, svadd_n_u32_x(pg, lsb, 0x7fff)), 16);
        svbool_t nan = svcmpuo_f32(pg, f, f);
        r = svsel_u32(nan, svdup_u32(0x7fc0), r);
      } else {
        r = svreinterpret_u32_f16(svcvt_f16_f32_x(pg, f));  // result in the low half of each lane
      }
      svst1h_u32(pg, d + i, r);  // truncating store of the low 16 bits
    }
  }
  static void load_i8(const int8_t* src, float scale, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += svcntw()) {
      svbool_t pg = svwhilelt_b32(i, n);
      svint32_t w = svld1sb_s32(pg, src + i);  // sign-extend 8 -> 32 bits
      svst1_f32(pg, dst + i, svmul_n_f32_x(pg, svcvt_f32_s32_x(pg, w), scale));
    }
  }
};
}  // namespace

extern "C" const KernelTable* armserve_table_sve() { return armserve::Kernels<IsaSve>::table("sve"); }
