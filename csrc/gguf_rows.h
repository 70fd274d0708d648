// One row of a GGUF tensor as llama.cpp stores it (ggml-common.h's block structs, read for the bit
// positions only), dequantized to float32: the embedding lookups read a GGUF token table where the
// file's memory map has it (api.h, armserve_gguf_embedding), so the table is never copied.
//
// Each value comes out as the loader's conversion (armserve/quantization/gguf.py) followed by
// formats.py's `dequantize` computes it: the scale (d, or d * sc of a k-quant sub-block) in float32,
// then one multiply per weight, and for the 4-bit formats with an offset one subtract (no FMA: the
// build passes -ffp-contract=off). So a row is bit for bit the row of the float table the loader
// used to hold. Written once, portable; each qgemm_<isa>.cpp compiles it with its own flags.
#pragma once
#include <cstdint>
#include <cstring>

#include "float_conv.h"

namespace armserve {
namespace {

// ggml_type values (ggml.h) of the types read here.
enum GGUFType : int32_t {
  GGUF_F32 = 0,
  GGUF_F16 = 1,
  GGUF_Q4_0 = 2,
  GGUF_Q4_1 = 3,
  GGUF_Q5_0 = 6,
  GGUF_Q8_0 = 8,
  GGUF_Q4_K = 12,
  GGUF_Q6_K = 14,
  GGUF_BF16 = 30,
};

static inline float gguf_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return armserve_conv::f16_to_f32(h);
}

// Row `src` (k values, k a multiple of the type's block) into out [k]; false for a type not read here.
static bool gguf_row(int32_t type, const uint8_t* src, int64_t k, float* out) {
  switch (type) {
    case GGUF_F32:
      std::memcpy(out, src, k * 4);
      return true;
    case GGUF_F16:
      for (int64_t i = 0; i < k; ++i) out[i] = gguf_half(src + 2 * i);
      return true;
    case GGUF_BF16:
      for (int64_t i = 0; i < k; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = armserve_conv::bf16_to_f32(h);
      }
      return true;
    case GGUF_Q4_0:  // 32 per block: d, 16 bytes of nibbles (elements j and j + 16); w = u * d - 8 d
    case GGUF_Q4_1:  // 32 per block: d, m, 16 bytes of nibbles; w = u * d - (-m)
      for (int64_t b = 0; b < k / 32; ++b) {
        const bool q41 = type == GGUF_Q4_1;
        const uint8_t* p = src + b * (q41 ? 20 : 18);
        const float d = gguf_half(p), z = q41 ? -gguf_half(p + 2) : 8.0f * d;
        const uint8_t* q = p + (q41 ? 4 : 2);
        float* o = out + b * 32;
        for (int j = 0; j < 16; ++j) {
          o[j] = float(q[j] & 15) * d - z;
          o[j + 16] = float(q[j] >> 4) * d - z;
        }
      }
      return true;
    case GGUF_Q5_0:  // 32 per block: d, 32 fifth bits (little-endian uint32), 16 bytes of nibbles; w = (q - 16) d
      for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* p = src + b * 22;
        const float d = gguf_half(p);
        uint32_t qh;
        std::memcpy(&qh, p + 2, 4);
        const uint8_t* q = p + 6;
        float* o = out + b * 32;
        for (int j = 0; j < 16; ++j) {
          o[j] = float(int((q[j] & 15) | ((qh >> j) & 1) << 4) - 16) * d;
          o[j + 16] = float(int((q[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16) * d;
        }
      }
      return true;
    case GGUF_Q8_0:  // 32 per block: d, 32 int8; w = q d
      for (int64_t b = 0; b < k / 32; ++b) {
        const uint8_t* p = src + b * 34;
        const float d = gguf_half(p);
        const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
        for (int j = 0; j < 32; ++j) out[b * 32 + j] = float(q[j]) * d;
      }
      return true;
    case GGUF_Q4_K:  // 256 per block: d, dmin, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of nibbles
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t* p = src + b * 144;
        const float d = gguf_half(p), dmin = gguf_half(p + 2);
        const uint8_t *sc = p + 4, *q = p + 16;
        for (int sb = 0; sb < 8; ++sb) {  // sub-block of 32: the low (even) or high (odd) nibbles of 32 bytes
          const int scale = sb < 4 ? sc[sb] & 63 : (sc[sb + 4] & 15) | (sc[sb - 4] >> 6) << 4;
          const int mn = sb < 4 ? sc[sb + 4] & 63 : (sc[sb + 4] >> 4) | (sc[sb] >> 6) << 4;
          const float s = d * float(scale), z = dmin * float(mn);
          const uint8_t* qs = q + (sb / 2) * 32;
          const int shift = (sb & 1) * 4;
          float* o = out + b * 256 + sb * 32;
          for (int j = 0; j < 32; ++j) o[j] = float((qs[j] >> shift) & 15) * s - z;
        }
      }
      return true;
    case GGUF_Q6_K:  // 256 per block: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d
      for (int64_t b = 0; b < k / 256; ++b) {
        const uint8_t *p = src + b * 210, *ql = p, *qh = p + 128;
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        const float d = gguf_half(p + 208);
        float* o = out + b * 256;
        for (int h = 0; h < 2; ++h)      // halves of 128 values
          for (int run = 0; run < 4; ++run)  // 4 runs of 32: low/high nibbles of two 32-byte spans
            for (int j = 0; j < 32; ++j) {
              const int e = h * 128 + run * 32 + j;
              const uint8_t lo = ql[h * 64 + (run & 1) * 32 + j];
              const int u = (run < 2 ? lo & 15 : lo >> 4) | ((qh[h * 32 + j] >> (2 * run)) & 3) << 4;
              o[e] = float(u - 32) * (d * float(sc[e / 16]));
            }
      }
      return true;
    default:
      return false;
  }
}

}  // namespace
}  // namespace armserve
