// Quantized-GEMM variant that goes with the kernel variant in use (dispatch.cpp), limited by
// the integer-dot features it needs: AVX512-VNNI on x86 (else AVX2), dotprod for NEON (plus
// i8mm's SMMLA for prefill where present), SVE (NEON i8mm at 128-bit SVE, see pick()).
#include <cstring>

#include "qgemm.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

extern "C" const char* armserve_isa();

namespace {

const QKernelTable* pick(const char* isa) {
#if defined(__x86_64__)
  if (!std::strcmp(isa, "avx512")) {
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw")) return armserve_qtable_avx512();
    return armserve_qtable_avx2();  // AVX-512 without VNNI (Skylake-SP): AVX2 integer path
  }
  if (!std::strcmp(isa, "avx2")) return armserve_qtable_avx2();
#elif defined(__aarch64__) && defined(__linux__)
  if (!std::strcmp(isa, "sve")) {
    // 128-bit SVE with i8mm (Graviton4, Grace): NEON's SMMLA tiles do twice the multiply-adds of
    // SVE SDOT at that width for prefill, and decode is memory-bound either way. Wider SVE
    // (Graviton3's 256 bits) keeps SDOT, which already matches SMMLA at 128 bits.
    if ((getauxval(AT_HWCAP2) & HWCAP2_I8MM) && prctl(PR_SVE_GET_VL) > 0 && (prctl(PR_SVE_GET_VL) & 0xffff) == 16)
      return armserve_qtable_neon_i8mm();
    return armserve_qtable_sve();
  }
  if (!std::strcmp(isa, "neon") && (getauxval(AT_HWCAP) & HWCAP_ASIMDDP)) {
    if (getauxval(AT_HWCAP2) & HWCAP2_I8MM) return armserve_qtable_neon_i8mm();
    return armserve_qtable_neon();
  }
#endif
  return armserve_qtable_scalar();
}

const QKernelTable* qtable() {
  static const char* for_isa = nullptr;
  static const QKernelTable* t = nullptr;
  const char* isa = armserve_isa();
  if (isa != for_isa) {  // the kernel variant changed (ARMSERVE_ISA, tests)
    t = pick(isa);
    for_isa = isa;
  }
  return t;
}

}  // namespace

extern "C" {

const char* armserve_qgemm_isa() { return qtable()->name; }

void armserve_quantize_act(int32_t dtype, const void* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* scale,
                           int32_t* gsum) {
  qtable()->quantize_act(dtype, x, m, k, group, q, scale, gsum);
}

void armserve_gemm_w4(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w4(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}

void armserve_gemm_w8(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const int8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w8(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}
}
