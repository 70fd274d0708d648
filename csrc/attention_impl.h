// Paged attention and the KV-cache writes, written once over 16-lane vectors (one zmm on
// AVX-512, two ymm on AVX2, four q registers on NEON/SVE, SSE2 on the x86 reference variant;
// see "16-lane vectors" below), included by every kernels_<isa>.cpp.
//
// Cache layout of one layer (`bs` = block size, a multiple of 16; 16 keys make a tile):
//
//   float32 / float16 / int8 caches
//     K  [num_blocks, kv_heads, bs / 16, head_dim, 16]       a tile's keys transposed: lane = key
//     V  [num_blocks, kv_heads, bs, head_dim]                 a tile's values row by row
//   bfloat16 caches: the same, with neighbours paired for bf16 dot instructions (AVX512-BF16
//   vdpbf16ps, ARM BFDOT: each fp32 lane += a[2i] * b[2i] + a[2i+1] * b[2i+1])
//     K  [num_blocks, kv_heads, bs / 16, head_dim / 2, 16, 2]  lane = key, pair = 2 head dims
//     V  [num_blocks, kv_heads, bs / 2, head_dim, 2]          lane = head dim, pair = 2 keys
//   int8 scales (K and V alike) [num_blocks, kv_heads, bs]
//
// so the 16 keys of a tile are 16 lanes of one vector per head dimension (pair): the scores of a
// query row against a tile are `head_dim` FMAs (head_dim / 2 bf16 dots) with the query element
// (pair) broadcast, no horizontal sum per key, and one K/V load serves every query row of the GQA
// group (and of the prefill tile). Without a bf16 dot instruction a pair widens to two fp32
// vectors with a shift and a mask. With one, the probabilities are rounded to bf16 for the
// values' dot (as flash attention does on GPUs); scores and sums stay fp32.
//
// Work is split into items (sequence, tile of up to QT query positions, KV head). An item's rows
// are its query positions times the group's query heads. Keys are walked in fixed partitions of
// P positions (absolute, so the same for every batch); each partition keeps its own running max,
// sum and output, and partitions are merged in order with `merge_row`. When there are too few
// items to feed every thread, partitions become items of their own and a second pass merges
// them, with the same function in the same order: a sequence's result never depends on what else
// is in the batch or on the thread count (batch invariance).
#pragma once
#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors by value: all internal, no ABI involved

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>

#include "amx.h"
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace armserve {
namespace {

// ---- 16-lane vectors ----------------------------------------------------------------------------
// The kernels below are written once over 16-lane fp32 / int32 vectors (a tile of 16 keys is one
// vector). With AVX-512 (and in the scalar reference) they are GCC vector types. Where the ISA's
// registers are narrower (AVX2: 8 lanes, NEON: 4) a 64-byte GCC vector has no machine mode: GCC
// keeps every such variable on the stack and each operation goes through memory (the AVX2 decode
// attention ran ~6x slower than the same code on native vectors, 33 ns per key and query head
// against ~5). There they are `Wide` structs of native vectors instead, every operation applied
// part by part (lane for lane the same arithmetic), which GCC keeps in registers. The code uses
// only what both provide: arithmetic, comparisons, vsel (not ?:), vbits (not casts), vcvt_i.
#define ARMSERVE_VI static inline __attribute__((always_inline))
#if defined(__AVX512F__) || !(defined(__AVX2__) || defined(__aarch64__))
typedef float vf16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint32_t vu16 __attribute__((vector_size(64)));
typedef uint16_t vh16 __attribute__((vector_size(32)));
template <class M, class V>
ARMSERVE_VI V vsel(M m, V a, V b) {
  return m ? a : b;
}
template <class To, class From>
ARMSERVE_VI To vbits(From v) {
  return (To)v;
}
ARMSERVE_VI vi16 vcvt_i(vf16 v) { return __builtin_convertvector(v, vi16); }
static inline vf16 vload(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void vstore(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }
// (Not `vf16{} + x`: 0 + x is not x for x = -0, so that costs an add before the broadcast.)
static inline vf16 vsplat(float x) { return vf16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// Lanes j0, j0 + 1, ..., j0 + 15.
ARMSERVE_VI vi16 viota(int j0) {
  return vi16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + j0;
}
ARMSERVE_VI float lane(vf16 v, int j) { return v[j]; }
// 16 32-bit lanes from memory (bf16 pairs).
ARMSERVE_VI vu16 vload_u(const uint16_t* p) {
  vu16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#else
#define ARMSERVE_WIDE 1
#if defined(__AVX2__)
constexpr int kVL = 8;  // lanes per register
#else
constexpr int kVL = 4;
#endif
typedef float pf_t __attribute__((vector_size(kVL * 4)));
typedef int32_t pi_t __attribute__((vector_size(kVL * 4)));
typedef uint32_t pu_t __attribute__((vector_size(kVL * 4)));
template <class P>
struct Wide {
  static constexpr int N = 16 / kVL;
  P p[N];
};
typedef Wide<pf_t> vf16;
typedef Wide<pi_t> vi16;
typedef Wide<pu_t> vu16;
template <class P>
struct MaskOf {
  typedef Wide<decltype(P{} > P{})> type;
};
#define ARMSERVE_WIDE_OP(op)                                                                 \
  template <class P>                                                                         \
  ARMSERVE_VI Wide<P> operator op(Wide<P> a, Wide<P> b) {                                    \
    Wide<P> r;                                                                               \
    for (int i = 0; i < Wide<P>::N; ++i) r.p[i] = a.p[i] op b.p[i];                          \
    return r;                                                                                \
  }                                                                                          \
  template <class P, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>             \
  ARMSERVE_VI Wide<P> operator op(Wide<P> a, S b) {                                          \
    Wide<P> r;                                                                               \
    for (int i = 0; i < Wide<P>::N; ++i) r.p[i] = a.p[i] op b;                               \
    return r;                                                                                \
  }                                                                                          \
  template <class P>                                                                         \
  ARMSERVE_VI Wide<P>& operator op##=(Wide<P>& a, Wide<P> b) {                               \
    return a = a op b;                                                                       \
  }                                                                                          \
  template <class P, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>             \
  ARMSERVE_VI Wide<P>& operator op##=(Wide<P>& a, S b) {                                     \
    return a = a op b;                                                                       \
  }
ARMSERVE_WIDE_OP(+)
ARMSERVE_WIDE_OP(-)
ARMSERVE_WIDE_OP(*)
ARMSERVE_WIDE_OP(&)
ARMSERVE_WIDE_OP(<<)
ARMSERVE_WIDE_OP(>>)
#undef ARMSERVE_WIDE_OP
#define ARMSERVE_WIDE_CMP(op)                                                                \
  template <class P>                                                                         \
  ARMSERVE_VI typename MaskOf<P>::type operator op(Wide<P> a, Wide<P> b) {                   \
    typename MaskOf<P>::type r;                                                              \
    for (int i = 0; i < Wide<P>::N; ++i) r.p[i] = a.p[i] op b.p[i];                          \
    return r;                                                                                \
  }                                                                                          \
  template <class P, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>             \
  ARMSERVE_VI typename MaskOf<P>::type operator op(Wide<P> a, S b) {                         \
    typename MaskOf<P>::type r;                                                              \
    for (int i = 0; i < Wide<P>::N; ++i) r.p[i] = a.p[i] op b;                               \
    return r;                                                                                \
  }
ARMSERVE_WIDE_CMP(>)
ARMSERVE_WIDE_CMP(<)
ARMSERVE_WIDE_CMP(>=)
ARMSERVE_WIDE_CMP(==)
#undef ARMSERVE_WIDE_CMP
template <class P>
ARMSERVE_VI Wide<P> operator-(Wide<P> a) {
  Wide<P> r;
  for (int i = 0; i < Wide<P>::N; ++i) r.p[i] = -a.p[i];
  return r;
}
template <class M, class P>
ARMSERVE_VI Wide<P> vsel(Wide<M> m, Wide<P> a, Wide<P> b) {
  Wide<P> r;
  for (int i = 0; i < Wide<P>::N; ++i) r.p[i] = m.p[i] ? a.p[i] : b.p[i];
  return r;
}
template <class To, class From>
ARMSERVE_VI To vbits(From v) {
  To r;
  for (int i = 0; i < To::N; ++i) r.p[i] = (std::remove_reference_t<decltype(r.p[0])>)v.p[i];
  return r;
}
ARMSERVE_VI vi16 vcvt_i(vf16 v) {
  vi16 r;
  for (int i = 0; i < vf16::N; ++i) r.p[i] = __builtin_convertvector(v.p[i], pi_t);
  return r;
}
static inline vf16 vload(const float* p) {
  vf16 v;
  for (int i = 0; i < vf16::N; ++i) std::memcpy(&v.p[i], p + kVL * i, sizeof v.p[i]);
  return v;
}
static inline void vstore(float* p, vf16 v) {
  for (int i = 0; i < vf16::N; ++i) std::memcpy(p + kVL * i, &v.p[i], sizeof v.p[i]);
}
static inline vf16 vsplat(float x) {
  vf16 v;
#if defined(__AVX2__)
  for (int i = 0; i < vf16::N; ++i) v.p[i] = (pf_t)_mm256_set1_ps(x);
#else
  for (int i = 0; i < vf16::N; ++i) v.p[i] = (pf_t)vdupq_n_f32(x);
#endif
  return v;
}
ARMSERVE_VI vi16 viota(int j0) {
  vi16 v;
  for (int i = 0; i < vi16::N; ++i)
    for (int j = 0; j < kVL; ++j) v.p[i][j] = j0 + i * kVL + j;
  return v;
}
ARMSERVE_VI float lane(vf16 v, int j) { return v.p[j / kVL][j % kVL]; }
ARMSERVE_VI vu16 vload_u(const uint16_t* p) {
  vu16 v;
  for (int i = 0; i < vu16::N; ++i) std::memcpy(&v.p[i], p + 2 * kVL * i, sizeof v.p[i]);
  return v;
}
#endif

// a * b + c, fused where the TU's ISA has an FMA (the build disables implicit contraction).
static inline vf16 vfma(vf16 a, vf16 b, vf16 c) {
#if defined(__AVX512F__)
  return (vf16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(ARMSERVE_WIDE) && defined(__FMA__)
  vf16 r;
  for (int i = 0; i < vf16::N; ++i) r.p[i] = (pf_t)_mm256_fmadd_ps((__m256)a.p[i], (__m256)b.p[i], (__m256)c.p[i]);
  return r;
#elif defined(ARMSERVE_WIDE) && defined(__aarch64__)
  vf16 r;
  for (int i = 0; i < vf16::N; ++i)
    r.p[i] = (pf_t)vfmaq_f32((float32x4_t)c.p[i], (float32x4_t)a.p[i], (float32x4_t)b.p[i]);
  return r;
#else
  return a * b + c;
#endif
}

// 1 / x to within ~2 ulp: the ISA's reciprocal estimate and Newton steps (a division is 10-16
// cycles of throughput per vector on x86, and the activations divide once per element).
ARMSERVE_VI vf16 vrecip(vf16 x) {
#if defined(__AVX512F__)
  const vf16 r = (vf16)_mm512_rcp14_ps((__m512)x);  // 14 bits; one step gives ~28
  return vfma(r, vfma(-x, r, vsplat(1.0f)), r);
#elif defined(ARMSERVE_WIDE) && defined(__AVX2__)
  vf16 r;
  for (int i = 0; i < vf16::N; ++i) r.p[i] = (pf_t)_mm256_rcp_ps((__m256)x.p[i]);  // 12 bits; two steps
  r = vfma(r, vfma(-x, r, vsplat(1.0f)), r);
  return vfma(r, vfma(-x, r, vsplat(1.0f)), r);
#elif defined(ARMSERVE_WIDE) && defined(__aarch64__)
  vf16 r;
  for (int i = 0; i < vf16::N; ++i) {  // 8 bits; three steps
    const float32x4_t q = (float32x4_t)x.p[i];
    float32x4_t e = vrecpeq_f32(q);
    e = vmulq_f32(e, vrecpsq_f32(q, e));
    e = vmulq_f32(e, vrecpsq_f32(q, e));
    r.p[i] = (pf_t)vmulq_f32(e, vrecpsq_f32(q, e));
  }
  return r;
#else
  return 1.0f / x;
#endif
}

static inline float hmax(vf16 v) {
  float m[8];
  for (int i = 0; i < 8; ++i) m[i] = lane(v, i) > lane(v, i + 8) ? lane(v, i) : lane(v, i + 8);
  for (int i = 0; i < 4; ++i) m[i] = m[i] > m[i + 4] ? m[i] : m[i + 4];
  const float x = m[0] > m[2] ? m[0] : m[2], y = m[1] > m[3] ? m[1] : m[3];
  return x > y ? x : y;
}

// Pairwise, so the compiler keeps it in registers; fixed order, so the same sum every time.
static inline float hsum(vf16 v) {
  float s[8];
  for (int i = 0; i < 8; ++i) s[i] = lane(v, i) + lane(v, i + 8);
  for (int i = 0; i < 4; ++i) s[i] += s[i + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// exp_fast (kernels_impl.h) lane by lane, as vector arithmetic, with fused multiply-adds where the
// ISA has them (a short dependency chain: the softmax is a fair part of the attention's time).
ARMSERVE_VI vf16 vexp(vf16 x) {
#if defined(__AVX512F__)
  // n = round(x log2 e) in one instruction, and vscalefps applies 2^n at the end: no clamp below,
  // no exponent to assemble (x < -87.3 goes to denormals and 0, where the clamp stops at ~1e-38).
  x = (vf16)_mm512_min_ps((__m512)x, _mm512_set1_ps(88.72283f));
  const vf16 n = (vf16)_mm512_roundscale_ps(_mm512_mul_ps((__m512)x, _mm512_set1_ps(1.44269504088896341f)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf16 lo = vsplat(-87.33654f), hi = vsplat(88.72283f);
  x = vsel(x < lo, lo, vsel(x > hi, hi, x));
  const vf16 n = vfma(x, vsplat(1.44269504088896341f), vsplat(12582912.0f)) - 12582912.0f;
#endif
  vf16 r = vfma(n, vsplat(-0.693359375f), x);
  r = vfma(n, vsplat(2.12194440e-4f), r);
  vf16 p = vfma(vsplat(1.9875691500e-4f), r, vsplat(1.3981999507e-3f));
  p = vfma(p, r, vsplat(8.3334519073e-3f));
  p = vfma(p, r, vsplat(4.1665795894e-2f));
  p = vfma(p, r, vsplat(1.6666665459e-1f));
  p = vfma(p, r, vsplat(5.0000001201e-1f));
  p = vfma(p * r, r, r + 1.0f);
#if defined(__AVX512F__)
  return (vf16)_mm512_scalef_ps((__m512)p, (__m512)n);
#else
  const vi16 e = (vcvt_i(n) + 127) << 23;
  return p * vbits<vf16>(e);
#endif
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 2^y to a relative 3e-6, for results rounded to bf16 next (the AMX and bf16-dot softmax, the bf16
// SiLU): 2^y = 2^floor(y) 2^frac(y), vreduceps gives the fraction, a degree-4 polynomial 2^frac
// and vscalefps applies 2^floor(y); 7 instructions where vexp takes 14. -inf gives an exact 0,
// +inf and y >= 128 give inf.
#define ARMSERVE_EXP2_FAST 1
static inline __m512 exp2_fast(__m512 y) {
  const __m512 f = _mm512_maskz_reduce_ps(0xffff, y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(0.013426724821329117f), f, _mm512_set1_ps(0.052242401987314224f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.24128024280071259f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.6930448412895203f));
  return _mm512_scalef_ps(_mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f)), y);
}
#endif

// Cache element types: the model dtypes (AS_F32, AS_BF16, AS_F16) and int8.
enum CacheType : int { CT_F32 = AS_F32, CT_BF16 = AS_BF16, CT_F16 = AS_F16, CT_I8 = 3 };

// 16 consecutive cache elements (at element index i) as fp32 lanes; int8 without its scale.
template <int CT>
ARMSERVE_VI vf16 load16(const void* base, int64_t i) {
  if (CT == CT_F32) return vload(static_cast<const float*>(base) + i);
  if (CT == CT_BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
#if defined(__AVX512F__)
    return (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#elif defined(ARMSERVE_WIDE) && defined(__AVX2__)
    vf16 v;
    for (int j = 0; j < 2; ++j)
      v.p[j] = (pf_t)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j))), 16);
    return v;
#elif defined(ARMSERVE_WIDE) && defined(__aarch64__)
    vf16 v;
    for (int j = 0; j < 4; ++j) v.p[j] = (pf_t)vshll_n_u16(vld1_u16(p + 4 * j), 16);
    return v;
#else
    vh16 h;
    std::memcpy(&h, p, sizeof h);
    return (vf16)(__builtin_convertvector(h, vu16) << 16);
#endif
  }
  if (CT == CT_I8) {  // (GCC scalarises __builtin_convertvector from int8: spelled out per ISA)
    const int8_t* p8 = static_cast<const int8_t*>(base) + i;
#if defined(__AVX512F__)
    return (vf16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p8))));
#elif defined(ARMSERVE_WIDE) && defined(__AVX2__)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p8));
    vf16 v;
    v.p[0] = (pf_t)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    v.p[1] = (pf_t)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    return v;
#elif defined(ARMSERVE_WIDE) && defined(__aarch64__)
    const int8x16_t b = vld1q_s8(p8);
    const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
    vf16 v;
    v.p[0] = (pf_t)vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    v.p[1] = (pf_t)vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo)));
    v.p[2] = (pf_t)vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    v.p[3] = (pf_t)vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)));
    return v;
#else
    float t[16];
    for (int j = 0; j < 16; ++j) t[j] = float(p8[j]);
    return vload(t);
#endif
  }
  const uint16_t* p = static_cast<const uint16_t*>(base) + i;
#if defined(__AVX512F__)
  return (vf16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(ARMSERVE_WIDE) && defined(__F16C__)
  vf16 v;
  for (int j = 0; j < 2; ++j) v.p[j] = (pf_t)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * j)));
  return v;
#elif defined(ARMSERVE_WIDE) && defined(__aarch64__)
  vf16 v;
  for (int j = 0; j < 4; ++j) v.p[j] = (pf_t)vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * j)));
  return v;
#else
  float t[16];
  for (int j = 0; j < 16; ++j) t[j] = f16_to_f32(p[j]);
  return vload(t);
#endif
}

constexpr int kKT = 16;   // keys per tile
constexpr int kP = 256;   // keys per partition; score rows are kP floats apart

// ---- bfloat16 pairs: the dot-instruction micro-kernels (only called when armserve_bf16_dot) ----
// Both work on a whole partition at once, handed the addresses of its tiles:
//   scores_bf16_dot: s[r][t * 16 + j] = q[r] . key j of tile t, NR rows of bf16 queries (hd apart),
//     kt[t]: [hd / 2][16][2]; raw dot products (the softmax scales them); s rows kP apart.
//   values_bf16_dot: acc[r] = sum_j p[r][j] v[j] over the partition's keys (written, not added to),
//     p: the fp32 probabilities (rounded to bf16 here, as flash attention does), rows kP apart, vt[t]: [8][hd][2] (pairs of keys);
//     the last tile holds jn_last keys. Keys past them are never read: an odd last key's pair
//     partner is masked off (its slot may hold anything, NaN included, and 0 * NaN is NaN).
// Register blocking is rows x tiles (scores) and rows x 16-column chunks (values), so that each
// broadcast query / probability feeds several dot instructions and each K/V load several rows:
// at one load per dot instruction (rows only) the loads, not the dots, set the pace.
// pf: up to 2 * TT tile addresses (K of the next tiles, V of these) prefetched one line per step,
// to L2 (see prefetch_partition). kt holds the nt tiles to score and then the first K tiles of the
// partition that comes next (nk_pf counts both): the K stream runs on into them.
#if defined(__AVX512F__)
#define ARMSERVE_ATTN_BF16_DOT 1
template <int NR, int TT, int U>
__attribute__((target("avx512bf16"))) static inline void scores_tiles(const uint16_t* q, const uint16_t* const* kt,
                                                                      int hd, float* s, const char* const* pf,
                                                                      int npf) {
  __m512 a[U][TT][NR];
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < TT; ++t)
      for (int r = 0; r < NR; ++r) a[u][t][r] = _mm512_setzero_ps();
  for (int dp = 0; dp < hd / 2; dp += U) {  // hd / 2 is a multiple of 8
    for (int i = 0; i < npf; ++i) __builtin_prefetch(pf[i] + dp * 64, 0, 2);  // a tile is hd / 2 lines; to L2
    for (int u = 0; u < U; ++u) {
      __m512bh kv[TT];
      for (int t = 0; t < TT; ++t) kv[t] = (__m512bh)_mm512_loadu_si512(kt[t] + (dp + u) * 2 * kKT);
      for (int r = 0; r < NR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, q + r * hd + 2 * (dp + u), 4);
        const __m512bh b = (__m512bh)_mm512_set1_epi32(int(pair));
        for (int t = 0; t < TT; ++t) a[u][t][r] = _mm512_dpbf16_ps(a[u][t][r], b, kv[t]);
      }
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < NR; ++r)
      _mm512_storeu_ps(s + r * kP + t * kKT, U == 2 ? _mm512_add_ps(a[0][t][r], a[U - 1][t][r]) : a[0][t][r]);
}

template <int NR>
static void scores_bf16_dot(const uint16_t* q, const uint16_t* const* kt, int nt, int nk_pf, int hd, float* s,
                            const uint16_t* const* vt) {
  constexpr int TT = NR <= 4 ? 4 : 2;  // NR x TT accumulators: at most 16 of the 32 registers
  const char* pf[2 * TT];
  int t = 0;
  for (; t + TT <= nt; t += TT) {
    int npf = 0;
    for (int i = t + TT; i < t + 2 * TT && i < nk_pf; ++i) pf[npf++] = reinterpret_cast<const char*>(kt[i]);
    for (int i = t; vt && i < t + TT; ++i) pf[npf++] = reinterpret_cast<const char*>(vt[i]);
    scores_tiles<NR, TT, 1>(q, kt + t, hd, s + t * kKT, pf, npf);
  }
  // The last tiles together, still one chain per score: a score must not depend on how many rows
  // or tiles shared its call (a verify step's rows give the same bits as decode steps; two chains
  // here once made speculative decoding's greedy text part from plain decoding's).
  int npf = 0;
  for (int i = nt; i < nt + TT && i < nk_pf; ++i) pf[npf++] = reinterpret_cast<const char*>(kt[i]);
  for (int i = t; vt && i < nt; ++i) pf[npf++] = reinterpret_cast<const char*>(vt[i]);
  switch (nt - t) {
    case 1: scores_tiles<NR, 1, 1>(q, kt + t, hd, s + t * kKT, pf, npf); break;
    case 2: scores_tiles<NR, 2, 1>(q, kt + t, hd, s + t * kKT, pf, npf); break;
    case 3: scores_tiles<NR, 3, 1>(q, kt + t, hd, s + t * kKT, pf, npf); break;
    default: break;
  }
}

// One pair of keys into NR x CC accumulators (odd_last: the pair's second key is past the context).
template <int NR, int CC>
__attribute__((target("avx512bf16"), always_inline)) static inline void values_pair(__m512 (&a)[CC][NR],
                                                                                    const uint16_t* v,
                                                                                    const uint16_t* pp,
                                                                                    bool odd_last) {
  __m512i w[CC];
  for (int cc = 0; cc < CC; ++cc) {
    w[cc] = _mm512_loadu_si512(v + 32 * cc);
    if (odd_last) w[cc] = _mm512_and_si512(w[cc], _mm512_set1_epi32(0x0000ffff));
  }
  for (int r = 0; r < NR; ++r) {
    uint32_t pr;
    std::memcpy(&pr, pp + r * kP, 4);
    const __m512bh b = (__m512bh)_mm512_set1_epi32(int(pr));
    for (int cc = 0; cc < CC; ++cc) a[cc][r] = _mm512_dpbf16_ps(a[cc][r], b, (__m512bh)w[cc]);
  }
}

template <int NR, int CC>
__attribute__((target("avx512bf16"))) static inline void values_cols(const uint16_t* p, const uint16_t* const* vt,
                                                                     int nt, int jn_last, int hd, int c, float* acc) {
  __m512 a[CC][NR];
  for (int cc = 0; cc < CC; ++cc)
    for (int r = 0; r < NR; ++r) a[cc][r] = _mm512_setzero_ps();
  for (int t = 0; t + 1 < nt; ++t)
    for (int jp = 0; jp < kKT / 2; ++jp)
      values_pair<NR, CC>(a, vt[t] + (int64_t(jp) * hd + c) * 2, p + t * kKT + 2 * jp, false);
  const int np = (jn_last + 1) / 2;
  for (int jp = 0; jp < np; ++jp)
    values_pair<NR, CC>(a, vt[nt - 1] + (int64_t(jp) * hd + c) * 2, p + (nt - 1) * kKT + 2 * jp,
                        jn_last % 2 && jp == np - 1);
  for (int cc = 0; cc < CC; ++cc)
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(acc + r * hd + c + 16 * cc, a[cc][r]);
}

template <int NR>
__attribute__((target("avx512bf16"))) static void values_bf16_dot(const float* pf, const uint16_t* const* vt, int nt,
                                                                  int jn_last, int hd, float* acc) {
  constexpr int CC = NR <= 4 ? 4 : 2;  // NR x CC accumulators: at most 16
  uint16_t p[NR * kP];                 // the probabilities rounded to bf16 (the dot's operand)
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < nt; ++t)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * kP + t * kKT),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(pf + r * kP + t * kKT)));
  int c = 0;
  for (; c + 16 * CC <= hd; c += 16 * CC) values_cols<NR, CC>(p, vt, nt, jn_last, hd, c, acc);
  for (; c < hd; c += 16) values_cols<NR, 1>(p, vt, nt, jn_last, hd, c, acc);
}

// ---- AMX tiles (amx.h): prefill rows of a bfloat16 cache, 16 x 16 x 32 products per instruction ----
// The bf16 K tile [hd / 2][16][2] is AMX's B operand as it is (rows = dim pairs, columns = keys):
// 32 head dims of 16 keys are one contiguous 1 KiB B tile. Values need 32 keys per instruction:
// two cache tiles, read in place where one block holds both (blocks of 32+ keys), else copied
// (values_amx_chunks). The softmax writes the probabilities as bf16 A tiles (softmax_row_bf16).
// Rows go 16 (RT = 1) or 32 (RT = 2) at a time; the queries, probabilities and outputs have room
// for padding rows up to the next multiple of 32. Needs hd a multiple of 32.
#define ARMSERVE_ATTN_AMX 1
constexpr int kAmxRows = 32;  // rows of a block (two A tiles)

// s[r][t * 16 + j] = q[r] . key j of tile t, 16 * RT rows of bf16 queries (hd apart), raw sums.
template <int RT>
__attribute__((target("amx-tile,amx-bf16"))) static void scores_amx(const uint16_t* q, const uint16_t* const* kt,
                                                                   int nt, int hd, float* s) {
  const int64_t qs = int64_t(hd) * 2;  // bytes between query rows
  armserve_amx::fence();                // the queries were written just now (amx.h)
  for (int t = 0; t < nt; t += 2) {
    const bool two = t + 1 < nt;
    _tile_zero(0);
    _tile_zero(1);
    if (RT > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int d = 0; d < hd; d += 32) {  // 16 dim pairs: rows d / 2 .. d / 2 + 15 of the K tiles
      _tile_loadd(4, q + d, qs);
      if (RT > 1) _tile_loadd(5, q + 16 * hd + d, qs);
      _tile_loadd(6, kt[t] + d * kKT, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (RT > 1) _tile_dpbf16ps(2, 5, 6);
      if (two) {
        _tile_loadd(7, kt[t + 1] + d * kKT, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (RT > 1) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, s + t * kKT, kP * 4);
    if (two) _tile_stored(1, s + (t + 1) * kKT, kP * 4);
    if (RT > 1) {
      _tile_stored(2, s + 16 * kP + t * kKT, kP * 4);
      if (two) _tile_stored(3, s + 16 * kP + (t + 1) * kKT, kP * 4);
    }
  }
}

// The partition's values as 32-key chunks of 16 pair rows (hd * 4 bytes apart), one B tile per
// 16 head dims: vc[c] is chunk c's first pair row. A full chunk whose two 16-key tiles lie one
// after the other (in one cache block of 32 keys or more) is read where it lies; any other chunk
// (blocks of 16, the last one) is copied into vb, with what lies past jn_last keys of the last
// tile zeroed (an odd last key's partner too: 0 x NaN is NaN) and a zero tile after an odd count.
// Returns the number of keys to run (a multiple of 32).
static inline int values_amx_chunks(const uint16_t* const* vt, int nt, int jn_last, int hd, uint16_t* vb,
                                    const uint16_t** vc) {
  const int64_t tile = int64_t(kKT) * hd;  // uint16 per tile: 8 pair rows x hd x 2
  const int nc = (nt + 1) / 2;
  for (int c = 0; c < nc; ++c) {
    const int t = 2 * c;
    const bool full = t + 1 < nt && (t + 2 < nt || jn_last == kKT);
    if (full && vt[t + 1] == vt[t] + tile) {
      vc[c] = vt[t];
      continue;
    }
    uint16_t* dst = vb + c * 2 * tile;
    vc[c] = dst;
    for (int u = 0; u < 2; ++u) {
      if (t + u >= nt) {
        std::memset(dst + u * tile, 0, size_t(tile) * 2);
        continue;
      }
      std::memcpy(dst + u * tile, vt[t + u], size_t(tile) * 2);
      if (t + u == nt - 1) {
        uint16_t* last = dst + u * tile;
        const int np = (jn_last + 1) / 2;
        std::memset(last + int64_t(np) * hd * 2, 0, size_t(kKT / 2 - np) * hd * 4);
        if (jn_last % 2)
          for (int d = 0; d < hd; ++d) last[(int64_t(np - 1) * hd + d) * 2 + 1] = 0;
      }
    }
  }
  return nc * 32;
}

// One row's probabilities over a partition, exp(x (s - max)) computed as 2^y with
// y = s c - max c (c = x log2 e, one FMA), written as bf16 for the values' tile multiply (zeros up
// to nk keys); returns the sum of the fp32 values. 2^y = 2^floor(y) 2^frac(y): vreduceps gives the
// fraction, a degree-4 polynomial 2^frac (relative error 3e-6, far below the bf16 rounding that
// follows) and vscalefps applies 2^floor(y). A masked key's -inf gives fraction 0 and 2^-inf = 0:
// exact zeros with no compare.
__attribute__((target("avx512f,avx512dq,avx512bf16"))) static float softmax_row_bf16(const float* s, int nt, int nk,
                                                                                      float c, float max_c,
                                                                                      uint16_t* p) {
  const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(-max_c);
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < nt; ++t) {
    const __m512 e = exp2_fast(_mm512_fmadd_ps(_mm512_loadu_ps(s + t * kKT), vc, vm));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t * kKT), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (nk > nt * kKT) std::memset(p + nt * kKT, 0, size_t(nk - nt * kKT) * 2);
  return hsum((vf16)sum);
}

// acc[r][d] = sum over the nk keys of p[r][j] v[j][d] (written, not added to), 16 * RT rows;
// p: bf16 probabilities, rows kP apart; vc: the value chunks (values_amx_chunks).
template <int RT>
__attribute__((target("amx-tile,amx-bf16"))) static void values_amx(const uint16_t* p, const uint16_t* const* vc,
                                                                    int nk, int hd, float* acc) {
  const int64_t vs = int64_t(hd) * 4;  // bytes between pair rows
  armserve_amx::fence();                // p and the staged values were written just now (amx.h)
  for (int c = 0; c < hd; c += 32) {   // two 16-dim column tiles
    _tile_zero(0);
    _tile_zero(1);
    if (RT > 1) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int j = 0; j < nk; j += 32) {
      const uint16_t* v = vc[j / 32] + c * 2;
      _tile_loadd(4, p + j, kP * 2);
      if (RT > 1) _tile_loadd(5, p + 16 * kP + j, kP * 2);
      _tile_loadd(6, v, vs);
      _tile_loadd(7, v + 32, vs);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (RT > 1) {
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, acc + c, hd * 4);
    _tile_stored(1, acc + c + 16, hd * 4);
    if (RT > 1) {
      _tile_stored(2, acc + 16 * hd + c, hd * 4);
      _tile_stored(3, acc + 16 * hd + c + 16, hd * 4);
    }
  }
}
#elif defined(__aarch64__)
#define ARMSERVE_ATTN_BF16_DOT 1
#if defined(__ARM_FEATURE_SVE)
#define ARMSERVE_BF16_TARGET __attribute__((target("arch=armv8.2-a+sve+bf16")))
#else
#define ARMSERVE_BF16_TARGET __attribute__((target("arch=armv8.2-a+bf16")))
#endif
// 128-bit vectors: a 16-key tile is four of them, so one tile already gives each broadcast
// query pair four dot instructions.
template <int NR>
ARMSERVE_BF16_TARGET static void scores_bf16_dot(const uint16_t* q, const uint16_t* const* kt, int nt, int nk_pf,
                                                 int hd, float* s, const uint16_t* const* vt) {
  for (int t = 0; t < nt; ++t) {
    if (t + 1 < nk_pf) __builtin_prefetch(kt[t + 1]);
    if (vt) __builtin_prefetch(vt[t]);
    float32x4_t a[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = vdupq_n_f32(0.f);
    for (int dp = 0; dp < hd / 2; ++dp) {
      const uint16_t* k = kt[t] + dp * 2 * kKT;
      bfloat16x8_t kv[4];
      for (int i = 0; i < 4; ++i) kv[i] = vreinterpretq_bf16_u16(vld1q_u16(k + 8 * i));
      for (int r = 0; r < NR; ++r) {
        uint32_t pair;
        std::memcpy(&pair, q + r * hd + 2 * dp, 4);
        const bfloat16x8_t qv = vreinterpretq_bf16_u32(vdupq_n_u32(pair));
        for (int i = 0; i < 4; ++i) a[r][i] = vbfdotq_f32(a[r][i], qv, kv[i]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) vst1q_f32(s + r * kP + t * kKT + 4 * i, a[r][i]);
  }
}

template <int NR>
ARMSERVE_BF16_TARGET static void values_bf16_dot(const float* pf, const uint16_t* const* vt, int nt, int jn_last,
                                                 int hd, float* acc) {
  uint16_t p[NR * kP];  // the probabilities rounded to bf16 (the dot's operand)
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < nt * kKT; j += 8) {
      const bfloat16x8_t lo = vcvtq_low_bf16_f32(vld1q_f32(pf + r * kP + j));
      vst1q_u16(p + r * kP + j, vreinterpretq_u16_bf16(vcvtq_high_bf16_f32(lo, vld1q_f32(pf + r * kP + j + 4))));
    }
  const uint32x4_t odd_mask = vdupq_n_u32(0x0000ffffu);
  for (int c = 0; c < hd; c += 16) {
    float32x4_t a[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = vdupq_n_f32(0.f);
    for (int t = 0; t < nt; ++t) {
      const int jn = t + 1 < nt ? kKT : jn_last, np = (jn + 1) / 2;
      for (int jp = 0; jp < np; ++jp) {
        bfloat16x8_t v[4];
        for (int i = 0; i < 4; ++i) {
          uint32x4_t w = vreinterpretq_u32_u16(vld1q_u16(vt[t] + (int64_t(jp) * hd + c + 4 * i) * 2));
          if (jn % 2 && jp == np - 1) w = vandq_u32(w, odd_mask);
          v[i] = vreinterpretq_bf16_u32(w);
        }
        for (int r = 0; r < NR; ++r) {
          uint32_t pr;
          std::memcpy(&pr, p + r * kP + t * kKT + 2 * jp, 4);
          const bfloat16x8_t pv = vreinterpretq_bf16_u32(vdupq_n_u32(pr));
          for (int i = 0; i < 4; ++i) a[r][i] = vbfdotq_f32(a[r][i], pv, v[i]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) vst1q_f32(acc + r * hd + c + 4 * i, a[r][i]);
  }
}
#endif

// 16 fp32 lanes stored as cache/activation elements (round to nearest even, NaN as PyTorch's).
template <int CT>
ARMSERVE_VI void store16(void* base, int64_t i, vf16 v) {
  if (CT == CT_F32) return vstore(static_cast<float*>(base) + i, v);
  if (CT == CT_BF16) {
    const vu16 u = vbits<vu16>(v);
    vu16 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    r = vsel((u & 0x7fffffffu) > 0x7f800000u, vu16{} + 0x7fc0u, r);
    uint16_t* dst = static_cast<uint16_t*>(base) + i;
#ifdef ARMSERVE_WIDE
    for (int j = 0; j < vu16::N; ++j) {  // (narrowed part by part: each part's lanes are 16 bits apart)
      typedef uint16_t ph_t __attribute__((vector_size(kVL * 2)));
      const ph_t h = __builtin_convertvector(r.p[j], ph_t);
      std::memcpy(dst + kVL * j, &h, sizeof h);
    }
#else
    const vh16 h = __builtin_convertvector(r, vh16);
    std::memcpy(dst, &h, sizeof h);
#endif
    return;
  }
  uint16_t* p = static_cast<uint16_t*>(base) + i;
  float t[16];
  vstore(t, v);
  for (int j = 0; j < 16; ++j) p[j] = f32_to_f16(t[j]);
}

// v rounded through element type CT and back (PyTorch rounds every intermediate tensor).
template <int CT>
ARMSERVE_VI vf16 round16(vf16 v) {
  if (CT == CT_F32) return v;
  if (CT == CT_BF16) {  // in registers: round to nearest even on the upper half, NaN stays NaN
    const vu16 u = vbits<vu16>(v);
    const vu16 r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return vbits<vf16>(vsel((u & 0x7fffffffu) > 0x7f800000u, vu16{} + 0x7fc00000u, r));
  }
  uint16_t t[16];
  store16<CT>(t, 0, v);
  return load16<CT>(t, 0);
}

// One RMSNorm row of d elements (a multiple of 16) in two passes of 16-lane vectors: with a
// residual, x + residual rounded to the element type goes back into the residual and is what gets
// normalised; the normalised row is rounded before the weight multiplies it (PyTorch's
// `hidden.to(dtype) * weight`), or, with a weight offset (Gemma's 1 + w), multiplied unrounded.
template <int CT>
static void rms_norm_row(const void* x, void* res, const void* w, void* out, int64_t d, float eps, float w_offset) {
  vf16 ss = vf16{};
  for (int64_t i = 0; i < d; i += 16) {
    vf16 v = load16<CT>(x, i);
    if (res) {
      v = round16<CT>(v + load16<CT>(res, i));
      store16<CT>(res, i, v);
    }
    ss += v * v;
  }
  const vf16 inv = vsplat(1.0f / std::sqrt(hsum(ss) / float(d) + eps)), off = vsplat(w_offset);
  const void* src = res ? res : x;
  for (int64_t i = 0; i < d; i += 16) {
    const vf16 v = load16<CT>(src, i), wv = load16<CT>(w, i);
    store16<CT>(out, i, w_offset != 0.f ? v * inv * (wv + off) : round16<CT>(v * inv) * wv);
  }
}

// out row [d] = silu(x[:d]) * x[d:2d] for one row, d a multiple of 16; silu rounded to the
// element type before the product, as PyTorch's F.silu(gate) * up.
template <int CT>
static void silu_and_mul_row(const void* x, void* out, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) {
    const vf16 g = load16<CT>(x, i), u = load16<CT>(x, d + i);
    const vf16 s = round16<CT>(g * vrecip(vexp(-g) + 1.0f));
    store16<CT>(out, i, s * u);
  }
}

#if defined(__AVX512F__)
// The same two rows for bf16 where the CPU has AVX512-BF16 (armserve_bf16_dot): vcvtne2ps2bf16
// rounds 32 floats to nearest even in one instruction (the integer rounding of store16 / round16
// takes ~7 per 16), about a quarter of a SiLU row. NaN stays NaN (not the one 0x7fc0 of store16)
// and fp32 results below 2^-126 flush to zero.
#define ARMSERVE_ROWS_BF16_CVT 1
__attribute__((target("avx512bf16"), always_inline)) static inline __m512i cvt32_bf16(vf16 lo, vf16 hi) {
  return (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
}
__attribute__((target("avx512bf16"), always_inline)) static inline void unpack32_bf16(__m512i v, vf16* lo, vf16* hi) {
  *lo = (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16);
  *hi = (vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16);
}

// silu(g) = g / (1 + 2^(-g log2 e)) to a few 1e-6, rounded to bf16 next: the fast 2^y (its input
// capped at 126, so the denominator stays finite for one Newton step on vrcp14ps).
static inline vf16 silu_bf16(vf16 g) {
  const __m512 y = _mm512_min_ps(_mm512_mul_ps((__m512)g, _mm512_set1_ps(-1.44269504088896341f)),
                                 _mm512_set1_ps(126.0f));
  const __m512 d = _mm512_add_ps(exp2_fast(y), _mm512_set1_ps(1.0f));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_fmadd_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(1.0f)), r);
  return (vf16)_mm512_mul_ps((__m512)g, r);
}

// silu_and_mul_row<CT_BF16> for d a multiple of 32.
__attribute__((target("avx512bf16"))) static void silu_and_mul_row_bf16_cvt(const void* x, void* out, int64_t d) {
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < d; i += 32) {
    const vf16 g0 = load16<CT_BF16>(x, i), g1 = load16<CT_BF16>(x, i + 16);
    vf16 s0, s1;
    unpack32_bf16(cvt32_bf16(silu_bf16(g0), silu_bf16(g1)), &s0, &s1);
    _mm512_storeu_si512(o + i, cvt32_bf16(s0 * load16<CT_BF16>(x, d + i), s1 * load16<CT_BF16>(x, d + i + 16)));
  }
}

// rms_norm_row<CT_BF16> without a weight offset, for d a multiple of 32.
__attribute__((target("avx512bf16"))) static void rms_norm_row_bf16_cvt(const void* x, void* res, const void* w,
                                                                         void* out, int64_t d, float eps) {
  vf16 ss = vf16{};
  for (int64_t i = 0; i < d; i += 32) {
    vf16 v0 = load16<CT_BF16>(x, i), v1 = load16<CT_BF16>(x, i + 16);
    if (res) {
      const __m512i r = cvt32_bf16(v0 + load16<CT_BF16>(res, i), v1 + load16<CT_BF16>(res, i + 16));
      _mm512_storeu_si512(static_cast<uint16_t*>(res) + i, r);
      unpack32_bf16(r, &v0, &v1);
    }
    ss += v0 * v0;
    ss += v1 * v1;
  }
  const vf16 inv = vsplat(1.0f / std::sqrt(hsum(ss) / float(d) + eps));
  const void* src = res ? res : x;
  uint16_t* o = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < d; i += 32) {
    vf16 n0, n1;
    unpack32_bf16(cvt32_bf16(load16<CT_BF16>(src, i) * inv, load16<CT_BF16>(src, i + 16) * inv), &n0, &n1);
    _mm512_storeu_si512(o + i, cvt32_bf16(n0 * load16<CT_BF16>(w, i), n1 * load16<CT_BF16>(w, i + 16)));
  }
}
#endif

#ifdef ARMSERVE_ATTN_AMX
// The tile configuration for the scope of an item that uses AMX (amx.h).
struct AmxScope {
  bool on;
  explicit AmxScope(bool o) : on(o) {
    if (on) armserve_amx::begin();
  }
  ~AmxScope() {
    if (on) armserve_amx::end();
  }
};
static inline bool amx_active() { return armserve_amx_active() != 0; }
#else
static inline bool amx_active() { return false; }
#endif

template <class Isa>
struct Attention {
  static constexpr int KT = kKT;  // keys per tile (one vector of lanes)
  static constexpr int QT = 16;   // query positions per prefill item (32 for AMX: whole 32-row blocks)
  static constexpr int P = kP;    // keys per partition (a multiple of KT)
#if defined(__AVX512F__)
  static constexpr int RB = 8;  // query rows whose scores / outputs stay in registers together
  static constexpr int RB2 = 8;  // the same for float32 / float16 / int8 caches (two chains a row)
#else
  static constexpr int RB = 4;
  static constexpr int RB2 = 2;
#endif

  static inline void prefetch(const char* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 2);  // to L2 (see prefetch_partition)
  }

  // Where element d of the key/value of cache slot `slot`, head `h` lives (element indices; see
  // the layout above). `pairs`: the bfloat16 layout.
  static inline int64_t block_base(int64_t slot, int bs, int hk, int h) { return (slot / bs * hk + h) * bs; }
  static inline int64_t k_tile(int64_t slot, int bs, int hk, int h, int hd) {
    return ((slot / bs * hk + h) * (bs / KT) + slot % bs / KT) * int64_t(hd) * KT;
  }
  static inline int64_t k_index(int64_t slot, int bs, int hk, int h, int hd, int d, bool pairs) {
    const int lane = int(slot % KT);
    return k_tile(slot, bs, hk, h, hd) + (pairs ? (d / 2) * 2 * KT + lane * 2 + d % 2 : int64_t(d) * KT + lane);
  }
  static inline int64_t v_index(int64_t slot, int bs, int hk, int h, int hd, int d, bool pairs) {
    const int64_t base = block_base(slot, bs, hk, h) * hd;
    const int o = int(slot % bs);
    return base + (pairs ? (o / 2) * 2 * int64_t(hd) + d * 2 + o % 2 : int64_t(o) * hd + d);
  }

  // ---- cache writes ---------------------------------------------------------------------------

  static void reshape_and_cache(int32_t dtype, const void* k, const void* v, void* kc, void* vc, const int64_t* slots,
                                int64_t tokens, int32_t hk, int32_t hd, int64_t src_stride, int32_t bs) {
    const int es = dtype_size(dtype);
    const bool pairs = dtype == AS_BF16;
    armserve_par::for_static(tokens, tokens * hk * hd >= (1 << 16), [&](int64_t t) {
      const char* kr = static_cast<const char*>(k) + t * src_stride * es;
      const char* vr = static_cast<const char*>(v) + t * src_stride * es;
      for (int h = 0; h < hk; ++h) {
        const int64_t kt = k_index(slots[t], bs, hk, h, hd, 0, pairs);
        const int64_t vt = v_index(slots[t], bs, hk, h, hd, 0, pairs);
        const char* ks = kr + int64_t(h) * hd * es;
        const char* vs = vr + int64_t(h) * hd * es;
        if (!pairs) {
          for (int d = 0; d < hd; ++d)
            std::memcpy(static_cast<char*>(kc) + (kt + int64_t(d) * KT) * es, ks + int64_t(d) * es, es);
          std::memcpy(static_cast<char*>(vc) + vt * es, vs, size_t(hd) * es);
          continue;
        }
        uint16_t* kd = static_cast<uint16_t*>(kc) + kt;  // K: pairs of head dims, 2 * KT apart
        uint16_t* vd = static_cast<uint16_t*>(vc) + vt;  // V: every other element (pairs of keys)
        const uint16_t* k16 = reinterpret_cast<const uint16_t*>(ks);
        const uint16_t* v16 = reinterpret_cast<const uint16_t*>(vs);
        for (int d = 0; d < hd; ++d) kd[(d / 2) * 2 * KT + d % 2] = k16[d];
        for (int d = 0; d < hd; ++d) vd[2 * d] = v16[d];
      }
    });
  }

  // int8 KV cache: quantize each (token, kv head) row of this step's k/v into its cache slot.
  static void reshape_and_cache_i8(int32_t dtype, const void* k, const void* v, int8_t* kc, int8_t* vc, float* ks,
                                   float* vs, const int64_t* slots, int64_t tokens, int32_t hk, int32_t hd,
                                   int64_t src_stride, int32_t bs) {
    const int es = dtype_size(dtype);
    armserve_par::for_static(tokens, tokens * hk * hd >= (1 << 14), [&](int64_t t) {
      float* row = scratch(0, hd);
      int8_t* q8 = reinterpret_cast<int8_t*>(scratch(1, hd / 4 + 1));
      for (int h = 0; h < hk; ++h) {
        const int64_t srow = block_base(slots[t], bs, hk, h) + slots[t] % bs;
        Isa::load(dtype, static_cast<const char*>(k) + (t * src_stride + int64_t(h) * hd) * es, row, hd);
        ks[srow] = quantize_row_i8(row, q8, hd);
        int8_t* kd = kc + k_index(slots[t], bs, hk, h, hd, 0, false);
        for (int d = 0; d < hd; ++d) kd[int64_t(d) * KT] = q8[d];
        Isa::load(dtype, static_cast<const char*>(v) + (t * src_stride + int64_t(h) * hd) * es, row, hd);
        vs[srow] = quantize_row_i8(row, vc + v_index(slots[t], bs, hk, h, hd, 0, false), hd);
      }
    });
  }

  // ---- micro-kernels ------------------------------------------------------------------------------

  // Two accumulator sets (even and odd steps) for every row count (kChains): with a few rows, one chain per
  // row would wait on the FMA latency every step, and a row's sums must come out the same whatever
  // rows share its block (a verify step's rows against decode steps'). Rows per block for these
  // float kernels are capped where 2 x NR vectors would not fit the registers (RB2).
  static constexpr int kChains = 2;

  // s[r][0..16) = q[r] . key tile for NR rows of queries (fp32 rows `q`, and for a bfloat16 cache
  // the same rows in bf16, `qb`; rows hd apart; s rows P apart). kt: [hd][16], or [hd / 2][16][2].
  template <int CT, int NR>
  static void scores(const float* q, const void* kt, int hd, float* s) {
    if (CT == CT_BF16) {  // pairs widened: even head dims by a shift, odd ones by a mask
      vf16 a[2][NR];
      for (int u = 0; u < 2; ++u)
        for (int r = 0; r < NR; ++r) a[u][r] = vf16{};
      for (int dp = 0; dp < hd / 2; ++dp) {
        const vu16 w = vload_u(static_cast<const uint16_t*>(kt) + dp * 2 * KT);
        const vf16 lo = vbits<vf16>(w << 16), hi = vbits<vf16>(w & 0xffff0000u);
        for (int r = 0; r < NR; ++r) {
          a[0][r] = vfma(vsplat(q[r * hd + 2 * dp]), lo, a[0][r]);
          a[1][r] = vfma(vsplat(q[r * hd + 2 * dp + 1]), hi, a[1][r]);
        }
      }
      for (int r = 0; r < NR; ++r) vstore(s + r * P, a[0][r] + a[1][r]);
      return;
    }
    constexpr int U = kChains;
    vf16 a[U][NR];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < NR; ++r) a[u][r] = vf16{};
    for (int d = 0; d < hd; d += U) {  // hd is a multiple of 16
      for (int u = 0; u < U; ++u) {
        const vf16 kv = load16<CT>(kt, int64_t(d + u) * KT);
        for (int r = 0; r < NR; ++r) a[u][r] = vfma(vsplat(q[r * hd + d + u]), kv, a[u][r]);
      }
    }
    for (int r = 0; r < NR; ++r) vstore(s + r * P, U == 2 ? a[0][r] + a[U - 1][r] : a[0][r]);
  }

  // acc[r] += sum_j p[r][j] * v[j] over the tile's first jn keys, for NR rows (p rows P apart, acc
  // rows hd apart; value tile vt: [16][hd], or [8][hd][2]). NOTE: keys past the context are never
  // read, not even with weight 0: their slots hold whatever the (torch.empty) cache held, and
  // 0 * NaN is NaN.
  template <int CT, int NR>
  static void weighted_values(const float* p, const void* vt, int hd, float* acc, int jn) {
    if (CT == CT_BF16) {  // pairs of keys widened: the even key by a shift, the odd one by a mask
      const uint16_t* v16 = static_cast<const uint16_t*>(vt);
      for (int c = 0; c < hd; c += 16) {
        vf16 a[2][NR];
        for (int r = 0; r < NR; ++r) a[0][r] = vload(acc + r * hd + c), a[1][r] = vf16{};
        for (int jp = 0; 2 * jp < jn; ++jp) {
          const vu16 w = vload_u(v16 + (int64_t(jp) * hd + c) * 2);
          const vf16 lo = vbits<vf16>(w << 16);
          for (int r = 0; r < NR; ++r) a[0][r] = vfma(vsplat(p[r * P + 2 * jp]), lo, a[0][r]);
          if (2 * jp + 1 < jn) {
            const vf16 hi = vbits<vf16>(w & 0xffff0000u);
            for (int r = 0; r < NR; ++r) a[1][r] = vfma(vsplat(p[r * P + 2 * jp + 1]), hi, a[1][r]);
          }
        }
        for (int r = 0; r < NR; ++r) vstore(acc + r * hd + c, a[0][r] + a[1][r]);
      }
      return;
    }
    constexpr int U = kChains;
    for (int c = 0; c < hd; c += 16) {
      vf16 a[U][NR];
      for (int r = 0; r < NR; ++r) a[0][r] = vload(acc + r * hd + c);
      for (int u = 1; u < U; ++u)
        for (int r = 0; r < NR; ++r) a[u][r] = vf16{};
      int j = 0;
      for (; j + U <= jn; j += U) {
        for (int u = 0; u < U; ++u) {
          const vf16 vv = load16<CT>(vt, int64_t(j + u) * hd + c);
          for (int r = 0; r < NR; ++r) a[u][r] = vfma(vsplat(p[r * P + j + u]), vv, a[u][r]);
        }
      }
      for (; j < jn; ++j) {
        const vf16 vv = load16<CT>(vt, int64_t(j) * hd + c);
        for (int r = 0; r < NR; ++r) a[0][r] = vfma(vsplat(p[r * P + j]), vv, a[0][r]);
      }
      for (int r = 0; r < NR; ++r) vstore(acc + r * hd + c, U == 2 ? a[0][r] + a[U - 1][r] : a[0][r]);
    }
  }

  // The micro-kernel F<CT, nr> for a row count known only at run time (1..RB).
#if defined(__AVX512F__)
#define ARMSERVE_ROWS_WIDE(F, ...) \
  case 5: return F<CT, 5>(__VA_ARGS__); \
  case 6: return F<CT, 6>(__VA_ARGS__); \
  case 7: return F<CT, 7>(__VA_ARGS__); \
  case 8: return F<CT, 8>(__VA_ARGS__);
#else
#define ARMSERVE_ROWS_WIDE(F, ...)
#endif
#define ARMSERVE_ROWS(nr, F, ...)         \
  switch (nr) {                           \
    case 1: return F<CT, 1>(__VA_ARGS__); \
    case 2: return F<CT, 2>(__VA_ARGS__); \
    case 3: return F<CT, 3>(__VA_ARGS__); \
    case 4: return F<CT, 4>(__VA_ARGS__); \
    ARMSERVE_ROWS_WIDE(F, __VA_ARGS__)    \
  }

  template <int CT>
  static void scores_n(int nr, const float* q, const void* kt, int hd, float* s) {
    ARMSERVE_ROWS(nr, scores, q, kt, hd, s)
  }
#ifdef ARMSERVE_ATTN_BF16_DOT
  template <int CT, int NR>  // (CT: the switch's shape; only bfloat16 gets here)
  static void scores_dot(const uint16_t* q, const uint16_t* const* kt, int nt, int nk_pf, int hd, float* s,
                         const uint16_t* const* vt) {
    scores_bf16_dot<NR>(q, kt, nt, nk_pf, hd, s, vt);
  }
  template <int CT, int NR>
  static void values_dot(const float* p, const uint16_t* const* vt, int nt, int jn_last, int hd, float* acc) {
    values_bf16_dot<NR>(p, vt, nt, jn_last, hd, acc);
  }
  template <int CT>
  static void scores_dot_n(int nr, const uint16_t* q, const uint16_t* const* kt, int nt, int nk_pf, int hd,
                           float* s, const uint16_t* const* vt) {
    ARMSERVE_ROWS(nr, scores_dot, q, kt, nt, nk_pf, hd, s, vt)
  }
  template <int CT>
  static void values_dot_n(int nr, const float* p, const uint16_t* const* vt, int nt, int jn_last, int hd,
                           float* acc) {
    ARMSERVE_ROWS(nr, values_dot, p, vt, nt, jn_last, hd, acc)
  }
#endif

  template <int CT>
  static void weighted_values_n(int nr, const float* p, const void* vt, int hd, float* acc, int jn) {
    ARMSERVE_ROWS(nr, weighted_values, p, vt, hd, acc, jn)
  }
#undef ARMSERVE_ROWS
#undef ARMSERVE_ROWS_WIDE

  // Fold one partition's state (m, l, acc) into a running one (M, L, T). Both the in-item walk
  // over partitions and the cross-item merge call this, in partition order: same bits either way.
  static void merge_row(float& M, float& L, float* T, float m, float l, const float* a, int hd) {
    if (m == -INFINITY) return;
    if (m == M) {  // the same offset (AMX rows past their first partition): a plain sum
      L += l;
      int d = 0;
      for (; d + 16 <= hd; d += 16) vstore(T + d, vload(T + d) + vload(a + d));
      for (; d < hd; ++d) T[d] += a[d];
      return;
    }
    if (M == -INFINITY) {
      M = m;
      L = l;
      std::memcpy(T, a, sizeof(float) * hd);
      return;
    }
    const float Mn = fmax2(M, m), f1 = exp_fast(M - Mn), f2 = exp_fast(m - Mn);
    L = L * f1 + l * f2;
    int d = 0;
    for (; d + 16 <= hd; d += 16) vstore(T + d, vfma(vload(T + d), vsplat(f1), vload(a + d) * f2));
    for (; d < hd; ++d) T[d] = T[d] * f1 + a[d] * f2;
    M = Mn;
  }

  static void finish_row(int dtype, float L, float* T, int hd, void* dst) {
    const float inv = L > 0.f ? 1.0f / L : 0.f;
    for (int d = 0; d < hd; ++d) T[d] *= inv;
    Isa::store(dtype, T, dst, hd);
  }

  // ---- one item -------------------------------------------------------------------------------------

  struct Item {
    int32_t seq, q0, qn, head, part;  // part: the one partition this item computes, or -1 for all
    int64_t partial;                  // part >= 0: offset of its state in the partials (floats)
  };

  struct Args {
    int32_t dtype;
    void* out;
    const void* q;
    const void* kc;
    const void* vc;
    const float* ks;
    const float* vs;
    const AttnBatch* b;
    int32_t hq, hk, hd, window;
    float scale, softcap;
    int64_t q_stride;
    bool amx;  // AMX tiles may run (armserve_amx_active), for items of a bfloat16 cache with enough rows
  };

  // First and one-past-last key position a tile of queries may see.
  static void key_range(const Args& a, int seq, int q0, int qn, int* lo, int* hi) {
    const int first = a.b->context_len[seq] - a.b->q_len[seq] + q0;
    *lo = a.window > 0 ? imax(0, first - a.window + 1) : 0;
    *hi = first + qn;
  }

  // Partition p of item w (keys [lo, hi)): its keys [k0, k1) and the tiles that hold them,
  // [t0, t0 + nt * KT), the last one holding jn_last of them.
  struct Part {
    int k0, k1, t0, nt, jn_last;
  };
  static Part partition(int p, int lo, int hi) {
    Part r;
    r.k0 = imax(lo, p * P), r.k1 = imin(hi, (p + 1) * P);
    r.t0 = r.k0 / KT * KT, r.nt = (r.k1 - r.t0 + KT - 1) / KT;
    r.jn_last = r.k1 - (r.t0 + (r.nt - 1) * KT);
    return r;
  }

  // Prefetch, into L2, every K and V tile of partition p of item w (p < 0: the item's first).
  // run_item calls this for what it will read next (its next partition, or the next item) as it
  // starts a partition: the tiles are scattered blocks that no hardware prefetcher follows, and a
  // decode item is too short for prefetches issued inside it to arrive in time. Measured on a Zen 4
  // core, keys and values streaming from memory (bench_attention, SmolLM2 shape, batch 32-64):
  // ~11 GB/s and 7.4-8.4 ns per (key, query head) before, 12-15 GB/s and 5.6-7.0 ns after (runs on
  // this 2-core VM vary by ~15%; a decode step of the engine at batch 32: 67-71 -> 61-67 ms). L2 rather than L1
  // (prefetcht1): scattered 2-4 KiB chunks prefetched into L1 streamed at ~10 GB/s there (its few
  // miss buffers bound the lines in flight), into L2 at 17-18 (a plain sequential read: 26-31).
  // Returns how many tiles, their K addresses in kt.
  static int prefetch_partition(const Args& a, const Item& w, int p, const char** kt) {
    int lo, hi;
    key_range(a, w.seq, w.q0, w.qn, &lo, &hi);
    if (p < 0) p = w.part >= 0 ? w.part : lo / P;
    const Part pt = partition(p, lo, hi);
    const char* vt[P / KT];
    int64_t slots[P / KT];
    tile_addresses(a, w, pt, kt, vt, slots);
    const int64_t bytes = int64_t(a.hd) * KT * (a.ks ? 1 : dtype_size(a.dtype));
    for (int t = 0; t < pt.nt; ++t) prefetch(kt[t], bytes), prefetch(vt[t], bytes);
    return pt.nt;
  }

  // The K and V tile addresses and the cache slots of partition pt's tiles: tiles are scattered,
  // so each one's address is worked out once.
  static void tile_addresses(const Args& a, const Item& w, const Part& pt, const char** kt, const char** vt,
                             int64_t* slots) {
    const int32_t* bt = a.b->block_tables + int64_t(w.seq) * a.b->max_blocks;
    const int bs = a.b->block_size, cs = a.ks ? 1 : dtype_size(a.dtype);
    const bool pairs = !a.ks && a.dtype == AS_BF16;
    for (int t = 0; t < pt.nt; ++t) {
      const int j0 = pt.t0 + t * KT;
      slots[t] = int64_t(bt[j0 / bs]) * bs + j0 % bs;
      kt[t] = static_cast<const char*>(a.kc) + k_index(slots[t], bs, a.hk, w.head, a.hd, 0, pairs) * cs;
      vt[t] = static_cast<const char*>(a.vc) + v_index(slots[t], bs, a.hk, w.head, a.hd, 0, pairs) * cs;
    }
  }

  // next: the item this thread will most likely run after w (its first partition is prefetched).
  template <int CT>
  static void run_item(const Args& a, const Item& w, float* partials, const Item* next) {
    const AttnBatch* b = a.b;
    const int group = a.hq / a.hk, hd = a.hd, bs = b->block_size, R = w.qn * group;
    const int es = dtype_size(a.dtype);
    const int first = b->context_len[w.seq] - b->q_len[w.seq] + w.q0;  // position of the item's first query
    int lo, hi;
    key_range(a, w.seq, w.q0, w.qn, &lo, &hi);

#ifdef ARMSERVE_ATTN_BF16_DOT
    const bool dot = CT == CT_BF16 && armserve_bf16_dot;
#else
    const bool dot = false;
#endif
#ifdef ARMSERVE_ATTN_AMX
    // AMX for a block of at least 16 rows (prefill); a decode item's few rows keep the dot tiles.
    const bool amx = dot && a.amx && hd % 32 == 0 && R >= 16;
    const int RA = (R + kAmxRows - 1) / kAmxRows * kAmxRows;  // rows with room for tile padding
    const int rb = amx ? kAmxRows : CT == CT_BF16 ? RB : RB2;  // rows per block
    const AmxScope amx_scope(amx);
#else
    const bool amx = false;
    const int RA = R, rb = CT == CT_BF16 ? RB : RB2;
#endif
    float* qf = scratch(0, int64_t(R) * hd);
    float* acc = scratch(1, int64_t(RA) * hd);
    float* tot = scratch(2, int64_t(R) * hd);
    float* st = scratch(3, int64_t(R) * 4 + int64_t(rb) * P);
    float *m = st, *l = st + R, *M = st + 2 * R, *L = st + 3 * R;
    float* sb = st + 4 * R;  // [rb][P]: one row block's scores, then probabilities, over a partition
    // The queries as fp32, and for a bfloat16 cache also as they are (the dot instructions' operand).
    uint16_t* qb = CT == CT_BF16 ? reinterpret_cast<uint16_t*>(scratch(4, int64_t(RA) * hd / 2 + 1)) : nullptr;
    // AMX: value chunks copied where they cannot be read in place (values_amx_chunks), a spare zero
    // tile after; a row block's bf16 probabilities.
    [[maybe_unused]] uint16_t* vb = amx ? reinterpret_cast<uint16_t*>(scratch(6, int64_t(P + KT) * hd / 2)) : nullptr;
    uint16_t* pb = amx ? reinterpret_cast<uint16_t*>(scratch(5, int64_t(rb) * P / 2)) : nullptr;
    [[maybe_unused]] const uint16_t* vch[P / 32 + 1];
    if (amx) std::memset(qb + int64_t(R) * hd, 0, sizeof(uint16_t) * (RA - R) * hd);  // padding rows
    const bool prescale = CT == CT_I8 || a.softcap > 0.f || !(a.scale > 0.f);
    const float xs = prescale ? 1.f : a.scale;  // the scale applied inside the exponential

    for (int i = 0; i < w.qn; ++i) {
      const int64_t tok = b->q_start[w.seq] + w.q0 + i;
      for (int g = 0; g < group; ++g) {
        const int64_t r = i * group + g;
        const char* src = static_cast<const char*>(a.q) + (tok * a.q_stride + int64_t(w.head * group + g) * hd) * es;
        if (CT == CT_BF16) std::memcpy(qb + r * hd, src, sizeof(uint16_t) * hd);
        if (!dot) Isa::load(a.dtype, src, qf + r * hd, hd);
      }
    }
    for (int r = 0; r < R; ++r) M[r] = -INFINITY, L[r] = 0.f;

    const int p_first = w.part >= 0 ? w.part : lo / P;
    const int p_last = w.part >= 0 ? w.part : (hi - 1) / P;
    // Rows of the last query position see the narrowest window; rows of the first, the fewest keys.
    const int lo_all = a.window > 0 ? imax(0, first + w.qn - 1 - a.window + 1) : 0;
    const int cs = CT == CT_I8 ? 1 : es;  // cache element size
    for (int p = p_first; p <= p_last; ++p) {
      // A partition in two passes per row block: every score first, so that the max, the
      // exponentials and their sum run over whole vectors (no per-tile rescaling, one horizontal
      // reduction per row and partition), then the values.
      const Part part = partition(p, lo, hi);
      const auto [k0, k1, t0, nt, jn_last] = part;
      const char* ktp[2 * P / KT];  // this partition's K tiles, then the next one's
      const char* vtp[P / KT];
      int64_t slots[P / KT];
      tile_addresses(a, w, part, ktp, vtp, slots);
      [[maybe_unused]] const int nk_pf = nt + (p < p_last ? prefetch_partition(a, w, p + 1, ktp + nt)
                                               : next    ? prefetch_partition(a, *next, -1, ktp + nt)
                                                         : 0);
      if (!dot) std::memset(acc, 0, sizeof(float) * R * hd);
      int nk = 0;  // AMX: keys staged
#ifdef ARMSERVE_ATTN_AMX
      if (amx) nk = values_amx_chunks(reinterpret_cast<const uint16_t* const*>(vtp), nt, jn_last, hd, vb, vch);
#endif
      for (int r0 = 0; r0 < R; r0 += rb) {
        const int nr = imin(rb, R - r0);
        if (amx) {
#ifdef ARMSERVE_ATTN_AMX
          if (nr > 16)
            scores_amx<2>(qb + int64_t(r0) * hd, reinterpret_cast<const uint16_t* const*>(ktp), nt, hd, sb);
          else
            scores_amx<1>(qb + int64_t(r0) * hd, reinterpret_cast<const uint16_t* const*>(ktp), nt, hd, sb);
#endif
        } else if (dot) {
#ifdef ARMSERVE_ATTN_BF16_DOT
          // (first row block: also prefetches the next K tiles and this partition's V tiles)
          scores_dot_n<CT>(nr, qb + int64_t(r0) * hd, reinterpret_cast<const uint16_t* const*>(ktp), nt, nk_pf, hd, sb,
                           r0 == 0 ? reinterpret_cast<const uint16_t* const*>(vtp) : nullptr);
#endif
        } else {
          for (int t = 0; t < nt; ++t) {
            if (r0 == 0 && t + 1 < nt) {  // the next tile is usually another block: too far for the prefetcher
              prefetch(ktp[t + 1], int64_t(hd) * KT * cs);
              prefetch(vtp[t + 1], int64_t(hd) * KT * cs);
            }
            scores_n<CT>(nr, qf + int64_t(r0) * hd, ktp[t], hd, sb + t * KT);
          }
        }
        // Tiles [ta, tb) need no mask for any row of the item: past every row's window start,
        // before the first row's own position.
        const int ta = imin(nt, imax(0, (imax(k0, lo_all) - t0 + KT - 1) / KT));
        const int tb = imax(ta, imin(nt, (imin(k1, first + 1) - t0) / KT));
        for (int r = 0; r < nr; ++r) {
          float* sr = sb + r * P;
          const int pos = first + (r0 + r) / group;
          const int klo = imax(k0, a.window > 0 ? pos - a.window + 1 : 0), khi = imin(k1, pos + 1);
          // The softmax scale goes into the exponential (one FMA) unless the scores need it first:
          // an int8 cache's per-key scales, a soft cap. It stays off the queries: the bf16 dot
          // takes them as they are.
          if (prescale) {
            for (int t = 0; t < nt; ++t) {
              const vf16 sc = CT == CT_I8 ? vload(a.ks + block_base(slots[t], bs, a.hk, w.head) + slots[t] % bs) * a.scale
                                          : vsplat(a.scale);
              vf16 sv = vload(sr + t * KT) * sc;
              if (a.softcap > 0.f) {
                float c[KT];
                vstore(c, sv);
                for (int j = 0; j < KT; ++j) c[j] = std::tanh(c[j] / a.softcap) * a.softcap;
                sv = vload(c);
              }
              vstore(sr + t * KT, sv);
            }
          }
#ifdef ARMSERVE_ATTN_AMX
          // Past a row's first partition, the running max M of the partitions before is the
          // exponential's offset, not this partition's own max: no max pass over the scores, and
          // the merge is a plain sum. Exact in exact arithmetic, and in floats too: bf16 has
          // fp32's exponent range, so probabilities above 1 (a larger score here) keep their
          // relative precision, and scores far below M underflow only where they would be
          // negligible anyway (M is one of this row's scores). Sums past 2^100 (towards fp32
          // overflow in the value accumulators) take the exact path below instead.
          if (amx && M[r0 + r] > -INFINITY) {
            for (int t = 0; t < nt; ++t) {
              if (t >= ta && t < tb) continue;
              const int j0 = t0 + t * KT;
              const vi16 keys = viota(j0);
              const vf16 sv = vload(sr + t * KT);
              vstore(sr + t * KT, vsel((keys >= klo) & (keys < khi), sv, vsplat(-INFINITY)));
            }
            constexpr float kLog2e = 1.44269504088896341f;
            const float mref = M[r0 + r];
            const float lr = softmax_row_bf16(sr, nt, nk, xs * kLog2e, mref * kLog2e, pb + int64_t(r) * P);
            if (lr <= 0x1p100f) {
              m[r0 + r] = mref;
              l[r0 + r] = lr;
              continue;
            }
          }
#endif
          vf16 mv = vsplat(-INFINITY);
          for (int t = 0; t < nt; ++t) {
            vf16 sv = vload(sr + t * KT);
            if (t < ta || t >= tb) {  // a tile at an edge
              const int j0 = t0 + t * KT;
              const vi16 keys = viota(j0);
              sv = vsel((keys >= klo) & (keys < khi), sv, vsplat(-INFINITY));
              vstore(sr + t * KT, sv);
            }
            mv = vsel(mv > sv, mv, sv);
          }
          const float mr = hmax(mv);
          m[r0 + r] = mr * xs;  // the max in scaled units, as the merge wants it
          if (mr == -INFINITY) {  // no key of this partition is visible to this row
            l[r0 + r] = 0.f;
            if (amx)
              std::memset(pb + int64_t(r) * P, 0, sizeof(uint16_t) * nk);
            else
              std::memset(sr, 0, sizeof(float) * nt * KT);
            continue;
          }
#ifdef ARMSERVE_ATTN_AMX
          if (amx) {
            constexpr float kLog2e = 1.44269504088896341f;
            l[r0 + r] = softmax_row_bf16(sr, nt, nk, xs * kLog2e, mr * xs * kLog2e, pb + int64_t(r) * P);
            continue;
          }
#endif
          vf16 lv = vf16{};
          const vf16 xsv = vsplat(xs), off = vsplat(-mr * xs), ninf = vsplat(-INFINITY);
#ifdef ARMSERVE_EXP2_FAST
          // Rounded to bf16 for the dot: the fast 2^y (its -inf is an exact 0).
          const __m512 xs2 = _mm512_set1_ps(xs * 1.44269504088896341f), off2 = _mm512_set1_ps(-mr * xs * 1.44269504088896341f);
#endif
          for (int t = 0; t < nt; ++t) {
            const vf16 sv = vload(sr + t * KT);
            vf16 pv;
#ifdef ARMSERVE_EXP2_FAST
            if (dot) {
              pv = (vf16)exp2_fast(_mm512_fmadd_ps((__m512)sv, xs2, off2));
            } else
#endif
            {
              pv = vexp(vfma(sv, xsv, off));
              pv = vsel(sv == ninf, vf16{}, pv);
            }
            lv += pv;
            if (CT == CT_I8)  // V's scale, once per key rather than per element
              pv *= vload(a.vs + block_base(slots[t], bs, a.hk, w.head) + slots[t] % bs);
            vstore(sr + t * KT, pv);
          }
          l[r0 + r] = hsum(lv);
        }
        if (amx) {
#ifdef ARMSERVE_ATTN_AMX
          if (nr > 16)
            values_amx<2>(pb, vch, nk, hd, acc + int64_t(r0) * hd);
          else
            values_amx<1>(pb, vch, nk, hd, acc + int64_t(r0) * hd);
#endif
        } else if (dot) {
#ifdef ARMSERVE_ATTN_BF16_DOT
          values_dot_n<CT>(nr, sb, reinterpret_cast<const uint16_t* const*>(vtp), nt, jn_last, hd,
                           acc + int64_t(r0) * hd);
#endif
        } else {
          for (int t = 0; t < nt; ++t)
            weighted_values_n<CT>(nr, sb + t * KT, vtp[t], hd, acc + int64_t(r0) * hd, t + 1 < nt ? KT : jn_last);
        }
      }
      if (w.part >= 0) {  // a partition of its own: the merge pass combines it with the others
        float* o = partials + w.partial;
        for (int r = 0; r < R; ++r) {
          std::memcpy(o + int64_t(r) * (hd + 2), acc + int64_t(r) * hd, sizeof(float) * hd);
          o[int64_t(r) * (hd + 2) + hd] = m[r];
          o[int64_t(r) * (hd + 2) + hd + 1] = l[r];
        }
        return;
      }
      for (int r = 0; r < R; ++r) merge_row(M[r], L[r], tot + int64_t(r) * hd, m[r], l[r], acc + int64_t(r) * hd, hd);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t tok = b->q_start[w.seq] + w.q0 + r / group;
      const int head = w.head * group + r % group;
      if (M[r] == -INFINITY) std::memset(tot + int64_t(r) * hd, 0, sizeof(float) * hd);
      finish_row(a.dtype, L[r], tot + int64_t(r) * hd, hd,
                 static_cast<char*>(a.out) + (tok * a.hq + head) * int64_t(hd) * es);
    }
  }

  // ---- the step -------------------------------------------------------------------------------------

  // q and out in `dtype`; caches in `dtype`, or int8 with per-(slot, head) scales when ks/vs are set.
  static void attend(const Args& a) {
    const AttnBatch* b = a.b;
    const int group = a.hq / a.hk;
    const int nthreads = armserve_par::team_size();
    const int qt = a.amx && a.dtype == AS_BF16 && !a.ks && a.hd % 32 == 0 ? 2 * QT : QT;
    int64_t tiles = 0, max_items = 0;
    for (int s = 0; s < b->num_seqs; ++s) {
      const int t = (b->q_len[s] + qt - 1) / qt;
      tiles += t;
      max_items += int64_t(t) * a.hk * ((b->context_len[s] + P - 1) / P + 1);
    }
    // Partitions become items only when there are too few (sequence, tile, head) items for the threads.
    const bool split = tiles * a.hk < 2LL * nthreads;
    Buffer<Item> items(split ? max_items : tiles * a.hk);
    int64_t n_items = 0, partial_floats = 0;
    // A sequence's items head by head (the tiles of one head share its keys and values, in cache),
    // the last query tile first: it sees the most keys, and the longest items go first.
    for (int s = 0; s < b->num_seqs; ++s) {
      for (int h = 0; h < a.hk && b->q_len[s] > 0; ++h) {
        for (int q0 = (b->q_len[s] - 1) / qt * qt; q0 >= 0; q0 -= qt) {
          const int qn = imin(qt, b->q_len[s] - q0);
          int lo, hi;
          key_range(a, s, q0, qn, &lo, &hi);
          if (!split) {
            items[n_items++] = Item{s, q0, qn, h, -1, 0};
            continue;
          }
          for (int p = lo / P; p <= (hi - 1) / P; ++p) {
            items[n_items++] = Item{s, q0, qn, h, p, partial_floats};
            partial_floats += int64_t(qn) * group * (a.hd + 2);
          }
        }
      }
    }
    // (In a step graph's team every thread builds the same item list; the partials are shared:
    // an item and its merge may run on different threads.)
    armserve_par::SharedFloats partials(partial_floats);
    const int ct = a.ks ? int(CT_I8) : a.dtype;
    armserve_par::for_dynamic(n_items, [&](int64_t it) {
      // Items go out one at a time in order: a thread that finishes item it most likely takes it +
      // nthreads next (the others took those between); one thread, exactly it + 1.
      const Item* next = it + nthreads < n_items ? &items[it + nthreads] : nullptr;
      switch (ct) {
        case CT_F32: run_item<CT_F32>(a, items[it], partials.p, next); break;
        case CT_BF16: run_item<CT_BF16>(a, items[it], partials.p, next); break;
        case CT_F16: run_item<CT_F16>(a, items[it], partials.p, next); break;
        default: run_item<CT_I8>(a, items[it], partials.p, next); break;
      }
    });
    if (partial_floats == 0) return;

    // Merge the partitions of each split (seq, tile, head): its items are adjacent, in order.
    Buffer<int64_t> starts(n_items + 1);
    int64_t n_groups = 0;
    for (int64_t i = 0; i < n_items; ++i) {
      if (items[i].part < 0) continue;
      if (i == 0 || items[i - 1].part < 0 || items[i].seq != items[i - 1].seq || items[i].q0 != items[i - 1].q0 ||
          items[i].head != items[i - 1].head)
        starts[n_groups++] = i;
    }
    const int es = dtype_size(a.dtype);
    armserve_par::for_static(n_groups, true, [&](int64_t gi) {
      const int64_t first = starts[gi];
      int64_t last = first;
      while (last < n_items && items[last].part >= 0 && items[last].seq == items[first].seq &&
             items[last].q0 == items[first].q0 && items[last].head == items[first].head)
        ++last;
      const Item& w0 = items[first];
      float* tot = scratch(2, a.hd);
      for (int r = 0; r < w0.qn * group; ++r) {
        float M = -INFINITY, L = 0.f;
        for (int64_t p = first; p < last; ++p) {
          const float* o = partials.p + items[p].partial + int64_t(r) * (a.hd + 2);
          merge_row(M, L, tot, o[a.hd], o[a.hd + 1], o, a.hd);
        }
        if (M == -INFINITY) std::memset(tot, 0, sizeof(float) * a.hd);
        const int64_t tok = b->q_start[w0.seq] + w0.q0 + r / group;
        const int head = w0.head * group + r % group;
        finish_row(a.dtype, L, tot, a.hd, static_cast<char*>(a.out) + (tok * a.hq + head) * int64_t(a.hd) * es);
      }
    });
  }

  static void paged_attention(int32_t dtype, void* out, const void* q, const void* kc, const void* vc,
                              const AttnBatch* b, int32_t hq, int32_t hk, int32_t hd, float scale, int32_t window,
                              float softcap, int64_t q_stride) {
    attend(Args{dtype, out, q, kc, vc, nullptr, nullptr, b, hq, hk, hd, window, scale, softcap, q_stride, amx_active()});
  }

  static void paged_attention_i8(int32_t dtype, void* out, const void* q, const int8_t* kc, const int8_t* vc,
                                 const float* ks, const float* vs, const AttnBatch* b, int32_t hq, int32_t hk,
                                 int32_t hd, float scale, int32_t window, float softcap, int64_t q_stride) {
    attend(Args{dtype, out, q, kc, vc, ks, vs, b, hq, hk, hd, window, scale, softcap, q_stride, false});
  }
};

}  // namespace
}  // namespace armserve
