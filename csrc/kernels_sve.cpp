// SVE variant, vector-length agnostic: the same binary runs 128-bit (Graviton4, Grace),
// 256-bit (Graviton3) and 512-bit SVE; every loop is predicated with whilelt.
#include <arm_sve.h>

#include "kernels_impl.h"

namespace {
using armserve::ScalarOps;

struct IsaSve {
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
