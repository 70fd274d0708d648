// Quantized-GEMM variant that goes with the kernel variant in use (dispatch.cpp), limited by
// the integer-dot features it needs: AVX512-VNNI on x86 (else AVX2), dotprod for NEON (plus
// i8mm's SMMLA for prefill where present), SVE (NEON i8mm at 128-bit SVE, see pick()).
#include <cstring>

#include "float_conv.h"
#include "qgemm.h"

extern "C" const char* armserve_isa();

namespace {

const QKernelTable* pick(const char* isa) {
  const CpuFeatures& f = *armserve_cpu();
#if defined(__x86_64__)
  if (!std::strcmp(isa, "avx512")) {
    if (f.avx512_vnni) return armserve_qtable_avx512();  // (the avx512 variant implies AVX512-BW)
    return armserve_qtable_avx2();  // AVX-512 without VNNI (Skylake-SP): AVX2 integer path
  }
  if (!std::strcmp(isa, "avx2")) return armserve_qtable_avx2();
#elif defined(__aarch64__)
  if (!std::strcmp(isa, "sve")) {
    // 128-bit SVE with i8mm (Graviton4, Grace): NEON's SMMLA tiles do twice the multiply-adds of
    // SVE SDOT at that width for prefill, and decode is memory-bound either way. Wider SVE
    // (Graviton3's 256 bits) keeps SDOT, which already matches SMMLA at 128 bits.
    if (f.i8mm && f.sve_bits == 128) return armserve_qtable_neon_i8mm();
    return armserve_qtable_sve();
  }
  if (!std::strcmp(isa, "neon") && f.dotprod) return f.i8mm ? armserve_qtable_neon_i8mm() : armserve_qtable_neon();
#endif
  (void)f;
  return armserve_qtable_scalar();
}

const QKernelTable* qtable() {
  static const char* for_isa = nullptr;
  static const QKernelTable* t = nullptr;
  const char* isa = armserve_isa();
  if (isa != for_isa) {  // the kernel variant changed (ARMSERVE_ISA, tests)
    t = pick(isa);
    for_isa = isa;
  }
  return t;
}

}  // namespace

extern "C" {

const char* armserve_qgemm_isa() { return qtable()->name; }

void armserve_quantize_act(int32_t dtype, const void* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* scale,
                           int32_t* gsum) {
  qtable()->quantize_act(dtype, x, m, k, group, q, scale, gsum);
}

void armserve_gemm_w4(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w4(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}

void armserve_gemm_w8(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const int8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w8(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}

void armserve_gemm_w5(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w5(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}

void armserve_gemm_w6(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w6(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}

void armserve_gemm_w8h(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                       const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo) {
  qtable()->gemm_w8h(dtype, out, q, ascale, agsum, w, m, n, k, group, ldo);
}

void armserve_fused_moe(int32_t fmt, int32_t dtype, float* out, const void* x, int64_t tokens, int64_t hidden,
                        int64_t inter, int32_t top_k, const int64_t* ids, const float* weights, int32_t num_experts,
                        const void* const* gate, const void* const* up, const void* const* down, int64_t group_gu,
                        int64_t group_dn) {
  qtable()->fused_moe(fmt, dtype, out, x, tokens, hidden, inter, top_k, ids, weights, num_experts, gate, up, down,
                      group_gu, group_dn);
}

void armserve_qembedding(int32_t fmt, int32_t dtype, void* out, const void* w, const float* exact,
                         const int64_t* ids, int64_t m, int64_t start, int64_t n, int64_t k, int64_t group) {
  qtable()->qembedding(fmt, dtype, out, w, exact, ids, m, start, n, k, group);
}

void armserve_gguf_embedding(int32_t type, int32_t dtype, void* out, const void* blocks, int64_t row_bytes,
                             const int64_t* ids, int64_t m, int64_t start, int64_t n, int64_t k) {
  qtable()->gguf_embedding(type, dtype, out, blocks, row_bytes, ids, m, start, n, k);
}
// W5 (qgemm.h; group 32): per tile and group, W4's chunks of the low nibbles, the plane of bit 4
// (byte r * 4 + j: bit cl from the code in chunk cl's low nibble, bit 4 + cl from its high one),
// then 16 float16 s.
static void pack_w5(const uint8_t* c, const float* scales, int64_t n, int64_t k, uint8_t* out) {
  const int64_t ng = k / 32, tiles = (n + 15) / 16;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t gi = 0; gi < ng; ++gi, out += 352) {
      std::memset(out, 0, 352);
      for (int64_t r = 0; r < 16 && t * 16 + r < n; ++r) {
        const int64_t row = t * 16 + r;
        const uint8_t* u = c + row * k + gi * 32;
        for (int cl = 0; cl < 4; ++cl)
          for (int j = 0; j < 4; ++j) {
            const uint8_t lo = u[cl * 8 + j], hi = u[cl * 8 + 4 + j];
            out[cl * 64 + r * 4 + j] = uint8_t((lo & 15) | (hi & 15) << 4);
            out[256 + r * 4 + j] |= uint8_t((lo >> 4 & 1) << cl | (hi >> 4 & 1) << (4 + cl));
          }
        const uint16_t hs = armserve_conv::f32_to_f16(scales[row * ng + gi]);
        std::memcpy(out + 320 + 2 * r, &hs, 2);
      }
    }
  }
}

// W6 (qgemm.h; group 16, k a multiple of 256): per tile and super-block of 16 groups, each group's 2
// chunks of low nibbles and its plane of bits 4-5 (byte r * 4 + j: bits 2cl..2cl+1 from the code in
// chunk cl's low nibble, 4 + 2cl..5 + 2cl from its high one), then the int8 sub-scales sc =
// scales / d ([group][row]), then 16 float32 d (`d` [n, k / 256]).
static void pack_w6(const uint8_t* c, const float* scales, const float* d, int64_t n, int64_t k, uint8_t* out) {
  const int64_t ng = k / 16, nsb = k / 256, tiles = (n + 15) / 16;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t sb = 0; sb < nsb; ++sb, out += 3392) {
      std::memset(out, 0, 3392);
      for (int64_t r = 0; r < 16 && t * 16 + r < n; ++r) {
        const int64_t row = t * 16 + r;
        const float dr = d[row * nsb + sb];
        std::memcpy(out + 3328 + 4 * r, &dr, 4);
        for (int64_t gl = 0; gl < 16; ++gl) {
          const int64_t gi = sb * 16 + gl;
          const uint8_t* u = c + row * k + gi * 16;
          uint8_t* gp = out + gl * 192;
          for (int cl = 0; cl < 2; ++cl)
            for (int j = 0; j < 4; ++j) {
              const uint8_t lo = u[cl * 8 + j], hi = u[cl * 8 + 4 + j];
              gp[cl * 64 + r * 4 + j] = uint8_t((lo & 15) | (hi & 15) << 4);
              gp[128 + r * 4 + j] |= uint8_t((lo >> 4 & 3) << (2 * cl) | (hi >> 4 & 3) << (4 + 2 * cl));
            }
          // (d * sc is exact: sc = scales / d is the integer it was built from; 0 where d is)
          const float sc = dr != 0.0f ? scales[row * ng + gi] / dr : 0.0f;
          out[3072 + gl * 16 + r] = uint8_t(int8_t(sc));
        }
      }
    }
  }
}

// codes [n, k] (w4: uint8 0..15, w8 and w8h: int8, w5: uint8 0..31, w6: uint8 0..63), scales (and
// w4's szp) float32 [n, k / group] -> the packed tiles of qgemm.h (formats.py `pack` is the PyTorch
// reference): per 16-row tile and group, the weight words (w4: 4 bytes a row per 8 columns, byte
// j = u[8c + j] | u[8c + 4 + j] << 4; w8, w8h: 4 codes a row per 4 columns), then 64 bytes of
// scales (w4: 16 float16 s, then 16 szp; w8: 16 float32 s; w8h: after every second group, that
// pair's 2 x 16 float16 s). Rows past n are zeros. One pass over the weights at load, where
// PyTorch's strided copies took seconds a model.
void armserve_pack_q(int32_t fmt, const void* codes, const float* scales, const float* szp, int64_t n, int64_t k,
                     int64_t group, void* packed) {
  const auto* c = static_cast<const uint8_t*>(codes);
  auto* out = static_cast<uint8_t*>(packed);
  if (fmt == 3) return pack_w5(c, scales, n, k, out);
  if (fmt == 4) return pack_w6(c, scales, szp, n, k, out);
  const int64_t ng = k / group, tiles = (n + 15) / 16;
  const int64_t chunk = fmt == 0 ? 8 : 4;  // columns per 4-byte word
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t gi = 0; gi < ng; ++gi) {
      for (int64_t cc = gi * group; cc < (gi + 1) * group; cc += chunk) {
        for (int64_t r = 0; r < 16; ++r, out += 4) {
          const int64_t row = t * 16 + r;
          if (row >= n) {
            std::memset(out, 0, 4);
          } else if (fmt == 0) {
            const uint8_t* u = c + row * k + cc;
            for (int j = 0; j < 4; ++j) out[j] = uint8_t(u[j] | (u[4 + j] << 4));
          } else {
            std::memcpy(out, c + row * k + cc, 4);
          }
        }
      }
      if (fmt == 5 && gi % 2 == 0) continue;  // (w8h: the pair's scales follow its second group)
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = t * 16 + r;
        const float s = row < n ? scales[row * ng + gi] : 0.0f;
        if (fmt == 0) {
          const uint16_t hs = armserve_conv::f32_to_f16(s);
          const uint16_t hz = armserve_conv::f32_to_f16(row < n ? szp[row * ng + gi] : 0.0f);
          std::memcpy(out + 2 * r, &hs, 2);
          std::memcpy(out + 32 + 2 * r, &hz, 2);
        } else if (fmt == 5) {
          const uint16_t h0 = armserve_conv::f32_to_f16(row < n ? scales[row * ng + gi - 1] : 0.0f);
          const uint16_t h1 = armserve_conv::f32_to_f16(s);
          std::memcpy(out + 2 * r, &h0, 2);
          std::memcpy(out + 32 + 2 * r, &h1, 2);
        } else {
          std::memcpy(out + 4 * r, &s, 4);
        }
      }
      out += 64;
    }
  }
}
}
