// Pin the OpenMP threads (shared with PyTorch) to a list of cores, one thread per core.
#include <cstdint>

#include "api.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__)
#include <dlfcn.h>
#include <sched.h>

#include <cstdio>
#endif

extern "C" {

// Returns 0 on success, or the first errno-like failure (1 = no OpenMP, 2 = setaffinity failed).
int32_t armserve_bind_threads(const int32_t* cores, int32_t n) {
#if defined(_OPENMP) && defined(__linux__)
  omp_set_num_threads(n);
  int failed = 0;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cores[t], &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
#pragma omp atomic write
      failed = 2;
    }
  }
  return failed;
#else
  (void)cores;
  (void)n;
  return 1;
#endif
}

// The core each OpenMP thread runs on now (for `armserve info` and tests).
int32_t armserve_thread_cores(int32_t* out, int32_t max) {
#if defined(_OPENMP) && defined(__linux__)
  int n = omp_get_max_threads();
  if (n > max) n = max;
#pragma omp parallel num_threads(n)
  out[omp_get_thread_num()] = sched_getcpu();
  return n;
#else
  (void)out;
  (void)max;
  return 0;
#endif
}

// Path of the OpenMP runtime this library's omp_* calls bound to (must be PyTorch's).
int32_t armserve_openmp_library(char* buf, int32_t n) {
#if defined(_OPENMP) && defined(__linux__)
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &info) && info.dli_fname) {
    std::snprintf(buf, n, "%s", info.dli_fname);
    return 0;
  }
#endif
  if (n > 0) buf[0] = 0;
  return 1;
}
}
