// Loops shared out over OpenMP threads, alone or inside the step-graph replay's one region.
//
// A kernel called on its own (from Python, or a replay on one thread) opens a parallel region per
// loop, as `#pragma omp parallel for` does. A step graph replayed on several threads runs all of
// its calls inside one region instead (graph.cpp, llama.cpp's graph compute): every thread of the
// team enters each kernel, and a loop gives each thread its share of the iterations (an orphaned
// `omp for`, which ends with a barrier) rather than forking and joining a region of its own, a few
// microseconds each, ~150 times per decode step. Code outside these loops then runs on every
// thread: it may compute private values (the same on each) but must not write shared memory.
#pragma once
#include <cstdint>
#include <cstdlib>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace armserve_par {
namespace {

// True inside a team (the replay's region): the caller is one of several threads running this code.
static inline bool in_team() {
#ifdef _OPENMP
  return omp_in_parallel();
#else
  return false;
#endif
}

// Threads that will share a loop of the calling kernel.
static inline int team_size() {
#ifdef _OPENMP
  return omp_in_parallel() ? omp_get_num_threads() : omp_get_max_threads();
#else
  return 1;
#endif
}

// f(i) for i in [0, n), in contiguous ranges per thread: a region of its own when `par` (alone),
// this thread's share of the team's loop (in a team).
template <class F>
static inline void for_static(int64_t n, bool par, F&& f) {
  if (in_team()) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
#pragma omp parallel for schedule(static) if (par)
    for (int64_t i = 0; i < n; ++i) f(i);
  }
  (void)par;
}

// The same, one iteration at a time to whichever thread is free (uneven items).
template <class F>
static inline void for_dynamic(int64_t n, F&& f) {
  if (in_team()) {
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

// A heap array of n floats that every thread of a team sees (allocated by one thread and handed to
// all; freed by one once all are done), or a private one when called alone. Every thread of a team
// must construct and destroy it at the same point (it synchronises the team).
struct SharedFloats {
  float* p = nullptr;
  explicit SharedFloats(int64_t n) {
    float* q = nullptr;
    if (in_team()) {
#pragma omp single copyprivate(q)
      q = static_cast<float*>(std::malloc(size_t(n > 0 ? n : 1) * sizeof(float)));
    } else {
      q = static_cast<float*>(std::malloc(size_t(n > 0 ? n : 1) * sizeof(float)));
    }
    p = q;
  }
  ~SharedFloats() {
    if (in_team()) {
#pragma omp barrier
#pragma omp single nowait
      std::free(p);
    } else {
      std::free(p);
    }
  }
  SharedFloats(const SharedFloats&) = delete;
  SharedFloats& operator=(const SharedFloats&) = delete;
};

}  // namespace
}  // namespace armserve_par
