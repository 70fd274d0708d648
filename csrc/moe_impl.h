// Mixture-of-Experts MLP of one layer (armserve_fused_moe, api.h), written once over a variant's
// expert GEMM tiles (w4 / w8: QKernels::tile_rows of qgemm_impl.h; bf16: the dense GEMM's
// column-range entry, DenseTable::cols) and its SiLU row (silu_and_mul, kernels_impl.h):
//   1. the (token, slot) pairs sorted by expert, stably, so that each expert's rows form one range;
//   2. gate and up of every (active expert, 64 intermediate columns) item, and SiLU-and-mul of the
//      two while they are in cache, into h [pairs, inter];
//   3. down of every (active expert, 64 hidden columns) item into y [pairs, hidden];
//   4. each token's rows of y times its routing weights, added to its output row in expert order.
// Items go to threads dynamically (experts get different token counts), so a decode step whose few
// tokens reach few experts still keeps every thread busy, in three parallel loops per layer where
// the layer-by-layer path forks and joins three or more per active expert. An expert that receives
// no token costs nothing. Included by qgemm_impl.h (every qgemm_<isa>.cpp), same anonymous-namespace
// rule as kernels_impl.h.
#pragma once
#include <cstdint>
#include <cstdlib>

#include "dense_gemm.h"

namespace armserve {
namespace {

// Thread-local buffers, grown on demand: 0-9 for the calling thread's per-call arrays, 10 for an
// item's gate/up outputs on the thread that runs it.
static inline void* moe_buf(int which, int64_t bytes) {
  struct Buf {
    void* p = nullptr;
    int64_t bytes = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf bufs[11];
  Buf& b = bufs[which];
  if (b.bytes < bytes) {
    std::free(b.p);
    b.p = std::aligned_alloc(64, size_t((bytes + 63) / 64 * 64));
    b.bytes = bytes;
  }
  return b.p;
}

template <class Isa, class IsaQ>
struct Moe {
  using Q = QKernels<Isa, IsaQ>;
  static constexpr int64_t kCols = 64;  // output columns of one item

  static void run(int32_t fmt, int32_t dtype, float* out, const void* x, int64_t tokens, int64_t hidden,
                  int64_t inter, int32_t top_k, const int64_t* ids, const float* weights, int32_t num_experts,
                  const void* const* gate, const void* const* up, const void* const* down, int64_t group_gu,
                  int64_t group_dn) {
    if (tokens <= 0) return;
    const bool dense = fmt == 2;
    const int es = dtype_size(dtype);
    const int64_t pairs = tokens * top_k, E = num_experts;

    // 1. Counting sort of the pairs by expert (stable: a token's slots keep their order).
    int64_t* off = static_cast<int64_t*>(moe_buf(0, (E + 1) * 8));
    int64_t* fill = static_cast<int64_t*>(moe_buf(1, (E + 1) * 8));
    int32_t* tok = static_cast<int32_t*>(moe_buf(2, pairs * 4));  // token of the i-th sorted pair
    int32_t* pos = static_cast<int32_t*>(moe_buf(3, pairs * 4));  // sorted position of pair t * top_k + j
    int32_t* act = static_cast<int32_t*>(moe_buf(4, E * 4));      // the experts with tokens
    for (int64_t e = 0; e <= E; ++e) off[e] = 0;
    for (int64_t p = 0; p < pairs; ++p) ++off[ids[p] + 1];
    int64_t nact = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (off[e + 1]) act[nact++] = int32_t(e);
      off[e + 1] += off[e];
      fill[e] = off[e];
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t i = fill[ids[p]]++;
      tok[i] = int32_t(p / top_k);
      pos[p] = int32_t(i);
    }

    char* h = static_cast<char*>(moe_buf(5, pairs * inter * es));
    char* y = static_cast<char*>(moe_buf(6, pairs * hidden * es));
    const DenseTable* dt = dense ? armserve_dense_active() : nullptr;
    // The activations the gate/up GEMMs read: bf16 rows gathered in sorted order (dense), or every
    // token quantized once, whatever the number of experts it goes to (w4 / w8).
    const int64_t ngu = dense ? 0 : hidden / group_gu, ndn = dense ? 0 : inter / group_dn;
    char* xg = nullptr;
    int8_t* xq = nullptr;
    float* xs = nullptr;
    int32_t* xsum = nullptr;
    if (dense) {
      xg = static_cast<char*>(moe_buf(7, pairs * hidden * 2));
      armserve_par::for_static(pairs, pairs * hidden >= (1 << 16), [&](int64_t i) {
        std::memcpy(xg + i * hidden * 2, static_cast<const char*>(x) + int64_t(tok[i]) * hidden * 2, size_t(hidden) * 2);
      });
    } else {
      // (codes, then scales, then group sums, in one buffer)
      xq = static_cast<int8_t*>(moe_buf(7, tokens * hidden + (tokens * ngu) * 8 + 64));
      xs = reinterpret_cast<float*>(xq + (tokens * hidden + 63) / 64 * 64);
      xsum = reinterpret_cast<int32_t*>(xs + tokens * ngu);
      Q::quantize_act(dtype, x, tokens, hidden, group_gu, xq, xs, xsum);
    }

    // One w4 / w8 / w5 / w6 / w8h weight tile over n quantized rows (QKernels::tile_rows).
    auto qtile = [&](char* o, int64_t ldo, const int8_t* q, const float* s, const int32_t* sum, const int32_t* idx,
                     int64_t n, const uint8_t* wt, int cols, int64_t k, int64_t group) {
      if (fmt == kW4)
        Q::template tile_rows<kW4>(dtype, o, ldo, q, s, sum, idx, n, wt, cols, k, group);
      else if (fmt == kW5)
        Q::template tile_rows<kW5>(dtype, o, ldo, q, s, sum, idx, n, wt, cols, k, group);
      else if (fmt == kW6)
        Q::template tile_rows<kW6>(dtype, o, ldo, q, s, sum, idx, n, wt, cols, k, group);
      else if (fmt == kW8H)
        Q::template tile_rows<kW8H>(dtype, o, ldo, q, s, sum, idx, n, wt, cols, k, group);
      else
        Q::template tile_rows<kW8>(dtype, o, ldo, q, s, sum, idx, n, wt, cols, k, group);
    };

    // 2. gate and up, SiLU-and-mul, per (expert, 64 intermediate columns).
    const int64_t na = (inter + kCols - 1) / kCols;
    const int64_t tb_gu = dense ? 0 : Q::tile_bytes(fmt, hidden, group_gu);
    armserve_par::for_dynamic(nact * na, [&](int64_t it) {
      const int64_t e = act[it / na], c0 = it % na * kCols, w = inter - c0 < kCols ? inter - c0 : kCols;
      const int64_t r0 = off[e], n = off[e + 1] - off[e];
      // [n rows][gate w | up w], the layout silu_and_mul reads
      char* gu = static_cast<char*>(moe_buf(10, n * 2 * w * es));
      if (dense) {
        const char* xe = xg + r0 * hidden * 2;
        dt->cols(AS_BF16, gu, xe, gate[e], n, inter, hidden, 2 * w, c0 / 16, (c0 + w) / 16);
        dt->cols(AS_BF16, gu + w * 2, xe, up[e], n, inter, hidden, 2 * w, c0 / 16, (c0 + w) / 16);
      } else {
        for (int64_t t = c0 / 16; t < (c0 + w) / 16; ++t)
          for (int half = 0; half < 2; ++half) {  // the gate tile, then the up tile of the same columns
            char* o = gu + ((t - c0 / 16) * 16 + half * w) * es;
            const uint8_t* wt = static_cast<const uint8_t*>(half ? up[e] : gate[e]) + t * tb_gu;
            qtile(o, 2 * w, xq, xs, xsum, tok + r0, n, wt, 16, hidden, group_gu);
          }
      }
      for (int64_t r = 0; r < n; ++r) silu_and_mul(dtype, gu + r * 2 * w * es, h + ((r0 + r) * inter + c0) * es, w);
    });

    // 3. down, per (expert, 64 hidden columns); h quantized once per pair first (w4 / w8).
    int8_t* hq = nullptr;
    float* hs = nullptr;
    int32_t* hsum = nullptr;
    if (!dense) {
      hq = static_cast<int8_t*>(moe_buf(8, pairs * inter + (pairs * ndn) * 8 + 64));
      hs = reinterpret_cast<float*>(hq + (pairs * inter + 63) / 64 * 64);
      hsum = reinterpret_cast<int32_t*>(hs + pairs * ndn);
      Q::quantize_act(dtype, h, pairs, inter, group_dn, hq, hs, hsum);
    }
    const int64_t nb = (hidden + kCols - 1) / kCols;
    const int64_t tb_dn = dense ? 0 : Q::tile_bytes(fmt, inter, group_dn);
    armserve_par::for_dynamic(nact * nb, [&](int64_t it) {
      const int64_t e = act[it / nb], c0 = it % nb * kCols, w = hidden - c0 < kCols ? hidden - c0 : kCols;
      const int64_t r0 = off[e], n = off[e + 1] - off[e];
      char* ye = y + (r0 * hidden + c0) * es;
      if (dense) {
        dt->cols(AS_BF16, ye, h + r0 * inter * 2, down[e], n, hidden, inter, hidden, c0 / 16, (c0 + w + 15) / 16);
        return;
      }
      const uint8_t* wq = static_cast<const uint8_t*>(down[e]);
      for (int64_t t = c0 / 16; t < (c0 + w + 15) / 16; ++t) {
        const int cols = int(hidden - t * 16 < 16 ? hidden - t * 16 : 16);
        qtile(ye + (t * 16 - c0) * es, hidden, hq + r0 * inter, hs + r0 * ndn, hsum + r0 * ndn, nullptr, n,
              wq + t * tb_dn, cols, inter, group_dn);
      }
    });

    // 4. out[t] = the sum of weights[t, j] * y[pair], pairs in sorted (expert) order, in fp32.
    armserve_par::for_static(tokens, tokens * hidden >= (1 << 14), [&](int64_t t) {
      float* o = out + t * hidden;
      float* row = scratch(0, hidden);
      int32_t ps[64];
      int32_t js[64];
      const int kk = top_k < 64 ? top_k : 64;
      for (int j = 0; j < kk; ++j) {  // insertion sort of the token's slots by sorted position
        int i = j;
        for (; i > 0 && ps[i - 1] > pos[t * top_k + j]; --i) ps[i] = ps[i - 1], js[i] = js[i - 1];
        ps[i] = pos[t * top_k + j];
        js[i] = j;
      }
      for (int64_t c = 0; c < hidden; ++c) o[c] = 0.f;
      for (int j = 0; j < kk; ++j) {
        Isa::load(dtype, y + int64_t(ps[j]) * hidden * es, row, hidden);
        const float wt = weights[t * top_k + js[j]];
        for (int64_t c = 0; c < hidden; ++c) o[c] += wt * row[c];
      }
    });
  }
};

}  // namespace
}  // namespace armserve
