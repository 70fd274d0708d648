// Intel AMX tiles, shared by the dense GEMM (dense_gemm_amx.cpp) and prefill attention
// (attention_impl.h, AVX-512 variant). Code that uses them sits in functions marked
// target("amx-tile,amx-bf16") and runs only after armserve_amx_active() said yes: the CPU has
// AMX-BF16, Linux granted this process the tile data (a tile instruction is fatal before that)
// and the AMX switch is on (armserve_set_amx).
//
// One configuration for every use: all eight tiles 16 rows x 64 bytes (16 x 16 fp32 sums, 16 x 32
// bf16 operands). Each thread loads it before a run of tile instructions (another library on the
// thread may have loaded its own in between) and releases the tiles after.
#pragma once
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstdint>

extern "C" int32_t armserve_amx_active();

namespace armserve_amx {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) static inline void begin() {
  static const TileConfig cfg = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) static inline void end() { _tile_release(); }

// GCC's tileloadd is an asm statement that does not tell the compiler it reads memory (its
// tilestored does say it writes): without this barrier, stores into a buffer that only tile
// loads read may be deferred past them or dropped. Call it between writing such a buffer and
// loading tiles from it.
static inline void fence() { __asm__ volatile("" ::: "memory"); }

}  // namespace armserve_amx
#endif
