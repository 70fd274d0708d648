// Dense bf16 GEMM variant that goes with the kernel variant in use (dispatch.cpp) and the bf16-dot
// switch (armserve_bf16_dot): avx512 -> AMX tiles when the CPU has AMX-BF16, Linux granted its
// tile data and the AMX switch is on (armserve_set_amx), else AVX512-BF16 vdpbf16ps tiles when
// the CPU has it and the switch is on, else widening AVX-512 tiles; neon/sve -> BFDOT tiles
// likewise (HWCAP2_BF16). A CPU without the instruction never reaches the tiles that use it.
#include <cstring>

#include "dense_gemm_impl.h"

extern "C" const char* armserve_isa();

namespace {

int g_amx_wanted = 1;

const DenseTable* pick(const char* isa, int dot, int amx) {
  const CpuFeatures& f = *armserve_cpu();
#if defined(__x86_64__)
  if (!std::strcmp(isa, "avx512") && dot && amx && armserve_amx_ready()) return armserve_dense_amx();
  if (!std::strcmp(isa, "avx512")) return dot && f.avx512_bf16 ? armserve_dense_avx512_bf16() : armserve_dense_avx512();
  if (!std::strcmp(isa, "avx2")) return armserve_dense_avx2();
#elif defined(__aarch64__)
  if (!std::strcmp(isa, "sve") && f.sve) return dot && f.bf16 ? armserve_dense_sve_bf16() : armserve_dense_sve();
  if (!std::strcmp(isa, "neon")) return dot && f.bf16 ? armserve_dense_neon_bf16() : armserve_dense_neon();
#endif
  (void)f;
  (void)dot;
  (void)amx;
  return armserve_dense_scalar();
}

// Float32 weights: the variant's FMA tiles (no dot instruction or AMX involved).
const DenseTable* pick_f32(const char* isa) {
#if defined(__x86_64__)
  if (!std::strcmp(isa, "avx512")) return armserve_dense_avx512_f32();
  if (!std::strcmp(isa, "avx2")) return armserve_dense_avx2_f32();
#elif defined(__aarch64__)
  if (!std::strcmp(isa, "sve") && armserve_cpu()->sve) return armserve_dense_sve_f32();
  if (!std::strcmp(isa, "neon")) return armserve_dense_neon_f32();
#endif
  return armserve_dense_scalar_f32();
}

const DenseTable* dtable_f32() {
  static const char* for_isa = nullptr;
  static const DenseTable* t = nullptr;
  const char* isa = armserve_isa();
  if (isa != for_isa) {
    t = pick_f32(isa);
    for_isa = isa;
  }
  return t;
}

const DenseTable* dtable() {
  static const char* for_isa = nullptr;
  static int for_dot = -1, for_amx = -1;
  static const DenseTable* t = nullptr;
  const char* isa = armserve_isa();
  const int dot = armserve_bf16_dot, amx = g_amx_wanted;
  if (isa != for_isa || dot != for_dot || amx != for_amx) {  // the variant or a switch changed
    t = pick(isa, dot, amx);
    for_isa = isa;
    for_dot = dot;
    for_amx = amx;
  }
  return t;
}

}  // namespace

extern "C" {

const char* armserve_dense_isa() { return dtable()->name; }
const DenseTable* armserve_dense_active() { return dtable(); }
const char* armserve_dense_f32_isa() { return dtable_f32()->name; }
const DenseTable* armserve_dense_f32_active() { return dtable_f32(); }

int32_t armserve_set_amx(int32_t on) {
#if defined(__x86_64__)
  if (on && !armserve_amx_ready()) return 2;
#else
  if (on) return 2;
#endif
  g_amx_wanted = on ? 1 : 0;
  return 0;
}

int32_t armserve_amx_wanted() { return g_amx_wanted; }

// AMX tiles may run now (amx.h): the CPU and Linux allow them and the switch is on.
int32_t armserve_amx_active() {
#if defined(__x86_64__)
  return g_amx_wanted && armserve_amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

// w [n, k] bf16 -> packed [ceil(n / 16)][ceil(k / 2)][16][2] (dense_gemm.h), zero-padded.
void armserve_pack_bf16(const void* w, int64_t n, int64_t k, void* packed) {
  armserve_dense::pack_bf16(static_cast<const uint16_t*>(w), n, k, static_cast<uint16_t*>(packed));
}

// out [m, n] (out_dtype 0 = float32, 1 = bf16; rows `ldo` elements apart) = x [m, k] bf16 @ W^T.
void armserve_gemm_bf16(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n,
                        int64_t k, int64_t ldo) {
  dtable()->gemm(out_dtype, out, x, packed, m, n, k, ldo);
}

void armserve_gemm_q_bf16(int32_t fmt, int32_t out_dtype, void* out, const void* x, const void* wq, int64_t m,
                          int64_t n, int64_t k, int64_t group, int64_t ldo) {
  dtable()->gemm_q(fmt, out_dtype, out, x, wq, m, n, k, group, ldo);
}

void armserve_pack_f32(const void* w, int64_t n, int64_t k, void* packed) {
  armserve_dense::pack_f32(static_cast<const float*>(w), n, k, static_cast<float*>(packed));
}

void armserve_gemm_f32(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n,
                       int64_t k, int64_t ldo) {
  dtable_f32()->gemm(out_dtype, out, x, packed, m, n, k, ldo);
}
}
