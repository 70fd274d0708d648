// SVE variant, vector-length agnostic: the same binary runs 128-bit (Graviton4, Grace),
// 256-bit (Graviton3) and 512-bit SVE; every loop is predicated with whilelt.
#include <arm_sve.h>

#include "kernels_impl.h"

namespace {
using armserve::ScalarOps;

struct IsaSve {
  // 4 weight rows x one fp32 activation row, vector-length agnostic; bf16/f16 widened in
  // registers (fused into the FMAs).
  static svfloat32_t wload(int dtype, svbool_t pg, const void* w, int64_t i) {
    if (dtype == AS_F32) return svld1_f32(pg, static_cast<const float*>(w) + i);
    const svuint32_t h = svld1uh_u32(pg, static_cast<const uint16_t*>(w) + i);
    if (dtype == AS_BF16) return svreinterpret_f32_u32(svlsl_n_u32_x(pg, h, 16));
    return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
  }
  static void dot4(int dtype, const void* w, int64_t k, const float* x, float* out) {
    const int es = dtype == AS_F32 ? 4 : 2;
    const char* r0 = static_cast<const char*>(w);
    svfloat32_t a0 = svdup_f32(0.f), a1 = svdup_f32(0.f), a2 = svdup_f32(0.f), a3 = svdup_f32(0.f);
    for (int64_t i = 0; i < k; i += svcntw()) {
      const svbool_t pg = svwhilelt_b32(i, k);
      const svfloat32_t xv = svld1_f32(pg, x + i);
      a0 = svmla_f32_m(pg, a0, wload(dtype, pg, r0, i), xv);
      a1 = svmla_f32_m(pg, a1, wload(dtype, pg, r0 + k * es, i), xv);
      a2 = svmla_f32_m(pg, a2, wload(dtype, pg, r0 + 2 * k * es, i), xv);
      a3 = svmla_f32_m(pg, a3, wload(dtype, pg, r0 + 3 * k * es, i), xv);
    }
    const svbool_t all = svptrue_b32();
    out[0] = svaddv_f32(all, a0);
    out[1] = svaddv_f32(all, a1);
    out[2] = svaddv_f32(all, a2);
    out[3] = svaddv_f32(all, a3);
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
