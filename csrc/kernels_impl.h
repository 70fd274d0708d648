// Kernels written once against a small set of per-ISA row primitives.
//
// Each ISA translation unit (kernels_<isa>.cpp) defines a struct `Isa` with:
//   dot(a, b, n)                fp32 dot product
//   axpy(y, a, x, n)            y += a * x
//   load(dtype, src, dst, n)    a row of f32/bf16/f16 -> fp32
//   store(dtype, src, dst, n)   fp32 -> f32/bf16/f16 (round to nearest even)
//   load_i8(src, scale, dst, n) an int8 row -> fp32, times its scale (8-bit KV cache)
//   dot_w(dtype, w, x, k)       f32/bf16/f16 weight row . activation row of the same type
// and includes this file, compiled with that ISA's flags. ScalarOps is the reference every ISA
// falls back to for what it does not specialise; all other loops are plain C++ that the compiler
// vectorises for the TU's flags.
//
// Rounding mirrors the PyTorch path (armserve/layers/*.py) step by step, so bf16/f16 results
// agree with it to the last bit wherever PyTorch rounds an intermediate.
//
// NOTE: everything here sits in an anonymous namespace and uses no std:: templates. Each ISA
// TU is compiled with different -m flags; an inline function or template instantiation with
// external linkage would be merged by the linker across TUs, and the scalar path could end up
// running an AVX-512 copy (SIGILL on CPUs without it).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace armserve {
namespace {

static inline float fmax2(float a, float b) { return a > b ? a : b; }
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline void zero(float* p, int64_t n) { std::memset(p, 0, n * sizeof(float)); }

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as PyTorch
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// GCC 12 (Debian 12's aarch64-linux-gnu-g++) has no _Float16 in C++ on aarch64; its __fp16
// converts with the same IEEE fcvt instructions (round to nearest even).
#if defined(__aarch64__)
typedef __fp16 half_t;
#else
typedef _Float16 half_t;
#endif

static inline float f16_to_f32(uint16_t h) {
  half_t v;
  std::memcpy(&v, &h, 2);
  return float(v);
}

static inline uint16_t f32_to_f16(float f) {
  half_t v = half_t(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

// exp(x) to about 1 ulp (Cephes' range reduction and polynomial), branch-free so loops of it
// vectorise for each TU's ISA; libm's expf is a scalar call. Inputs are clamped to the finite
// range, so exp_fast(-inf) is ~1e-38, not 0: callers that need exact zeros select them.
static inline float exp_fast(float x) {
  x = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
  // Round to nearest with the 1.5 * 2^23 trick: plain adds vectorise where floorf may not.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

static inline int dtype_size(int dtype) { return dtype == AS_F32 ? 4 : 2; }

struct ScalarOps {
  static float dot(const float* a, const float* b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float* y, float a, const float* x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
  }
  static void load(int dtype, const void* src, float* dst, int64_t n) {
    if (dtype == AS_F32) {
      std::memcpy(dst, src, n * 4);
    } else if (dtype == AS_BF16) {
      auto s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
    } else {
      auto s = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
    }
  }
  // One weight row dotted with one activation row, both of `dtype` (the skinny matmul's inner
  // product). Reference version; SIMD variants widen both in registers and fuse into the FMAs, and
  // call this for the tail they leave over.
  static float dot_w(int dtype, const void* w, const void* x, int64_t k) {
    float s = 0.f;
    if (dtype == AS_F32) {
      const float* wr = static_cast<const float*>(w);
      const float* xr = static_cast<const float*>(x);
      for (int64_t i = 0; i < k; ++i) s += wr[i] * xr[i];
      return s;
    }
    const uint16_t* wr = static_cast<const uint16_t*>(w);
    const uint16_t* xr = static_cast<const uint16_t*>(x);
    if (dtype == AS_BF16)
      for (int64_t i = 0; i < k; ++i) s += bf16_to_f32(wr[i]) * bf16_to_f32(xr[i]);
    else
      for (int64_t i = 0; i < k; ++i) s += f16_to_f32(wr[i]) * f16_to_f32(xr[i]);
    return s;
  }
  static void store(int dtype, const float* src, void* dst, int64_t n) {
    if (dtype == AS_F32) {
      std::memcpy(dst, src, n * 4);
    } else if (dtype == AS_BF16) {
      auto d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
    } else {
      auto d = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(src[i]);
    }
  }
  // int8 -> fp32 is exact, so the one rounding is the multiply: every ISA gets the same bits.
  static void load_i8(const int8_t* src, float scale, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]) * scale;
  }
};

// Symmetric int8 quantization of one (token, kv head) row; returns its scale. Division and
// round-half-even are IEEE-exact, so every ISA (and the PyTorch reference, quantize_kv_ref)
// produces the same int8 values. NOTE: __builtin_rintf, not std::nearbyint: the std:: overload is
// an inline function with external linkage (see the NOTE at the top).
static inline float quantize_row_i8(const float* x, int8_t* q, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = fmax2(amax, __builtin_fabsf(x[i]));
  const float scale = amax / 127.0f;
  if (scale == 0.f) {  // an all-zero row (or one that underflows): store zeros, not 0/0
    std::memset(q, 0, n);
    return 0.f;
  }
  for (int64_t i = 0; i < n; ++i) {
    float r = __builtin_rintf(x[i] / scale);
    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
    q[i] = int8_t(r);
  }
  return scale;
}

// Thread-local scratch rows, grown on demand and reused across calls.
struct Scratch {
  float* p[6] = {};
  int64_t n[6] = {};
  ~Scratch() {
    for (float* q : p) std::free(q);
  }
};

static inline float* scratch(int which, int64_t n) {
  thread_local Scratch s;
  if (s.n[which] < n) {
    std::free(s.p[which]);
    s.p[which] = static_cast<float*>(std::malloc(n * sizeof(float)));
    s.n[which] = n;
  }
  return s.p[which];
}

// A heap array freed at scope exit.
template <class T>
struct Buffer {
  T* p;
  explicit Buffer(int64_t n) : p(static_cast<T*>(std::malloc((n > 0 ? n : 1) * sizeof(T)))) {}
  ~Buffer() { std::free(p); }
  T& operator[](int64_t i) { return p[i]; }
};

static inline int num_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

template <class Isa>
struct Kernels {
  // Round a fp32 row through `dtype` and back: PyTorch rounds every intermediate tensor.
  static void round_trip(int dtype, float* x, int64_t n) {
    if (dtype == AS_F32) return;
    uint16_t* tmp = reinterpret_cast<uint16_t*>(scratch(5, n / 2 + 1));
    Isa::store(dtype, x, tmp, n);
    Isa::load(dtype, tmp, x, n);
  }

  static void rms_norm(int32_t dtype, void* out, const void* x, void* residual, const void* w, int64_t rows,
                       int64_t dim, float eps, float w_offset) {
    const int es = dtype_size(dtype);
#pragma omp parallel for schedule(static) if (rows * dim >= (1 << 15))
    for (int64_t r = 0; r < rows; ++r) {
      float* v = scratch(0, dim);
      float* wf = scratch(1, dim);
      const char* xr = static_cast<const char*>(x) + r * dim * es;
      Isa::load(dtype, xr, v, dim);
      if (residual) {
        char* rr = static_cast<char*>(residual) + r * dim * es;
        float* rf = scratch(2, dim);
        Isa::load(dtype, rr, rf, dim);
        for (int64_t i = 0; i < dim; ++i) v[i] += rf[i];
        round_trip(dtype, v, dim);
        Isa::store(dtype, v, rr, dim);
      }
      float ss = Isa::dot(v, v, dim);
      const float inv = 1.0f / std::sqrt(ss / float(dim) + eps);
      Isa::load(dtype, w, wf, dim);
      if (w_offset != 0.f) {
        for (int64_t i = 0; i < dim; ++i) v[i] = v[i] * inv * (wf[i] + w_offset);
      } else {
        for (int64_t i = 0; i < dim; ++i) v[i] *= inv;
        round_trip(dtype, v, dim);
        for (int64_t i = 0; i < dim; ++i) v[i] *= wf[i];
      }
      Isa::store(dtype, v, static_cast<char*>(out) + r * dim * es, dim);
    }
  }

  static void rotary(int32_t dtype, const int64_t* positions, void* q, void* k, const float* cos_sin,
                     int64_t tokens, int32_t nq, int32_t nk, int32_t hd, int32_t rd, int32_t neox, int64_t q_stride,
                     int64_t k_stride) {
    const int es = dtype_size(dtype);
    const int half = rd / 2;
#pragma omp parallel for schedule(static) if (tokens * (nq + nk) * hd >= (1 << 15))
    for (int64_t t = 0; t < tokens; ++t) {
      const float* cs = cos_sin + positions[t] * rd;
      const float* cosv = cs;
      const float* sinv = cs + half;
      float* row = scratch(0, rd);
      float* o = scratch(1, rd);
      for (int which = 0; which < 2; ++which) {
        const int nh = which == 0 ? nq : nk;
        char* base = static_cast<char*>(which == 0 ? q : k) + t * (which == 0 ? q_stride : k_stride) * es;
        for (int h = 0; h < nh; ++h) {
          char* head = base + int64_t(h) * hd * es;
          Isa::load(dtype, head, row, rd);
          if (neox) {
            for (int i = 0; i < half; ++i) {
              const float x1 = row[i], x2 = row[i + half];
              o[i] = x1 * cosv[i] - x2 * sinv[i];
              o[i + half] = x2 * cosv[i] + x1 * sinv[i];
            }
          } else {
            for (int i = 0; i < half; ++i) {
              const float x1 = row[2 * i], x2 = row[2 * i + 1];
              o[2 * i] = x1 * cosv[i] - x2 * sinv[i];
              o[2 * i + 1] = x2 * cosv[i] + x1 * sinv[i];
            }
          }
          Isa::store(dtype, o, head, rd);
        }
      }
    }
  }

  static void act_and_mul(int32_t dtype, int32_t act, void* out, const void* x, int64_t rows, int64_t d) {
    const int es = dtype_size(dtype);
#pragma omp parallel for schedule(static) if (rows * d >= (1 << 14))
    for (int64_t r = 0; r < rows; ++r) {
      float* g = scratch(0, d);
      float* u = scratch(1, d);
      const char* xr = static_cast<const char*>(x) + r * 2 * d * es;
      Isa::load(dtype, xr, g, d);
      Isa::load(dtype, xr + d * es, u, d);
      if (act == 0) {
        for (int64_t i = 0; i < d; ++i) g[i] = g[i] / (1.0f + exp_fast(-g[i]));
      } else if (act == 1) {
        for (int64_t i = 0; i < d; ++i) g[i] = 0.5f * g[i] * (1.0f + std::erf(g[i] * 0.70710678118654752f));
      } else {
        const float c = 0.79788456080286536f;  // sqrt(2 / pi)
        for (int64_t i = 0; i < d; ++i) {
          const float z = g[i];
          // tanh(y) = 1 - 2 / (1 + e^(2y))
          const float t = 1.0f - 2.0f / (1.0f + exp_fast(2.0f * c * (z + 0.044715f * z * z * z)));
          g[i] = 0.5f * z * (1.0f + t);
        }
      }
      round_trip(dtype, g, d);
      for (int64_t i = 0; i < d; ++i) g[i] *= u[i];
      Isa::store(dtype, g, static_cast<char*>(out) + r * d * es, d);
    }
  }

  static void reshape_and_cache(int32_t dtype, const void* k, const void* v, void* kc, void* vc,
                                const int64_t* slots, int64_t tokens, int64_t row, int64_t src_stride) {
    const int64_t bytes = row * dtype_size(dtype);
    const int64_t src_bytes = src_stride * dtype_size(dtype);
#pragma omp parallel for schedule(static) if (tokens * row >= (1 << 16))
    for (int64_t t = 0; t < tokens; ++t) {
      std::memcpy(static_cast<char*>(kc) + slots[t] * bytes, static_cast<const char*>(k) + t * src_bytes, bytes);
      std::memcpy(static_cast<char*>(vc) + slots[t] * bytes, static_cast<const char*>(v) + t * src_bytes, bytes);
    }
  }

  // int8 KV cache: quantize each (token, kv head) row of this step's k/v into its cache slot.
  static void reshape_and_cache_i8(int32_t dtype, const void* k, const void* v, int8_t* kc, int8_t* vc, float* ks,
                                   float* vs, const int64_t* slots, int64_t tokens, int32_t hk, int32_t hd,
                                   int64_t src_stride) {
    const int es = dtype_size(dtype);
#pragma omp parallel for schedule(static) if (tokens * hk * hd >= (1 << 14))
    for (int64_t t = 0; t < tokens; ++t) {
      float* row = scratch(0, hd);
      for (int which = 0; which < 2; ++which) {
        const char* src = static_cast<const char*>(which == 0 ? k : v) + t * src_stride * es;
        int8_t* cache = which == 0 ? kc : vc;
        float* scales = which == 0 ? ks : vs;
        for (int h = 0; h < hk; ++h) {
          Isa::load(dtype, src + int64_t(h) * hd * es, row, hd);
          const int64_t r = slots[t] * hk + h;
          scales[r] = quantize_row_i8(row, cache + r * hd, hd);
        }
      }
    }
  }

  // One K or V row of the cache (row = slot * hk + head) as fp32. `scales` non-null means an
  // int8 cache; the branch is per row of hd elements, so both caches share one attention loop.
  static void load_kv(int dtype, const void* cache, const float* scales, int64_t row, int32_t hd, float* dst) {
    if (scales)
      Isa::load_i8(static_cast<const int8_t*>(cache) + row * hd, scales[row], dst, hd);
    else
      Isa::load(dtype, static_cast<const char*>(cache) + row * hd * dtype_size(dtype), dst, hd);
  }

  // ---- paged attention -----------------------------------------------------------------------
  //
  // Work is split into items (sequence, tile of up to QT query positions, KV head, key
  // partition). Every item computes, for each of its query heads, the running max m, the sum
  // of exponentials l and the unnormalised output acc over its keys; a second pass merges the
  // partitions of a tile:  out = sum_p acc_p e^(m_p - M) / sum_p l_p e^(m_p - M).
  // Keys are split only when there are too few (sequence, tile, head) items to feed every
  // thread, i.e. for decode of a few long sequences (flash-decoding).
  struct Item {
    int32_t seq, q0, qn, k0, k1, head;
    int64_t partial;  // offset of this item's partials (floats)
  };

  static void paged_attention(int32_t dtype, void* out, const void* q, const void* kc, const void* vc,
                              const AttnBatch* b, int32_t hq, int32_t hk, int32_t hd, float scale,
                              int32_t window, float softcap, int64_t q_stride) {
    attend(dtype, out, q, kc, vc, nullptr, nullptr, b, hq, hk, hd, scale, window, softcap, q_stride);
  }

  static void paged_attention_i8(int32_t dtype, void* out, const void* q, const int8_t* kc, const int8_t* vc,
                                 const float* ks, const float* vs, const AttnBatch* b, int32_t hq, int32_t hk,
                                 int32_t hd, float scale, int32_t window, float softcap, int64_t q_stride) {
    attend(dtype, out, q, kc, vc, ks, vs, b, hq, hk, hd, scale, window, softcap, q_stride);
  }

  // q and out in `dtype`; caches in `dtype`, or int8 with per-(slot, head) scales when ks/vs are set.
  static void attend(int32_t dtype, void* out, const void* q, const void* kc, const void* vc, const float* ks,
                     const float* vs, const AttnBatch* b, int32_t hq, int32_t hk, int32_t hd, float scale,
                     int32_t window, float softcap, int64_t q_stride) {
    const int group = hq / hk;
    const int QT = 16;
    const int es = dtype_size(dtype);
    const int nthreads = num_threads();

    int64_t tiles = 0;
    for (int s = 0; s < b->num_seqs; ++s) tiles += (b->q_len[s] + QT - 1) / QT;
    const bool split = tiles * hk < 2LL * nthreads;
    const int P = 256;

    // Upper bound on items: every tile may need ceil(ctx / P) partitions when split.
    int64_t max_items = 0;
    for (int s = 0; s < b->num_seqs; ++s)
      max_items += int64_t((b->q_len[s] + QT - 1) / QT) * hk * (split ? (b->context_len[s] + P - 1) / P + 1 : 1);
    Buffer<Item> items(max_items);
    int64_t n_items = 0;
    int64_t partial_floats = 0;
    for (int s = 0; s < b->num_seqs; ++s) {
      const int ql = b->q_len[s], ctx = b->context_len[s];
      for (int q0 = 0; q0 < ql; q0 += QT) {
        const int qn = imin(QT, ql - q0);
        const int p_first = ctx - ql + q0, p_last = p_first + qn - 1;
        const int lo = window > 0 ? imax(0, p_first - window + 1) : 0;
        const int hi = p_last + 1;
        const int step = split ? P : imax(1, hi - lo);
        for (int h = 0; h < hk; ++h) {
          for (int k0 = lo; k0 < hi; k0 += step) {
            items[n_items++] = Item{s, q0, qn, k0, imin(hi, k0 + step), h, partial_floats};
            partial_floats += int64_t(qn) * group * (hd + 2);
          }
        }
      }
    }
    Buffer<float> partials(partial_floats);

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int rows = w.qn * group;
      const int nk = w.k1 - w.k0;
      const int ql = b->q_len[w.seq], ctx = b->context_len[w.seq];
      const int32_t* bt = b->block_tables + int64_t(w.seq) * b->max_blocks;
      float* qf = scratch(0, int64_t(rows) * hd);
      float* sc = scratch(1, int64_t(rows) * nk);
      float* kv = scratch(2, hd);
      float* out_p = partials.p + w.partial;  // [rows][hd + 2]: acc..., m, l
      for (int i = 0; i < w.qn; ++i) {
        const int64_t tok = b->q_start[w.seq] + w.q0 + i;
        for (int g = 0; g < group; ++g) {
          const int head = w.head * group + g;
          float* dst = qf + int64_t(i * group + g) * hd;
          Isa::load(dtype, static_cast<const char*>(q) + (tok * q_stride + int64_t(head) * hd) * es, dst, hd);
        }
      }
      // scores
      for (int j = w.k0; j < w.k1; ++j) {
        const int64_t slot = int64_t(bt[j / b->block_size]) * b->block_size + j % b->block_size;
        load_kv(dtype, kc, ks, slot * hk + w.head, hd, kv);
        for (int i = 0; i < w.qn; ++i) {
          const int pos = ctx - ql + w.q0 + i;
          const bool visible = j <= pos && (window <= 0 || pos - j < window);
          for (int g = 0; g < group; ++g) {
            const int r = i * group + g;
            float s = -INFINITY;
            if (visible) {
              s = Isa::dot(qf + int64_t(r) * hd, kv, hd) * scale;
              if (softcap > 0.f) s = std::tanh(s / softcap) * softcap;
            }
            sc[int64_t(r) * nk + (j - w.k0)] = s;
          }
        }
      }
      // softmax pieces
      for (int r = 0; r < rows; ++r) {
        float* srow = sc + int64_t(r) * nk;
        // Four running maxima (the max is the same in any order): one chain of compares is
        // latency-bound, and a float max reduction does not vectorise without -ffast-math.
        float m4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        int j = 0;
        for (; j + 4 <= nk; j += 4)
          for (int u = 0; u < 4; ++u) m4[u] = fmax2(m4[u], srow[j + u]);
        for (; j < nk; ++j) m4[0] = fmax2(m4[0], srow[j]);
        const float m = fmax2(fmax2(m4[0], m4[1]), fmax2(m4[2], m4[3]));
        float l = 0.f;
        if (m != -INFINITY) {
          // The exponentials in a loop of their own, which vectorises; summed after, in order.
          for (int jj = 0; jj < nk; ++jj) srow[jj] = srow[jj] == -INFINITY ? 0.f : exp_fast(srow[jj] - m);
          for (int jj = 0; jj < nk; ++jj) l += srow[jj];
        } else {
          for (int j = 0; j < nk; ++j) srow[j] = 0.f;
        }
        float* o = out_p + int64_t(r) * (hd + 2);
        zero(o, hd);
        o[hd] = m;
        o[hd + 1] = l;
      }
      // weighted values
      for (int j = w.k0; j < w.k1; ++j) {
        const int64_t slot = int64_t(bt[j / b->block_size]) * b->block_size + j % b->block_size;
        bool any = false;
        for (int r = 0; r < rows && !any; ++r) any = sc[int64_t(r) * nk + (j - w.k0)] != 0.f;
        if (!any) continue;
        load_kv(dtype, vc, vs, slot * hk + w.head, hd, kv);
        for (int r = 0; r < rows; ++r) {
          const float p = sc[int64_t(r) * nk + (j - w.k0)];
          if (p != 0.f) Isa::axpy(out_p + int64_t(r) * (hd + 2), p, kv, hd);
        }
      }
    }

    // Merge partitions: items of one (seq, tile, head) are adjacent in `items`.
    Buffer<int64_t> starts(n_items + 1);
    int64_t n_groups = 0;
    for (int64_t i = 0; i < n_items; ++i) {
      if (i == 0 || items[i].seq != items[i - 1].seq || items[i].q0 != items[i - 1].q0 ||
          items[i].head != items[i - 1].head)
        starts[n_groups++] = i;
    }
    starts[n_groups] = n_items;
#pragma omp parallel for schedule(static)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
      const int64_t a = starts[gi], z = starts[gi + 1];
      const Item& w0 = items[a];
      float* acc = scratch(3, hd);
      for (int i = 0; i < w0.qn; ++i) {
        for (int g = 0; g < group; ++g) {
          const int r = i * group + g;
          float M = -INFINITY;
          for (int64_t p = a; p < z; ++p) M = fmax2(M, partials[items[p].partial + int64_t(r) * (hd + 2) + hd]);
          zero(acc, hd);
          float L = 0.f;
          if (M != -INFINITY) {
            for (int64_t p = a; p < z; ++p) {
              const float* o = partials.p + items[p].partial + int64_t(r) * (hd + 2);
              if (o[hd] == -INFINITY) continue;
              const float f = std::exp(o[hd] - M);
              L += o[hd + 1] * f;
              Isa::axpy(acc, f, o, hd);
            }
          }
          const float invL = L > 0.f ? 1.0f / L : 0.f;
          for (int d = 0; d < hd; ++d) acc[d] *= invL;
          const int64_t tok = b->q_start[w0.seq] + w0.q0 + i;
          const int head = w0.head * group + g;
          Isa::store(dtype, acc, static_cast<char*>(out) + (tok * hq + head) * int64_t(hd) * es, hd);
        }
      }
    }
  }

  // ---- skinny matmul (decode) ----------------------------------------------------------------
  //
  // See kernels.h. Each thread takes a contiguous range of weight rows
  // and walks it one row at a time, so every core reads its weights as one sequential stream: the
  // hardware prefetcher's best case. (Interleaving 4 rows, the earlier design, streamed about half
  // the read bandwidth on Zen 4.) x stays in its 16-bit type, so x plus the row being streamed fit
  // in a 32 KiB L1 even for k = 5632; an fp32 copy of x did not, and was evicted every row.
  static void gemv(int32_t dtype, void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k) {
    constexpr int kRows = 16, kTokens = 8;
    const int es = dtype_size(dtype);
    const int64_t blocks = (n + kRows - 1) / kRows;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t r0 = b * kRows;
      const int rows = int(n - r0 < kRows ? n - r0 : kRows);
      float res[kTokens][kRows];
      for (int64_t t0 = 0; t0 < m; t0 += kTokens) {
        const int tokens = int(m - t0 < kTokens ? m - t0 : kTokens);
        // Row outer, token inner: with a few tokens the row is re-read from L1, not memory.
        for (int r = 0; r < rows; ++r) {
          const char* wr = static_cast<const char*>(w) + (r0 + r) * k * es;
          for (int t = 0; t < tokens; ++t)
            res[t][r] = Isa::dot_w(dtype, wr, static_cast<const char*>(x) + (t0 + t) * k * es, k);
        }
        for (int t = 0; t < tokens; ++t)
          Isa::store(dtype, res[t], static_cast<char*>(out) + ((t0 + t) * n + r0) * es, rows);
      }
    }
  }

  static const KernelTable* table(const char* name) {
    static const KernelTable t = {name, rms_norm, rotary, act_and_mul, reshape_and_cache, paged_attention,
                                  reshape_and_cache_i8, paged_attention_i8, gemv};
    return &t;
  }
};

}  // namespace
}  // namespace armserve
