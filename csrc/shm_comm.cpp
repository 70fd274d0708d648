// Tensor-parallel collectives between the ranks of one machine, through one shared-memory
// region (armserve/distributed.py maps it into every rank's process).
//
//   [header: one 64-byte line per rank holding its arrival count; then the abort flag]
//   [buffer 0: slot of rank 0 | slot of rank 1 | ...]   ops with an even sequence number
//   [buffer 1: slot of rank 0 | slot of rank 1 | ...]   ops with an odd one
//
// An op: write this rank's part into its slot, publish the new arrival count (release), wait
// until every rank's count reached it (acquire), then read the others' slots. Two buffers in
// turn make a second barrier unnecessary: a rank can only write a buffer again two ops later,
// by which time every rank has arrived at the op in between, so has finished reading this one.
// Every rank sums the slots in rank order, so all ranks hold bit-identical results.
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "api.h"
#include "float_conv.h"

namespace {

constexpr int64_t kLine = 64;

std::atomic<int64_t>* counter(void* shm, int32_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(static_cast<char*>(shm) + rank * kLine);
}

std::atomic<int32_t>* abort_flag(void* shm, int32_t world) {
  return reinterpret_cast<std::atomic<int32_t>*>(static_cast<char*>(shm) + world * kLine);
}

char* slot(void* shm, int32_t world, int64_t slot_bytes, int64_t seq, int32_t rank) {
  char* data = static_cast<char*>(shm) + (world + 1) * kLine;
  return data + ((seq & 1) * world + rank) * slot_bytes;
}

// Spin a while (the others are usually a few microseconds behind), then yield the core: with
// more ranks than free cores a spinning waiter would hold the one its peer needs.
int32_t wait_all(void* shm, int32_t world, int64_t seq) {
  for (int32_t r = 0; r < world; ++r) {
    int64_t spins = 0;
    while (counter(shm, r)->load(std::memory_order_acquire) < seq) {
      if (abort_flag(shm, world)->load(std::memory_order_relaxed)) return 1;
      if (++spins > 2000) sched_yield();
    }
  }
  return 0;
}

}  // namespace

extern "C" {

int64_t armserve_shm_header_bytes(int32_t world) { return (world + 1) * kLine; }

int32_t armserve_shm_barrier(void* shm, int32_t rank, int32_t world, int64_t seq) {
  counter(shm, rank)->store(seq, std::memory_order_release);
  return wait_all(shm, world, seq);
}

void armserve_shm_abort(void* shm, int32_t world) { abort_flag(shm, world)->store(1, std::memory_order_relaxed); }

int32_t armserve_shm_allreduce(void* shm, int32_t rank, int32_t world, int64_t slot_bytes, int64_t seq, int32_t dtype,
                               void* data, int64_t n) {
  using namespace armserve_conv;
  const int64_t esize = dtype == AS_F32 ? 4 : 2;
  if (n * esize > slot_bytes) return 2;
  std::memcpy(slot(shm, world, slot_bytes, seq, rank), data, n * esize);
  counter(shm, rank)->store(seq, std::memory_order_release);
  if (wait_all(shm, world, seq)) return 1;
  if (dtype == AS_F32) {
    float* out = static_cast<float*>(data);
    const float* s0 = reinterpret_cast<const float*>(slot(shm, world, slot_bytes, seq, 0));
    for (int64_t i = 0; i < n; ++i) out[i] = s0[i];
    for (int32_t r = 1; r < world; ++r) {
      const float* s = reinterpret_cast<const float*>(slot(shm, world, slot_bytes, seq, r));
      for (int64_t i = 0; i < n; ++i) out[i] += s[i];
    }
    return 0;
  }
  // 16-bit: sum in float32 over 4 KiB pieces, rounding once per element.
  uint16_t* out = static_cast<uint16_t*>(data);
  constexpr int64_t kPiece = 1024;
  float acc[kPiece];
  for (int64_t p = 0; p < n; p += kPiece) {
    const int64_t m = n - p < kPiece ? n - p : kPiece;
    for (int32_t r = 0; r < world; ++r) {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(slot(shm, world, slot_bytes, seq, r)) + p;
      if (dtype == AS_BF16) {
        for (int64_t i = 0; i < m; ++i) acc[i] = (r ? acc[i] : 0.0f) + bf16_to_f32(s[i]);
      } else {
        for (int64_t i = 0; i < m; ++i) acc[i] = (r ? acc[i] : 0.0f) + f16_to_f32(s[i]);
      }
    }
    if (dtype == AS_BF16) {
      for (int64_t i = 0; i < m; ++i) out[p + i] = f32_to_bf16(acc[i]);
    } else {
      for (int64_t i = 0; i < m; ++i) out[p + i] = f32_to_f16(acc[i]);
    }
  }
  return 0;
}

}  // extern "C"
