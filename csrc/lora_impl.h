// Batched LoRA, punica-style (armserve_lora_shrink / armserve_lora_expand, api.h): one batch mixes
// tokens of different adapters, each token naming its adapter slot. Written once over an ISA's row
// primitives (kernels_impl.h's `Isa`); included by kernels_impl.h, same anonymous-namespace rule.
//
// Both kernels first group the tokens by slot (a stable counting sort, computed privately by every
// thread of a team: it is cheap and the same on each), so each adapter's weights are streamed from
// memory once per call however many of its tokens the batch holds; the tokens of a group then reuse
// them from L1.
//   shrink: out[t, :R] = x[t] @ A[slot].T. Items are (group, block of 16 tokens, K chunk): decode's
//           few tokens would otherwise give a thread team only R x groups rows to share, so K is
//           split into 512-column chunks whose partial sums are added in a fixed order afterwards
//           (the result does not depend on the thread count). Each (A row, token) pair of an item is
//           one `Isa::dot_w`: the variant's widening FMAs, or its bf16 dot instruction (AVX512-BF16,
//           ARM BFDOT) where the CPU has one.
//   expand: y[t, :N] = round(y + scale[slot] * buf[t] @ B[slot].T). Items are 64-column blocks of
//           N, each thread updating its own columns of every token: a block of B [64, R] (64 rows
//           of R, one contiguous run) is widened to fp32 once per group, then each token of the
//           group is 64 short dots (`Isa::dots`, rows side by side). Transposing the block for
//           axpys over 64 lanes cost more than the products themselves at decode's few tokens.
#pragma once
#include <cstdint>
#include <cstdlib>

namespace armserve {
namespace {

// The tokens of one call grouped by adapter slot. Tokens whose index is negative (no adapter) or
// not below `slots` form no group: the kernels leave them alone (expand) or zero them (shrink).
struct LoraGroups {
  int64_t count = 0;             // groups (slots with at least one token)
  const int64_t* slot = nullptr;   // [count]
  const int64_t* start = nullptr;  // [count + 1]: group g's tokens are tok[start[g] .. start[g + 1])
  const int64_t* tok = nullptr;    // token numbers, grouped, ascending within a group
};

// Thread-local int64 arrays, grown on demand (per thread: in a team every thread builds its own).
static inline int64_t* lora_ibuf(int which, int64_t n) {
  struct Buf {
    int64_t* p = nullptr;
    int64_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf bufs[5];
  Buf& b = bufs[which];
  if (b.n < n) {
    std::free(b.p);
    b.p = static_cast<int64_t*>(std::malloc(size_t(n > 0 ? n : 1) * sizeof(int64_t)));
    b.n = n;
  }
  return b.p;
}

static inline LoraGroups lora_group(const int64_t* idx, int64_t t, int64_t slots) {
  int64_t* cnt = lora_ibuf(0, slots + 1);
  int64_t* tok = lora_ibuf(1, t);
  int64_t* slot = lora_ibuf(2, t < slots ? t : slots);
  int64_t* start = lora_ibuf(3, (t < slots ? t : slots) + 1);
  for (int64_t s = 0; s <= slots; ++s) cnt[s] = 0;
  for (int64_t i = 0; i < t; ++i)
    if (idx[i] >= 0 && idx[i] < slots) ++cnt[idx[i] + 1];
  LoraGroups g;
  int64_t n = 0;
  for (int64_t s = 0; s < slots; ++s) {
    if (cnt[s + 1]) {
      slot[n] = s;
      start[n++] = cnt[s];  // tokens before slot s
    }
    cnt[s + 1] += cnt[s];
  }
  start[n] = cnt[slots];
  for (int64_t i = 0; i < t; ++i)  // cnt[s]: next free position of slot s
    if (idx[i] >= 0 && idx[i] < slots) tok[cnt[idx[i]]++] = i;
  g.count = n;
  g.slot = slot;
  g.start = start;
  g.tok = tok;
  return g;
}

template <class Isa>
struct Lora {
  static constexpr int64_t kChunkK = 512;      // shrink: K columns per item when the batch is small
  static constexpr int64_t kSplitTokens = 64;  // ... small: at most this many tokens
  static constexpr int64_t kTokBlock = 16;     // shrink: tokens per item (x rows of a chunk stay in L1)
  static constexpr int64_t kColsN = 64;        // expand: output columns per item

  static void shrink(int32_t dtype, float* out, const void* x, const void* a, const int64_t* idx, int64_t t,
                     int64_t r, int64_t k, int64_t slots, int64_t ldx, int64_t ldo, int64_t a_slot, int64_t a_row) {
    if (t <= 0 || r <= 0) return;
    const int es = dtype_size(dtype);
    const LoraGroups g = lora_group(idx, t, slots);
    // Token blocks of every group (private, the same on every thread of a team).
    int64_t nblk = 0;
    for (int64_t i = 0; i < g.count; ++i) nblk += (g.start[i + 1] - g.start[i] + kTokBlock - 1) / kTokBlock;
    int64_t* blk_group = lora_ibuf(0, nblk);  // (the counting sort's counts are no longer needed)
    int64_t* blk_p0 = lora_ibuf(4, nblk);     // the block's first position in g.tok
    int64_t b = 0;
    for (int64_t i = 0; i < g.count; ++i)
      for (int64_t p = g.start[i]; p < g.start[i + 1]; p += kTokBlock, ++b) {
        blk_group[b] = i;
        blk_p0[b] = p;
      }
    const int64_t ks = t <= kSplitTokens && k > kChunkK ? (k + kChunkK - 1) / kChunkK : 1;
    const int64_t chunk = ks == 1 ? k : kChunkK;
    const bool par = t * r * k >= (1 << 15);
    // K split: partial sums [ks][t][r], added up in chunk order below; otherwise straight into out.
    armserve_par::SharedFloats partial(ks > 1 ? ks * t * r : 0);
    armserve_par::for_static(nblk * ks, par, [&](int64_t it) {
      const int64_t grp = blk_group[it / ks], p0 = blk_p0[it / ks], kc = it % ks;
      const int64_t p1 = p0 + kTokBlock < g.start[grp + 1] ? p0 + kTokBlock : g.start[grp + 1];
      const int64_t k0 = kc * chunk, kn = k - k0 < chunk ? k - k0 : chunk;
      const char* as = static_cast<const char*>(a) + (g.slot[grp] * a_slot + k0) * es;
      // Row outer, token inner: the A row chunk is read from memory once, then from L1.
      for (int64_t j = 0; j < r; ++j) {
        const char* arow = as + j * a_row * es;
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t tk = g.tok[p];
          const float v = Isa::dot_w(dtype, arow, static_cast<const char*>(x) + (tk * ldx + k0) * es, kn);
          if (ks > 1)
            partial.p[(kc * t + tk) * r + j] = v;
          else
            out[tk * ldo + j] = v;
        }
      }
    });
    // Rows of tokens without an adapter are zeros; with a K split, the others are the chunk sums.
    if (ks == 1 && g.start[g.count] == t) return;
    armserve_par::for_static(t, par, [&](int64_t tk) {
      float* o = out + tk * ldo;
      const bool has = idx[tk] >= 0 && idx[tk] < slots;
      if (!has || ks == 1) {
        if (!has) zero(o, r);
        return;
      }
      for (int64_t j = 0; j < r; ++j) o[j] = partial.p[tk * r + j];
      for (int64_t kc = 1; kc < ks; ++kc) {
        const float* q = partial.p + (kc * t + tk) * r;
        for (int64_t j = 0; j < r; ++j) o[j] += q[j];
      }
    });
  }

  static void expand(int32_t dtype, void* y, const float* buf, const void* b, const int64_t* idx,
                     const float* scales, int64_t t, int64_t n, int64_t r, int64_t slots, int64_t ldy, int64_t ldb,
                     int64_t b_slot) {
    if (t <= 0 || n <= 0) return;
    const int es = dtype_size(dtype);
    const LoraGroups g = lora_group(idx, t, slots);
    if (g.count == 0) return;
    const int64_t nblk = (n + kColsN - 1) / kColsN;
    armserve_par::for_static(nblk, t * n * r >= (1 << 15), [&](int64_t it) {
      const int64_t n0 = it * kColsN, nc = n - n0 < kColsN ? n - n0 : kColsN;
      float* bf = scratch(0, kColsN * (r > 0 ? r : 1));  // B rows n0.. as stored: [nc][r]
      float* acc = scratch(2, kColsN);
      float* yf = scratch(3, kColsN);
      for (int64_t i = 0; i < g.count; ++i) {
        const int64_t s = g.slot[i];
        const float sc = scales[s];
        // Rows n0 .. n0 + nc of B[s] are one contiguous run of nc * r elements.
        Isa::load(dtype, static_cast<const char*>(b) + (s * b_slot + n0 * r) * es, bf, nc * r);
        for (int64_t p = g.start[i]; p < g.start[i + 1]; ++p) {
          const int64_t tk = g.tok[p];
          Isa::dots(bf, r, buf + tk * ldb, r, acc, nc);
          // y + scale * delta in fp32, rounded once to y's dtype.
          char* yr = static_cast<char*>(y) + (tk * ldy + n0) * es;
          Isa::load(dtype, yr, yf, nc);
          for (int64_t c = 0; c < nc; ++c) yf[c] += sc * acc[c];
          Isa::store(dtype, yf, yr, nc);
        }
      }
    });
  }
};

}  // namespace
}  // namespace armserve
