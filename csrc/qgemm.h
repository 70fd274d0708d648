// Quantized linear layers: int4 (w4a8) and int8 (w8a8) weights times int8 activations that
// are quantized on the fly per token and per group of G input columns (the weight's group):
// one scale per 32 activations, as llama.cpp's Q8 activations: LLM activations have outlier
// channels, and a single per-token scale would spend the 8 bits on them.
// C ABI and the per-ISA table.
//
// Packed weight layout (built once at load by armserve/quantization/formats.py, `pack`):
//
//   W4: tiles of 16 output rows, each one contiguous run of bytes read front to back. Per tile,
//       per group of G input columns: G/8 chunks of 64 weight bytes, then 64 bytes of scales.
//       Chunk of columns k0..k0+7:
//         byte[r * 4 + j] = u[r][k0 + j] | u[r][k0 + 4 + j] << 4      (r < 16, j < 4)
//       so the low nibbles of a chunk are a 16 x 4 block of k0..k0+3 and the high nibbles the
//       block of k0+4..k0+7: one 64-byte vector feeds 16 rows of a 4-wide integer dot product
//       (VNNI vpdpbusd, NEON/SVE sdot). u is the unsigned 4-bit code, w = s * u - szp.
//       Scales: 16 float16 s, then 16 float16 szp (= s * zero point), subtracted times the group's
//       activation sum. With g = group index and c = global chunk index (k0 / 8), chunk c sits
//       at 64 * (c + g) bytes and group g's scales at 64 * ((g + 1) * G / 8 + g).
//       NOTE: one stream and float16 scales (0.625 bytes per weight at G = 32, not 0.75 with a
//       separate float32 scale array): decode is bound by the bytes it reads.
//   W8: tiles of 16 rows, same stream shape: per group, G/4 chunks of 64 bytes (4 columns each,
//       byte[r * 4 + j] = q[r][k0 + j], int8, w = s * q), then 16 float32 scales s (64 bytes;
//       float32 keeps GGUF Q6_K's d * sc exact). Chunk c of group g again at 64 * (c + g), the
//       scales at 64 * ((g + 1) * G / 4 + g). No offset correction is stored: x86 feeds VNNI's
//       unsigned operand |a| and flips the weight's sign where a < 0.
//   W5: GGUF Q5_0 as stored, 5.5 bits a weight (w8 held it in 9): w = s * (u - 16), u in 0..31,
//       G = 32 only. Tiles of 16 rows; per group 352 bytes: W4's 4 chunks of low nibbles (the
//       codes' bits 0-3, same byte order), then a 64-byte plane of their bit 4, then 16 float16 s.
//       Plane byte i (i = r * 4 + j, the chunk byte it goes with) holds in bit cl the bit 4 of
//       chunk cl's low-nibble code of byte i and in bit 4 + cl that of its high-nibble code, so a
//       kernel ORs ((plane << 4) >> cl) & 0x10 and (plane >> cl) & 0x10 into W4's two unpacked
//       vectors (per byte: no lane crosses). Group g at 352 * g, its plane at + 256, scales at + 320.
//       The GEMM sums u * a exactly in int32 and subtracts 16 * the group's activation sum, giving
//       the integer dot of (u - 16) and a that the W8 tiles of the same Q5_0 blocks computed, then
//       folds it with W8's float ops: bit for bit what the W8 path returned.
//   W6: GGUF Q6_K as stored, 6.625 bits a weight (w8 held it in 10): w = d * sc * (u - 32), u in
//       0..63, an int8 sub-scale sc per group of 16 columns and a float32 d (a float16 value) per
//       super-block of 256; k a multiple of 256. Tiles of 16 rows; per super-block 3392 bytes: its
//       16 groups of 192 bytes (W4's 2 chunks of low nibbles, then a 64-byte plane of bits 4-5), then
//       the sub-scales (16 bytes a group: one per row), then 16 float32 d. Plane byte i holds bits
//       4-5 of chunk cl's low-nibble code of byte i at bits 2cl..2cl+1 and of its high-nibble code at
//       4 + 2cl..5 + 2cl: W5's plane with 2 bits a code, so the kernels OR ((plane << 4) >> 2cl) & 0x30
//       and (plane >> 2cl) & 0x30 into W4's unpacked vectors. Group g (of 16) at 3392 * (g / 16) +
//       192 * (g % 16); its sub-scales at 3392 * (g / 16) + 3072 + 16 * (g % 16), d at + 3328.
//       s = d * sc is exact in float32 (11 by 8 significant bits): the W8 tiles of the same Q6_K
//       blocks stored it; with sum(u a) - 32 (code sum) the GEMM returns their outputs bit for bit.
//   W8H: W8 with float16 scales (GGUF Q8_0's d is one: 8.5 bits a weight, W8 took 9), for an even
//       number of groups: the scales of groups 2p and 2p + 1 share one 64-byte block after both
//       groups' chunks (16 float16 s of group 2p, then 16 of 2p + 1). Chunk c of group g at
//       64 * (c + g / 2), the scales of pair p at 64 * ((p + 1) * 2 * G / 4 + p). The same sums and
//       float ops as W8: bit for bit W8's outputs for the same codes and scales.
#pragma once
#include <cstdint>

#include "kernels.h"

extern "C" {

struct QKernelTable {  // member types from the exported functions (api.h)
  const char* name;
  decltype(&armserve_quantize_act) quantize_act;
  // W's N rows are padded to a multiple of 16 in the packed layout, scales inline.
  decltype(&armserve_gemm_w4) gemm_w4;
  decltype(&armserve_gemm_w8) gemm_w8;
  decltype(&armserve_gemm_w5) gemm_w5;
  decltype(&armserve_gemm_w6) gemm_w6;
  decltype(&armserve_gemm_w8h) gemm_w8h;
  decltype(&armserve_fused_moe) fused_moe;  // moe_impl.h: the experts' GEMMs and SiLU of this variant
  decltype(&armserve_qembedding) qembedding;  // rows of a packed table, dequantized (qgemm_impl.h)
  decltype(&armserve_gguf_embedding) gguf_embedding;  // rows of a GGUF table as stored (gguf_rows.h)
};

const QKernelTable* armserve_qtable_scalar();
#if defined(__x86_64__) || defined(_M_X64)
const QKernelTable* armserve_qtable_avx2();
const QKernelTable* armserve_qtable_avx512();  // needs AVX512-VNNI
#endif
#if defined(__aarch64__)
const QKernelTable* armserve_qtable_neon();  // needs the dotprod extension
const QKernelTable* armserve_qtable_neon_i8mm();  // dotprod + i8mm (SMMLA for prefill tiles)
const QKernelTable* armserve_qtable_sve();
#endif
}
