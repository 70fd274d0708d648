// AVX2 + FMA + F16C variant (x86-64 since Haswell / Zen).
#include <immintrin.h>

#include "dots_x86.h"
#include "kernels_impl.h"

namespace {
using armserve::ScalarOps;
using armserve::dtype_size;

struct IsaAvx2 {
  // bf16/f16/f32 -> fp32 in registers (fused into the FMAs of dot_w).
  static __m256 wload(int dtype, const void* w, int64_t i) {
    if (dtype == AS_BF16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dtype == AS_F16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i)));
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  }
  static float dot_w(int dtype, const void* w, const void* x, int64_t k) {
    // 4 accumulators: enough FMAs in flight to keep up with the memory stream.
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= k; i += 32) {
      a0 = _mm256_fmadd_ps(wload(dtype, w, i), wload(dtype, x, i), a0);
      a1 = _mm256_fmadd_ps(wload(dtype, w, i + 8), wload(dtype, x, i + 8), a1);
      a2 = _mm256_fmadd_ps(wload(dtype, w, i + 16), wload(dtype, x, i + 16), a2);
      a3 = _mm256_fmadd_ps(wload(dtype, w, i + 24), wload(dtype, x, i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(wload(dtype, w, i), wload(dtype, x, i), a0);
    const float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    if (i == k) return s;
    const int es = dtype_size(dtype);
    return s + ScalarOps::dot_w(dtype, static_cast<const char*>(w) + i * es, static_cast<const char*>(x) + i * es, k - i);
  }
  static float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static float dot(const float* a, const float* b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* y, float a, const float* x, int64_t n) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
  }
  static void dots(const float* rows, int64_t ld, const float* v, int64_t k, float* out, int64_t n) {
    DotsAvx2::dots(rows, ld, v, k, out, n);
  }
  static void load(int dtype, const void* src, float* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == AS_BF16) {
      auto s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
      }
    } else if (dtype == AS_F16) {
      auto s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
    }
    if (i < n) ScalarOps::load(dtype, static_cast<const char*>(src) + i * (dtype == AS_F32 ? 4 : 2), dst + i, n - i);
  }
  static void store(int dtype, const float* src, void* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == AS_BF16) {
      auto d = static_cast<uint16_t*>(dst);
      const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
      for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        __m256i u = _mm256_castps_si256(f);
        // round to nearest even; NaN lanes become the canonical 0x7fc0
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        r = _mm256_srli_epi32(r, 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
        __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), packed);
      }
    } else if (dtype == AS_F16) {
      auto d = static_cast<uint16_t*>(dst);
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    if (i < n) ScalarOps::store(dtype, src + i, static_cast<char*>(dst) + i * (dtype == AS_F32 ? 4 : 2), n - i);
  }
  static void load_i8(const int8_t* src, float scale, float* dst, int64_t n) {
    const __m256 vs = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), vs));
    }
    if (i < n) ScalarOps::load_i8(src + i, scale, dst + i, n - i);
  }
};
}  // namespace

extern "C" const KernelTable* armserve_table_avx2() { return armserve::Kernels<IsaAvx2>::table("avx2"); }
