// Kernels written once against a small set of per-ISA row primitives.
//
// Each ISA translation unit (kernels_<isa>.cpp) defines a struct `Isa` with:
//   dot(a, b, n)                fp32 dot product
//   axpy(y, a, x, n)            y += a * x
//   load(dtype, src, dst, n)    a row of f32/bf16/f16 -> fp32
//   store(dtype, src, dst, n)   fp32 -> f32/bf16/f16 (round to nearest even)
//   load_i8(src, scale, dst, n) an int8 row -> fp32, times its scale (8-bit KV cache)
//   dot_w(dtype, w, x, k)       f32/bf16/f16 weight row . activation row of the same type
//   dots(rows, ld, v, k, out, n) out[c] = rows[c * ld .. + k) . v for n short fp32 rows (LoRA expand)
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

#include "float_conv.h"
#include "kernels.h"
#include "parallel.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace armserve {
namespace {

static inline float fmax2(float a, float b) { return a > b ? a : b; }
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline void zero(float* p, int64_t n) { std::memset(p, 0, n * sizeof(float)); }

using namespace armserve_conv;  // bf16_to_f32, f32_to_bf16, f16_to_f32, f32_to_f16, half_t

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
  // n dot products of short rows (k = a LoRA rank, 8..64) with one vector. Reference version; SIMD
  // variants accumulate a few rows side by side and reduce them together, where a dot per row
  // would pay a whole horizontal sum for a few FMAs.
  static void dots(const float* rows, int64_t ld, const float* v, int64_t k, float* out, int64_t n) {
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.f;
      for (int64_t i = 0; i < k; ++i) s += rows[c * ld + i] * v[i];
      out[c] = s;
    }
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
  float* p[7] = {};
  int64_t n[7] = {};
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

}  // namespace
}  // namespace armserve

#include "attention_impl.h"
#include "encoder_attention_impl.h"
#include "lora_impl.h"

namespace armserve {
namespace {

// out [d] = silu(x[:d]) * x[d:2d] for one row of `dtype`, d a multiple of 16: the one choice of row
// function that act_and_mul and the MoE's expert pass (moe_impl.h) both make, so they round alike.
static inline void silu_and_mul(int32_t dtype, const void* x, void* out, int64_t d) {
#ifdef ARMSERVE_ROWS_BF16_CVT
  if (dtype == AS_BF16 && armserve_bf16_dot && d % 32 == 0) return silu_and_mul_row_bf16_cvt(x, out, d);
#endif
  if (dtype == AS_BF16)
    silu_and_mul_row<CT_BF16>(x, out, d);
  else if (dtype == AS_F16)
    silu_and_mul_row<CT_F16>(x, out, d);
  else
    silu_and_mul_row<CT_F32>(x, out, d);
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
                       int64_t dim, float eps, float w_offset, int32_t heads, int64_t row_stride) {
    const int es = dtype_size(dtype);
    // element offset of vector r in x and out (in place is fine: each element is read before written)
    auto at = [&](int64_t r) { return heads == 1 ? r * row_stride : r / heads * row_stride + r % heads * dim; };
    if (dim % 16 == 0) {  // every model's hidden size: one pass of 16-lane vectors each way per row
      armserve_par::for_static(rows, rows * dim >= (1 << 15), [&](int64_t r) {
        const char* xr = static_cast<const char*>(x) + at(r) * es;
        char* rr = residual ? static_cast<char*>(residual) + r * dim * es : nullptr;
        char* o = static_cast<char*>(out) + at(r) * es;
#ifdef ARMSERVE_ROWS_BF16_CVT
        if (dtype == AS_BF16 && armserve_bf16_dot && dim % 32 == 0 && w_offset == 0.f)
          rms_norm_row_bf16_cvt(xr, rr, w, o, dim, eps);
        else
#endif
        if (dtype == AS_BF16)
          rms_norm_row<CT_BF16>(xr, rr, w, o, dim, eps, w_offset);
        else if (dtype == AS_F16)
          rms_norm_row<CT_F16>(xr, rr, w, o, dim, eps, w_offset);
        else
          rms_norm_row<CT_F32>(xr, rr, w, o, dim, eps, w_offset);
      });
      return;
    }
    armserve_par::for_static(rows, rows * dim >= (1 << 15), [&](int64_t r) {
      float* v = scratch(0, dim);
      float* wf = scratch(1, dim);
      const char* xr = static_cast<const char*>(x) + at(r) * es;
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
      Isa::store(dtype, v, static_cast<char*>(out) + at(r) * es, dim);
    });
  }

  static void rotary(int32_t dtype, const int64_t* positions, void* q, void* k, const float* cos_sin,
                     int64_t tokens, int32_t nq, int32_t nk, int32_t hd, int32_t rd, int32_t neox, int64_t q_stride,
                     int64_t k_stride) {
    const int es = dtype_size(dtype);
    const int half = rd / 2;
    armserve_par::for_static(tokens, tokens * (nq + nk) * hd >= (1 << 15), [&](int64_t t) {
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
    });
  }

  static void act_and_mul(int32_t dtype, int32_t act, void* out, const void* x, int64_t rows, int64_t d) {
    const int es = dtype_size(dtype);
    if (act == 0 && d % 16 == 0) {  // SiLU, the common case: one pass of 16-lane vectors per row
      armserve_par::for_static(rows, rows * d >= (1 << 14), [&](int64_t r) {
        silu_and_mul(dtype, static_cast<const char*>(x) + r * 2 * d * es, static_cast<char*>(out) + r * d * es, d);
      });
      return;
    }
    armserve_par::for_static(rows, rows * d >= (1 << 14), [&](int64_t r) {
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
    });
  }

  // ---- encoder elementwise ops (BERT-style blocks) ----------------------------------------------

  // x[r] = gelu(x[r] + bias) in place, rows `ld` elements apart (api.h). x + bias is rounded to
  // the element type first, as PyTorch's separate add would.
  static void bias_gelu(int32_t dtype, void* x, const void* bias, int64_t rows, int64_t n, int64_t ld,
                        int32_t tanh_approx) {
    const int es = dtype_size(dtype);
    Buffer<float> b(n);
    Isa::load(dtype, bias, b.p, n);
    armserve_par::for_static(rows, rows * n >= (1 << 14), [&](int64_t r) {
      float* g = scratch(0, n);
      char* xr = static_cast<char*>(x) + r * ld * es;
      Isa::load(dtype, xr, g, n);
      for (int64_t i = 0; i < n; ++i) g[i] += b[i];
      round_trip(dtype, g, n);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) vstore(g + i, tanh_approx ? gelu_tanh(vload(g + i)) : gelu_erf(vload(g + i)));
      if (i < n) {  // the tail through one padded vector
        float t[16] = {};
        std::memcpy(t, g + i, sizeof(float) * (n - i));
        vstore(t, tanh_approx ? gelu_tanh(vload(t)) : gelu_erf(vload(t)));
        std::memcpy(g + i, t, sizeof(float) * (n - i));
      }
      Isa::store(dtype, g, xr, n);
    });
  }

  // out[r] = LayerNorm(x[r] (+ x_bias) (+ residual[r])) * w (+ b), each sum rounded to the element
  // type as PyTorch's separate adds would; statistics in float32 (api.h).
  static void layer_norm(int32_t dtype, void* out, const void* x, const void* x_bias, const void* residual,
                         const void* w, const void* b, int64_t rows, int64_t n, float eps) {
    const int es = dtype_size(dtype);
    Buffer<float> params(3 * n);
    float *xb = params.p, *wf = params.p + n, *bf = params.p + 2 * n;
    if (x_bias) Isa::load(dtype, x_bias, xb, n);
    Isa::load(dtype, w, wf, n);
    if (b) Isa::load(dtype, b, bf, n); else std::memset(bf, 0, sizeof(float) * n);
    armserve_par::for_static(rows, rows * n >= (1 << 14), [&](int64_t r) {
      float* g = scratch(0, n);
      float* h = scratch(1, n);
      Isa::load(dtype, static_cast<const char*>(x) + r * n * es, g, n);
      if (x_bias) {
        for (int64_t i = 0; i < n; ++i) g[i] += xb[i];
        round_trip(dtype, g, n);
      }
      if (residual) {
        Isa::load(dtype, static_cast<const char*>(residual) + r * n * es, h, n);
        for (int64_t i = 0; i < n; ++i) g[i] += h[i];
        round_trip(dtype, g, n);
      }
      int64_t i = 0;
      vf16 sv = vsplat(0.f);
      for (; i + 16 <= n; i += 16) sv += vload(g + i);
      float sum = hsum(sv);
      for (; i < n; ++i) sum += g[i];
      const float mean = sum / float(n);
      vf16 qv = vsplat(0.f);
      for (i = 0; i + 16 <= n; i += 16) {
        const vf16 c = vload(g + i) - mean;
        qv = vfma(c, c, qv);
      }
      float sq = hsum(qv);
      for (; i < n; ++i) sq += (g[i] - mean) * (g[i] - mean);
      const float rstd = 1.0f / std::sqrt(sq / float(n) + eps);
      for (i = 0; i + 16 <= n; i += 16)
        vstore(g + i, vfma((vload(g + i) - mean) * rstd, vload(wf + i), vload(bf + i)));
      for (; i < n; ++i) g[i] = (g[i] - mean) * rstd * wf[i] + bf[i];
      Isa::store(dtype, g, static_cast<char*>(out) + r * n * es, n);
    });
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
    armserve_par::for_static(blocks, true, [&](int64_t b) {
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
    });
  }

  static const KernelTable* table(const char* name) {
    using A = Attention<Isa>;
    using L = Lora<Isa>;
    static const KernelTable t = {name, rms_norm, rotary, act_and_mul, A::reshape_and_cache, A::paged_attention,
                                  A::reshape_and_cache_i8, A::paged_attention_i8, gemv, L::shrink, L::expand,
                                  EncoderAttention<Isa>::run, bias_gelu, layer_norm};
    return &t;
  }
};

}  // namespace
}  // namespace armserve
