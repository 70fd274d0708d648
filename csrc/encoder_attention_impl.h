// Bidirectional attention of encoder steps (api.h: armserve_encoder_attention), flash style
// (and the vector GELU of the encoder blocks' bias_gelu, kernels_impl.h):
// every row of a sequence attends to all rows of its sequence, with no mask, and no
// [length x length] matrix is ever formed. Written once over the 16-lane vectors of
// attention_impl.h, included by every kernels_<isa>.cpp.
//
// Two passes. The first packs each (sequence, head)'s queries, keys and values out of the fused
// qkv rows into float32 (adding the projection's bias, if any), keys as 16-key tiles transposed
// like the paged cache's (lane = key), queries and values as rows; all padded to whole tiles:
//
//     Q  [tiles * 16][head_dim]      K  [tiles][head_dim][16]      V  [tiles * 16][head_dim]
//
// The second splits the work into items (sequence, head, block of QB query rows) and walks the
// keys in blocks of KB, small enough that a block's K and V stay in L1 while every row block of
// the item goes over them. A row block's scores are NR rows x 16 keys per micro-kernel step (a
// query element broadcast, a K vector loaded, NR x TT FMAs); the online softmax keeps each row's
// running max and sum, and rescales the row's output accumulator as the value step reloads it;
// the value step is PR rows x CC 16-column chunks (a probability broadcast, a V vector loaded).
// The paged prefill kernel could run this too (a non-causal bound), but its blocking is built for
// few query rows against many scattered cache blocks: on AVX2 it reached 30-35 GFLOP/s here against
// PyTorch's 45 for BERT's shapes.
//
// A row's result depends only on its own sequence (fixed blocks, fixed order): batch and thread
// count change no bits. Inputs float32 / bfloat16 / float16, computed in float32, the output rounded
// once to the input type.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace armserve {
namespace {

// GELU, 0.5 x (1 + erf(x / sqrt 2)): 1 + erf(z) is 2 - erfc(|z|) for z >= 0 and erfc(|z|) below,
// erfc by Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7), so the negative side keeps its
// small values without cancellation.
ARMSERVE_VI vf16 gelu_erf(vf16 x) {
  const vf16 z = x * 0.70710678118654752f;
  const vf16 az = vsel(z < 0.f, -z, z);
  const vf16 t = vrecip(vfma(az, vsplat(0.3275911f), vsplat(1.0f)));
  vf16 p = vfma(vsplat(1.061405429f), t, vsplat(-1.453152027f));
  p = vfma(p, t, vsplat(1.421413741f));
  p = vfma(p, t, vsplat(-0.284496736f));
  p = vfma(p, t, vsplat(0.254829592f));
  const vf16 erfc = p * t * vexp(-(az * az));
  return x * 0.5f * vsel(z < 0.f, erfc, vsplat(2.0f) - erfc);
}

// GELU's tanh form, 0.5 x (1 + tanh(y)) with y = sqrt(2 / pi) (x + 0.044715 x^3), written as
// x / (1 + e^(-2y)), the exponent capped at 80 (vexp's largest inputs give inf, and the reciprocal's
// Newton step turns that into NaN; at 80 the quotient is ~1e-35 x already).
ARMSERVE_VI vf16 gelu_tanh(vf16 x) {
  const vf16 y = vfma(x * x * x, vsplat(0.044715f), x) * 0.79788456080286536f;
  const vf16 a = y * -2.0f;
  return x * vrecip(vexp(vsel(a > 80.f, vsplat(80.f), a)) + 1.0f);
}

template <class Isa>
struct EncoderAttention {
#if defined(__AVX512F__)
  static constexpr int NR = 6, TT = 2, PR = 6;  // 12 zmm accumulators either step
#elif defined(ARMSERVE_WIDE)
  static constexpr int NR = 6, TT = 1, PR = 3;  // 12 ymm (AVX2) / 24 q (NEON) accumulators
#else
  static constexpr int NR = 4, TT = 1, PR = 2;
#endif
  static constexpr int KT = 16;  // keys per tile
  static constexpr int QB = 48;  // query rows per item, a multiple of NR
  static_assert(NR <= 6 && PR <= 6, "the row switches below stop at 6");

  // Keys per block: K and V blocks of 8 KiB each (with the item's queries and outputs, 48 rows
  // of head_dim 32, about 30 KiB: one L1).
  static int key_block(int hd) { return imax(KT, imin(256, 8192 / hd / KT * KT)); }

  // s[r][t * 16 + j] = q[r] . key j of tile t, for R rows (q rows hd apart, s rows ls apart) and
  // T tiles (kt: the first, hd * 16 floats each).
  template <int R, int T>
  static void scores_tiles(const float* q, const float* kt, int hd, float* s, int ls) {
    vf16 a[R][T];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < T; ++u) a[r][u] = vsplat(0.f);  // (not vf16{}: GCC zeroes a Wide array through memory, rep stos)
    for (int d = 0; d < hd; ++d) {
      vf16 k[T];
      for (int u = 0; u < T; ++u) k[u] = vload(kt + (int64_t(u) * hd + d) * KT);
      for (int r = 0; r < R; ++r) {
        const vf16 qv = vsplat(q[r * hd + d]);
        for (int u = 0; u < T; ++u) a[r][u] = vfma(qv, k[u], a[r][u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < T; ++u) vstore(s + r * ls + u * KT, a[r][u]);
  }

  template <int R>
  static void scores(const float* q, const float* kt, int nt, int hd, float* s, int ls) {
    int t = 0;
    for (; t + TT <= nt; t += TT) scores_tiles<R, TT>(q, kt + int64_t(t) * hd * KT, hd, s + t * KT, ls);
    for (; t < nt; ++t) scores_tiles<R, 1>(q, kt + int64_t(t) * hd * KT, hd, s + t * KT, ls);
  }

  static void scores_n(int nr, const float* q, const float* kt, int nt, int hd, float* s, int ls) {
    switch (nr) {
      case 1: return scores<1>(q, kt, nt, hd, s, ls);
      case 2: return scores<2>(q, kt, nt, hd, s, ls);
      case 3: return scores<3>(q, kt, nt, hd, s, ls);
      case 4: return scores<4>(q, kt, nt, hd, s, ls);
      case 5: return scores<5>(q, kt, nt, hd, s, ls);
      default: return scores<NR>(q, kt, nt, hd, s, ls);
    }
  }

  // acc[r][c0, c0 + 16 C) = acc[r][...] * alpha[r] + sum over nk keys of p[r][j] v[j][...], for R
  // rows (p rows ls apart, acc and v rows hd apart).
  template <int R, int C>
  static void values(const float* p, int ls, const float* v, int nk, int hd, int c0, const float* alpha, float* acc) {
    vf16 a[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) a[r][c] = vload(acc + r * hd + c0 + 16 * c) * vsplat(alpha[r]);
    for (int j = 0; j < nk; ++j) {
      vf16 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = vload(v + int64_t(j) * hd + c0 + 16 * c);
      for (int r = 0; r < R; ++r) {
        const vf16 pv = vsplat(p[r * ls + j]);
        for (int c = 0; c < C; ++c) a[r][c] = vfma(pv, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) vstore(acc + r * hd + c0 + 16 * c, a[r][c]);
  }

  // Every 16-column chunk of rows [0, nr) (nr <= NR), C chunks at a time.
  template <int C>
  static void values_rows(int nr, const float* p, int ls, const float* v, int nk, int hd, const float* alpha,
                          float* acc) {
    constexpr int PRC = C == 2 ? PR : 2 * PR;  // rows per call: the same accumulator count either way
    for (int r0 = 0; r0 < nr; r0 += PRC) {
      const int n = imin(PRC, nr - r0);
      for (int c0 = 0; c0 < hd; c0 += 16 * C) {
        const float* pr = p + r0 * ls;
        const float* ar = alpha + r0;
        float* o = acc + int64_t(r0) * hd;
        switch (n) {
          case 1: values<1, C>(pr, ls, v, nk, hd, c0, ar, o); break;
          case 2: values<2, C>(pr, ls, v, nk, hd, c0, ar, o); break;
          case 3: values<3, C>(pr, ls, v, nk, hd, c0, ar, o); break;
          case 4: values<4, C>(pr, ls, v, nk, hd, c0, ar, o); break;
          case 5: values<5, C>(pr, ls, v, nk, hd, c0, ar, o); break;
          default: values<6, C>(pr, ls, v, nk, hd, c0, ar, o); break;
        }
      }
    }
  }

  // exp(x) for x <= 0 (a score less the row's max, scaled), vexp's polynomial with a cheaper
  // front: no upper clamp, one-step range reduction (n <= 126, so the low part of ln 2 that
  // vexp adds would change the result by at most ~1e-6 relative, on probabilities below e^-40).
  static inline vf16 exp_nonpos(vf16 x) {
    const vf16 lo = vsplat(-87.33654f);
    x = vsel(x < lo, lo, x);
    const vf16 n = vfma(x, vsplat(1.44269504088896341f), vsplat(12582912.0f)) - 12582912.0f;
    const vf16 r = vfma(n, vsplat(-0.693147180559945309f), x);
    vf16 p = vfma(vsplat(1.9875691500e-4f), r, vsplat(1.3981999507e-3f));
    p = vfma(p, r, vsplat(8.3334519073e-3f));
    p = vfma(p, r, vsplat(4.1665795894e-2f));
    p = vfma(p, r, vsplat(1.6666665459e-1f));
    p = vfma(p, r, vsplat(5.0000001201e-1f));
    p = vfma(p * r, r, r + 1.0f);
    return p * vbits<vf16>((vcvt_i(n) + 127) << 23);
  }

  // One row's scores over a key block (nt tiles, the first `valid` keys real) into probabilities
  // against the row's new running max; returns the factor its earlier output and sum take.
  static float softmax_block(float* s, int nt, int valid, float scale, float& m, float& l) {
    const int last = nt - 1;
    if (valid < nt * KT) {  // keys past the sequence: -inf, then exactly 0
      const vf16 sv = vload(s + last * KT);
      vstore(s + last * KT, vsel(viota(last * KT) < valid, sv, vsplat(-INFINITY)));
    }
    vf16 mv = vload(s);
    for (int t = 1; t < nt; ++t) {
      const vf16 sv = vload(s + t * KT);
      mv = vsel(mv > sv, mv, sv);
    }
    const float mn = fmax2(m, hmax(mv));
    const float alpha = m == -INFINITY ? 0.f : m == mn ? 1.f : exp_fast((m - mn) * scale);
    const vf16 xs = vsplat(scale), off = vsplat(-mn * scale);
    vf16 lv = vsplat(0.f);
    for (int t = 0; t < nt; ++t) {
      const vf16 sv = vload(s + t * KT);
      vf16 pv = exp_nonpos(vfma(sv, xs, off));
      if (t == last && valid < nt * KT) pv = vsel(viota(last * KT) < valid, pv, vsplat(0.f));
      lv += pv;
      vstore(s + t * KT, pv);
    }
    m = mn;
    l = l * alpha + hsum(lv);
    return alpha;
  }

  struct Item {
    int32_t seq, head, q0, qn;
  };

  // A q, k or v row of the step as float32, plus its projection's bias (b: null, or hd floats),
  // the sum rounded to the element type as PyTorch's separate bias add would.
  static void load_row(int32_t dtype, const char* src, const float* b, float* dst, int hd) {
    Isa::load(dtype, src, dst, hd);
    if (!b) return;
    for (int d = 0; d < hd; ++d) dst[d] += b[d];
    if (dtype != AS_F32) {
      uint16_t t[512];  // hd <= 512 (checked in Python)
      Isa::store(dtype, dst, t, hd);
      Isa::load(dtype, t, dst, hd);
    }
  }

  // qs: the (sequence, head)'s packed queries, kt / vr its packed keys and values.
  static void run_item(int32_t dtype, void* out, const Item& w, int64_t row0, int n, int heads, int hd, float scale,
                       const float* qs, const float* kt, const float* vr) {
    const int es = dtype_size(dtype);
    const int kb = key_block(hd), ls = kb;
    const int nt = (n + KT - 1) / KT;
    const float* qf = qs + int64_t(w.q0) * hd;
    float* acc = scratch(1, int64_t(QB) * hd);
    float* st = scratch(2, int64_t(NR) * ls + 3 * QB);
    float *s = st, *m = st + NR * ls, *l = m + QB, *alpha = l + QB;
    std::memset(acc, 0, sizeof(float) * w.qn * hd);
    for (int r = 0; r < w.qn; ++r) m[r] = -INFINITY, l[r] = 0.f;
    for (int t0 = 0; t0 < nt; t0 += kb / KT) {
      const int ntb = imin(kb / KT, nt - t0);
      const int valid = imin(n - t0 * KT, ntb * KT);
      const float* kb_t = kt + int64_t(t0) * KT * hd;
      const float* kb_v = vr + int64_t(t0) * KT * hd;
      for (int r0 = 0; r0 < w.qn; r0 += NR) {
        const int nr = imin(NR, w.qn - r0);
        scores_n(nr, qf + int64_t(r0) * hd, kb_t, ntb, hd, s, ls);
        for (int r = 0; r < nr; ++r) alpha[r] = softmax_block(s + r * ls, ntb, valid, scale, m[r0 + r], l[r0 + r]);
        if (hd % 32 == 0)
          values_rows<2>(nr, s, ls, kb_v, valid, hd, alpha, acc + int64_t(r0) * hd);
        else
          values_rows<1>(nr, s, ls, kb_v, valid, hd, alpha, acc + int64_t(r0) * hd);
      }
    }
    for (int i = 0; i < w.qn; ++i) {
      float* o = acc + int64_t(i) * hd;
      const float inv = 1.0f / l[i];
      for (int d = 0; d < hd; ++d) o[d] *= inv;
      Isa::store(dtype, o, static_cast<char*>(out) + ((row0 + w.q0 + i) * heads + w.head) * int64_t(hd) * es, hd);
    }
  }

  static void run(int32_t dtype, void* out, const void* qkv, const void* qkv_bias, const int32_t* seq_lens,
                  int32_t num_seqs, int32_t heads, int32_t hd, float scale, int64_t qkv_stride) {
    const int es = dtype_size(dtype);
    const int64_t width = int64_t(heads) * hd;
    Buffer<float> bias(qkv_bias ? 3 * width : 0);  // q, k, v biases as float32
    if (qkv_bias) Isa::load(dtype, qkv_bias, bias.p, 3 * width);
    const float* qb = qkv_bias ? bias.p : nullptr;
    Buffer<int64_t> row0(num_seqs), packed(num_seqs);  // first row; first float of its packed K/V
    int64_t rows = 0, floats = 0, n_items = 0;
    for (int s = 0; s < num_seqs; ++s) {
      row0[s] = rows, packed[s] = floats;
      rows += seq_lens[s];
      floats += int64_t(heads) * 3 * ((seq_lens[s] + KT - 1) / KT * KT) * hd;
      n_items += int64_t(heads) * ((seq_lens[s] + QB - 1) / QB);
    }
    armserve_par::SharedFloats kv(floats);
    // (sequence, head) -> where its packed queries, K tiles and V rows are
    auto at = [&](int s, int h, const float** q, const float** k, const float** v) {
      const int64_t padded = (seq_lens[s] + KT - 1) / KT * KT;
      *q = kv.p + packed[s] + int64_t(h) * 3 * padded * hd;
      *k = *q + padded * hd;
      *v = *k + padded * hd;
    };
    // Tile by tile (16 rows of qkv, every head): the rows are read once, in order, and each head's
    // queries, K tile and V rows are written whole (read head by head where they lie, each row
    // would come from memory once per head: a tenth of the kernel's time at BERT's shapes).
    Buffer<int64_t> tile0(num_seqs + 1);  // first tile of each sequence, over the step
    tile0[0] = 0;
    for (int s = 0; s < num_seqs; ++s) tile0[s + 1] = tile0[s] + (seq_lens[s] + KT - 1) / KT;
    armserve_par::for_static(tile0[num_seqs], rows * heads * hd >= (1 << 14), [&](int64_t i) {
      int s = 0;
      while (tile0[s + 1] <= i) ++s;
      const int n = seq_lens[s], j0 = int(i - tile0[s]) * KT, jn = imin(KT, n - j0);
      float* row = scratch(0, hd);
      for (int h = 0; h < heads; ++h) {
        const float *qc, *kc, *vc;
        at(s, h, &qc, &kc, &vc);
        float* q = const_cast<float*>(qc) + int64_t(j0) * hd;     // [16][hd]
        float* tile = const_cast<float*>(kc) + int64_t(j0) * hd;  // [hd][16]
        float* v = const_cast<float*>(vc) + int64_t(j0) * hd;     // [16][hd]
        for (int j = 0; j < jn; ++j) {
          const char* r = static_cast<const char*>(qkv) + (row0[s] + j0 + j) * qkv_stride * es;
          load_row(dtype, r + int64_t(h) * hd * es, qb ? qb + int64_t(h) * hd : nullptr, q + int64_t(j) * hd, hd);
          load_row(dtype, r + (width + int64_t(h) * hd) * es, qb ? qb + width + int64_t(h) * hd : nullptr, row, hd);
          for (int d = 0; d < hd; ++d) tile[d * KT + j] = row[d];
          load_row(dtype, r + (2 * width + int64_t(h) * hd) * es, qb ? qb + 2 * width + int64_t(h) * hd : nullptr,
                   v + int64_t(j) * hd, hd);
        }
        for (int j = jn; j < KT; ++j)  // keys past the sequence: zeros (their scores are masked)
          for (int d = 0; d < hd; ++d) tile[d * KT + j] = 0.f;
        std::memset(v + int64_t(jn) * hd, 0, sizeof(float) * (KT - jn) * hd);
      }
    });
    Buffer<Item> items(n_items);
    int64_t k = 0;
    for (int s = 0; s < num_seqs; ++s)
      for (int h = 0; h < heads; ++h)
        for (int q0 = 0; q0 < seq_lens[s]; q0 += QB) items[k++] = Item{s, h, q0, imin(QB, seq_lens[s] - q0)};
    armserve_par::for_dynamic(n_items, [&](int64_t i) {
      const Item& w = items[i];
      const float *qc, *kc, *vc;
      at(w.seq, w.head, &qc, &kc, &vc);
      run_item(dtype, out, w, row0[w.seq], seq_lens[w.seq], heads, hd, scale, qc, kc, vc);
    });
  }
};

}  // namespace
}  // namespace armserve
