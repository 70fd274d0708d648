// AVX-512 (F, BW, VL, DQ) variant (Skylake-SP and later, Zen 4 and later).
// NOTE: bf16 is widened to fp32 by a 16-bit shift and all math runs in fp32 FMAs, so the same
// code is exact on CPUs with or without AVX512-BF16.
#include <immintrin.h>

#include "dots_x86.h"
#include "kernels_impl.h"

namespace {
using armserve::ScalarOps;
using armserve::dtype_size;

struct IsaAvx512 {
  // bf16/f16/f32 -> fp32 in registers (fused into the FMAs of dot_w).
  static __m512 wload(int dtype, const void* w, int64_t i) {
    if (dtype == AS_BF16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dtype == AS_F16)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i)));
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  }
  // AVX512-BF16: vdpbf16ps multiplies bf16 pairs and accumulates in fp32, no widening step.
  // Only called when the CPU has it (armserve_bf16_dot, dispatch.cpp); the attribute keeps
  // the instruction out of every other function of this file.
  __attribute__((target("avx512bf16"))) static float dot_bf16(const uint16_t* w, const uint16_t* x, int64_t k) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(x + i + 32));
    }
    for (; i + 32 <= k; i += 32)
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    return i < k ? s + ScalarOps::dot_w(AS_BF16, w + i, x + i, k - i) : s;
  }
  static float dot_w(int dtype, const void* w, const void* x, int64_t k) {
    if (dtype == AS_BF16 && armserve_bf16_dot)
      return dot_bf16(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(x), k);
    // 4 accumulators: enough FMAs in flight to keep up with the memory stream.
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
      a0 = _mm512_fmadd_ps(wload(dtype, w, i), wload(dtype, x, i), a0);
      a1 = _mm512_fmadd_ps(wload(dtype, w, i + 16), wload(dtype, x, i + 16), a1);
      a2 = _mm512_fmadd_ps(wload(dtype, w, i + 32), wload(dtype, x, i + 32), a2);
      a3 = _mm512_fmadd_ps(wload(dtype, w, i + 48), wload(dtype, x, i + 48), a3);
    }
    for (; i + 16 <= k; i += 16) a0 = _mm512_fmadd_ps(wload(dtype, w, i), wload(dtype, x, i), a0);
    const float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    if (i == k) return s;
    const int es = dtype_size(dtype);
    return s + ScalarOps::dot_w(dtype, static_cast<const char*>(w) + i * es, static_cast<const char*>(x) + i * es, k - i);
  }
  static float dot(const float* a, const float* b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    acc0 = _mm512_add_ps(acc0, acc1);
    if (i < n) {
      for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      if (i < n) {
        const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
      }
    }
    return _mm512_reduce_add_ps(acc0);
  }
  static void axpy(float* y, float a, const float* x, int64_t n) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    if (i < n) {
      const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
      _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
    }
  }
  static void dots(const float* rows, int64_t ld, const float* v, int64_t k, float* out, int64_t n) {
    DotsAvx2::dots(rows, ld, v, k, out, n);
  }
  static void load(int dtype, const void* src, float* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == AS_BF16) {
      auto s = static_cast<const uint16_t*>(src);
      for (; i + 16 <= n; i += 16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
      }
    } else if (dtype == AS_F16) {
      auto s = static_cast<const uint16_t*>(src);
      for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i))));
    }
    if (i < n) ScalarOps::load(dtype, static_cast<const char*>(src) + i * (dtype == AS_F32 ? 4 : 2), dst + i, n - i);
  }
  static void store(int dtype, const float* src, void* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == AS_BF16) {
      auto d = static_cast<uint16_t*>(dst);
      const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
      for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_loadu_ps(src + i);
        __m512i u = _mm512_castps_si512(f);
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        r = _mm512_srli_epi32(r, 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(r));
      }
    } else if (dtype == AS_F16) {
      auto d = static_cast<uint16_t*>(dst);
      for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    if (i < n) ScalarOps::store(dtype, src + i, static_cast<char*>(dst) + i * (dtype == AS_F32 ? 4 : 2), n - i);
  }
  static void load_i8(const int8_t* src, float scale, float* dst, int64_t n) {
    const __m512 vs = _mm512_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), vs));
    }
    if (i < n) ScalarOps::load_i8(src + i, scale, dst + i, n - i);
  }
};
}  // namespace

extern "C" const KernelTable* armserve_table_avx512() { return armserve::Kernels<IsaAvx512>::table("avx512"); }
