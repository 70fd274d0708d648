// Pin the OpenMP threads (shared with PyTorch) to a list of cores, one thread per core.
#include <cstdint>

#include "api.h"

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__linux__)
#include <link.h>
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

#if defined(_OPENMP) && defined(__linux__)
namespace {
struct ObjectAt {
  uintptr_t addr;
  const char* name;
};

// dl_iterate_phdr callback: stops at the loaded object whose segments contain `addr`.
int find_object(dl_phdr_info* info, size_t, void* data) {
  auto* want = static_cast<ObjectAt*>(data);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const auto& ph = info->dlpi_phdr[i];
    const uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD && want->addr >= start && want->addr < start + ph.p_memsz) {
      want->name = info->dlpi_name;
      return 1;
    }
  }
  return 0;
}
}  // namespace
#endif

// Path of the OpenMP runtime this library's omp_* calls bound to (must be PyTorch's).
// NOTE: dl_iterate_phdr, not dladdr: glibc 2.34 moved dladdr into libc under a new symbol version,
// which would raise the glibc the prebuilt wheels need (scripts/build_wheels.sh) to 2.34.
int32_t armserve_openmp_library(char* buf, int32_t n) {
#if defined(_OPENMP) && defined(__linux__)
  ObjectAt want{reinterpret_cast<uintptr_t>(&omp_get_max_threads), nullptr};
  if (dl_iterate_phdr(find_object, &want) && want.name && want.name[0]) {
    std::snprintf(buf, n, "%s", want.name);
    return 0;
  }
#endif
  if (n > 0) buf[0] = 0;
  return 1;
}
}
