// Step graphs: a decode step's kernel calls, recorded once and replayed by one call from Python.
//
// A batch-1 decode step of a 0.5B model is ~350 kernel calls of a few microseconds each; made
// one by one from Python (module calls, ctypes argument conversion, fresh output tensors) they
// cost about as much as the matmuls themselves. armserve/engine/step_graph.py records the calls
// of one step (kernels/capture.py appends each call's arguments while capturing) into an array of GraphOp,
// and `armserve_graph_run` replays it: the CPU analogue of a CUDA graph. Every pointer in it is a
// buffer the graph owns (or a weight); what changes per step (token ids, positions, cache slots,
// context lengths, block tables) is written into the graph's input buffers before each replay.
//
// Also here: the small elementwise ops a step needs besides the kernels (embedding rows, bias,
// per-column scaling, dtype cast), so that a recorded step has no PyTorch op left in it.
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kernels_impl.h"
#include "qgemm.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// One recorded call: which function (`kind`, see armserve_graph_kind) and its arguments in
// order, integers and pointers in `i`, floats in `f` (each in its own sequence).
struct GraphOp {
  int32_t kind;
  int32_t pad;
  int64_t i[16];
  double f[4];
};

namespace {
using S = armserve::ScalarOps;
using armserve::dtype_size;

// Rows of a few hundred to a few thousand elements: one pass through an fp32 row buffer, no threads.
constexpr int64_t kRowChunk = 1024;

// Argument `pos` of a recorded call: floats come from o.f and everything else from o.i, each in
// the order of the declared parameters (kernels/capture.py's Recording splits them the same way).
template <size_t N>
constexpr int count_before(const bool (&is_float)[N], size_t pos, bool want) {
  int c = 0;
  for (size_t j = 0; j < pos; ++j) c += is_float[j] == want;
  return c;
}

template <class T>
T arg(const GraphOp& o, int ii, int fi) {
  if constexpr (std::is_floating_point_v<T>)
    return T(o.f[fi]);
  else if constexpr (std::is_pointer_v<T>)
    return reinterpret_cast<T>(o.i[ii]);
  else
    return T(o.i[ii]);
}

template <class... A, size_t... I>
void replay_args(void (*fn)(A...), const GraphOp& o, std::index_sequence<I...>) {
  static constexpr bool is_float[] = {std::is_floating_point_v<A>..., false};
  fn(arg<A>(o, count_before(is_float, I, false), count_before(is_float, I, true))...);
}

// Call `fn` (a recordable function of api.h) with the arguments recorded in `o`.
template <class... A>
void replay(void (*fn)(A...), const GraphOp& o) {
  static_assert(sizeof...(A) <= 16, "GraphOp holds 16 integer and 4 float arguments");
  replay_args(fn, o, std::index_sequence_for<A...>{});
}
}  // namespace

extern "C" {

// Kinds in ARMSERVE_RECORDABLE's order (api.h).
enum GraphKind : int32_t {
#define ARMSERVE_KIND(fn) G_##fn,
  ARMSERVE_RECORDABLE(ARMSERVE_KIND)
#undef ARMSERVE_KIND
  G_NUM_KINDS
};

// The kind of a recordable function, by its exported name (-1: not recordable). Python asks
// this rather than keeping its own copy of the enum.
int32_t armserve_graph_kind(const char* name) {
#define ARMSERVE_NAME(fn) #fn,
  static const char* names[G_NUM_KINDS] = {ARMSERVE_RECORDABLE(ARMSERVE_NAME)};
#undef ARMSERVE_NAME
  for (int32_t k = 0; k < G_NUM_KINDS; ++k)
    if (!std::strcmp(name, names[k])) return k;
  return -1;
}

int32_t armserve_graph_op_size() { return int32_t(sizeof(GraphOp)); }

// out[r, :n] (rows `ldo` apart) = out + bias, in fp32, rounded once to out's dtype (PyTorch's
// `out += bias` with a float32 bias, and `out + bias` with a bias of out's dtype).
void armserve_add_bias(int32_t dtype, void* out, int32_t bias_dtype, const void* bias, int64_t rows, int64_t n,
                       int64_t ldo) {
  const int es = dtype_size(dtype), bs = dtype_size(bias_dtype);
  float a[kRowChunk], b[kRowChunk];
  for (int64_t r = 0; r < rows; ++r) {
    char* o = static_cast<char*>(out) + r * ldo * es;
    for (int64_t c = 0; c < n; c += kRowChunk) {
      const int64_t len = n - c < kRowChunk ? n - c : kRowChunk;
      S::load(dtype, o + c * es, a, len);
      S::load(bias_dtype, static_cast<const char*>(bias) + c * bs, b, len);
      for (int64_t i = 0; i < len; ++i) a[i] += b[i];
      S::store(dtype, a, o + c * es, len);
    }
  }
}

// x[r, :n] (rows `ld` apart) *= mul (float32 [n]), in place (PyTorch's `x.mul_(mul)`).
void armserve_mul_cols(int32_t dtype, void* x, const float* mul, int64_t rows, int64_t n, int64_t ld) {
  const int es = dtype_size(dtype);
  float a[kRowChunk];
  for (int64_t r = 0; r < rows; ++r) {
    char* p = static_cast<char*>(x) + r * ld * es;
    for (int64_t c = 0; c < n; c += kRowChunk) {
      const int64_t len = n - c < kRowChunk ? n - c : kRowChunk;
      S::load(dtype, p + c * es, a, len);
      for (int64_t i = 0; i < len; ++i) a[i] *= mul[c + i];
      S::store(dtype, a, p + c * es, len);
    }
  }
}

// out [m, row_bytes] = table rows ids[0..m) (an embedding lookup of any element type).
void armserve_embedding(void* out, const void* table, const int64_t* ids, int64_t m, int64_t row_bytes) {
  for (int64_t t = 0; t < m; ++t)
    std::memcpy(static_cast<char*>(out) + t * row_bytes, static_cast<const char*>(table) + ids[t] * row_bytes,
                size_t(row_bytes));
}

// dst [n] (dst_dtype) = src [n] (src_dtype), rounded to nearest even where it narrows.
void armserve_cast(int32_t src_dtype, const void* src, int32_t dst_dtype, void* dst, int64_t n) {
  float a[kRowChunk];
  for (int64_t c = 0; c < n; c += kRowChunk) {
    const int64_t len = n - c < kRowChunk ? n - c : kRowChunk;
    S::load(src_dtype, static_cast<const char*>(src) + c * dtype_size(src_dtype), a, len);
    S::store(dst_dtype, a, static_cast<char*>(dst) + c * dtype_size(dst_dtype), len);
  }
}

// out[r] = index of the largest of x[r, :n] (rows `ld` apart), the first one on ties, and the
// first NaN's if the row has one: torch.argmax's answer. Greedy sampling over a vocabulary:
// PyTorch's argmax takes ~0.3 ms for 150k logits, a fair part of a small model's decode step.
// (x86: built for AVX-512 and AVX2 as well, picked by the CPU when the library loads: the
// baseline build's 4 lanes took ~2% of a 64-sequence decode step over a 49k vocabulary.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void armserve_argmax(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out) {
  constexpr int64_t kChunk = 256;
  // Floats compared as integers that sort like them (-0 taken as +0, which compares equal):
  // integer max reductions vectorise, float ones (NaN rules) do not.
  auto key = [](float f) -> int32_t {
    uint32_t b = __builtin_bit_cast(uint32_t, f);
    b = b == 0x80000000u ? 0u : b;
    const int32_t s = int32_t(b);
    return s ^ ((s >> 31) & 0x7fffffff);
  };
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * ld;
    int32_t best = INT32_MIN;
    int64_t best_chunk = 0, nan_chunk = -1;
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t end = c + kChunk < n ? c + kChunk : n;
      int32_t m = INT32_MIN;
      uint32_t nan = 0;
      for (int64_t i = c; i < end; ++i) {
        const int32_t k = key(row[i]);
        m = k > m ? k : m;
        nan |= (__builtin_bit_cast(uint32_t, row[i]) & 0x7fffffffu) > 0x7f800000u;
      }
      if (nan) {
        nan_chunk = c;
        break;
      }
      if (m > best) {
        best = m;
        best_chunk = c;
      }
    }
    int64_t idx = nan_chunk >= 0 ? nan_chunk : best_chunk;
    const int64_t end = idx + kChunk < n ? idx + kChunk : n;
    if (nan_chunk >= 0)
      while (idx < end - 1 && row[idx] == row[idx]) ++idx;
    else
      while (idx < end - 1 && key(row[idx]) != best) ++idx;
    out[r] = idx;
  }
}

static std::atomic<int64_t> team_replays{0};

// How many replays ran as one parallel region of several threads (tests).
int64_t armserve_graph_team_replays() { return team_replays.load(); }

// Replay `n` recorded calls in order. Returns the index of the first op of unknown kind, or -1.
//
// With more than one OpenMP thread the whole replay is one parallel region (parallel.h): every
// thread walks the calls; the kernels share their loops out over the team, and the small serial
// ops (bias, column scaling, embedding rows, casts: they work in place or on a few rows) run on one
// thread. A barrier follows every call, as the next one reads what it wrote.
int64_t armserve_graph_run(const GraphOp* ops, int64_t n) {
  using Thunk = void (*)(const GraphOp&);
#define ARMSERVE_THUNK(fn) [](const GraphOp& o) { replay(&fn, o); },
  static const Thunk thunks[G_NUM_KINDS] = {ARMSERVE_RECORDABLE(ARMSERVE_THUNK)};
#undef ARMSERVE_THUNK
  for (int64_t idx = 0; idx < n; ++idx)
    if (ops[idx].kind < 0 || ops[idx].kind >= G_NUM_KINDS) return idx;
#ifdef _OPENMP
  static const bool team_off = [] {  // ARMSERVE_GRAPH_TEAM=0: a region per loop, as eager steps do
    const char* e = std::getenv("ARMSERVE_GRAPH_TEAM");
    return e && !std::strcmp(e, "0");
  }();
  if (!team_off && omp_get_max_threads() > 1 && !omp_in_parallel()) {
    static const bool serial[G_NUM_KINDS] = {
#define ARMSERVE_SERIAL(fn) G_##fn == G_armserve_add_bias || G_##fn == G_armserve_mul_cols || \
                                G_##fn == G_armserve_embedding || G_##fn == G_armserve_cast,
        ARMSERVE_RECORDABLE(ARMSERVE_SERIAL)
#undef ARMSERVE_SERIAL
    };
    team_replays.fetch_add(1, std::memory_order_relaxed);
#pragma omp parallel
    {
      for (int64_t idx = 0; idx < n; ++idx) {
        const int32_t kind = ops[idx].kind;
        if (serial[kind]) {
#pragma omp single
          thunks[kind](ops[idx]);  // (the end of `single` is a barrier)
        } else {
          thunks[kind](ops[idx]);
#pragma omp barrier
        }
      }
    }
    return -1;
  }
#endif
  for (int64_t idx = 0; idx < n; ++idx) thunks[ops[idx].kind](ops[idx]);
  return -1;
}

}  // extern "C"
