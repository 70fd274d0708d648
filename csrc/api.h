// The library's C ABI, declared once: every exported function's signature is written here and
// nowhere else. The per-ISA tables (kernels.h, qgemm.h, dense_gemm.h) take their members' types
// from these declarations (decltype), step-graph replay (graph.cpp) unpacks recorded arguments
// by the declared parameter types, and Python (armserve/kernels/library.py) reads each
// function's argument types from `armserve_signature` (api.cpp): a signature changed here changes
// everywhere, and a definition that disagrees with it does not compile.
#pragma once
#include <cstdint>

extern "C" {

// Element types of activations, weights and KV cache.
enum ArmDType : int32_t { AS_F32 = 0, AS_BF16 = 1, AS_F16 = 2 };

// One step's attention layout, shared by every layer of the step (built once in Python).
// Token rows of the step: sequence s owns rows [q_start[s], q_start[s] + q_len[s]); its
// queries sit at positions context_len[s] - q_len[s] ... context_len[s] - 1 and attend to
// cache tokens [0, position] (or the last `sliding_window` of them).
struct AttnBatch {
  int32_t num_seqs;
  const int32_t* q_start;
  const int32_t* q_len;
  const int32_t* context_len;
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int32_t max_blocks;
  int32_t block_size;
};

struct GraphOp;  // graph.cpp

// ---- kernels, by the selected ISA variant (dispatch.cpp) ----------------------------------------
// out = norm(x (+ residual)) * (w + w_offset) for `rows` vectors of `dim`; with residual (contiguous
// vectors), residual <- x + residual first. x and out hold `heads` vectors per row, rows `row_stride`
// elements apart (heads = 1, row_stride = dim: contiguous; per-head q/k norms: rows of a fused qkv
// output, in place); vector i is at (i / heads) * row_stride + (i % heads) * dim.
void armserve_rms_norm(int32_t dtype, void* out, const void* x, void* residual, const void* w, int64_t rows,
                       int64_t dim, float eps, float w_offset, int32_t heads, int64_t row_stride);
// In place on q [T, nq*hd] and k [T, nk*hd] (rows `q_stride`/`k_stride` elements apart, so q and k
// may be views into a fused qkv output); cos_sin: [max_pos, rot_dim] float32 (cos | sin).
void armserve_rotary(int32_t dtype, const int64_t* positions, void* q, void* k, const float* cos_sin,
                     int64_t tokens, int32_t nq, int32_t nk, int32_t head_dim, int32_t rot_dim, int32_t neox,
                     int64_t q_stride, int64_t k_stride);
// x: [rows, 2d] = [gate | up] -> out [rows, d]; act 0 = silu, 1 = gelu (erf), 2 = gelu (tanh).
void armserve_act_and_mul(int32_t dtype, int32_t act, void* out, const void* x, int64_t rows, int64_t d);
// Copy this step's k/v rows ([T, hk*hd], rows `src_stride` elements apart) into cache slots;
// caches in the block layout of attention_impl.h (K tiles transposed), `bs` the block size.
void armserve_reshape_and_cache(int32_t dtype, const void* k, const void* v, void* k_cache, void* v_cache,
                                const int64_t* slots, int64_t tokens, int32_t hk, int32_t hd, int64_t src_stride,
                                int32_t bs);
// out: [T, hq*hd]; q rows `q_stride` elements apart; caches in the layout of attention_impl.h.
void armserve_paged_attention(int32_t dtype, void* out, const void* q, const void* k_cache, const void* v_cache,
                              const AttnBatch* batch, int32_t hq, int32_t hk, int32_t hd, float scale,
                              int32_t sliding_window, float softcap, int64_t q_stride);
// Quantize each (token, kv head) row of k/v symmetrically into int8 caches (attention_impl.h's
// layout) with float32 scales [blocks, hk, bs]: scale = absmax(row) / 127, q = round_half_even(x / scale).
void armserve_reshape_and_cache_i8(int32_t dtype, const void* k, const void* v, int8_t* k_cache, int8_t* v_cache,
                                   float* k_scale, float* v_scale, const int64_t* slots, int64_t tokens, int32_t hk,
                                   int32_t hd, int64_t src_stride, int32_t bs);
// paged_attention over int8 caches: scores are (q . k8) * k_scale, values weighted by p * v_scale.
void armserve_paged_attention_i8(int32_t dtype, void* out, const void* q, const int8_t* k_cache,
                                 const int8_t* v_cache, const float* k_scale, const float* v_scale,
                                 const AttnBatch* batch, int32_t hq, int32_t hk, int32_t hd, float scale,
                                 int32_t sliding_window, float softcap, int64_t q_stride);
// Bidirectional (encoder) attention: sequence s owns rows [sum of seq_lens before s, + seq_lens[s])
// of qkv ([T, 3 * heads * hd]: q, k, v heads side by side, rows `qkv_stride` elements apart) and
// each of its rows attends to all of them, no mask; out: [T, heads * hd] contiguous. qkv_bias
// (null, or [3 * heads * hd]) is added to the rows as they are read, rounded to dtype.
void armserve_encoder_attention(int32_t dtype, void* out, const void* qkv, const void* qkv_bias,
                                const int32_t* seq_lens, int32_t num_seqs, int32_t heads, int32_t hd, float scale,
                                int64_t qkv_stride);
// x[r] = gelu(x[r] + bias) in place for `rows` rows of n (rows `ld` elements apart, bias [n]);
// tanh_approx: GELU's tanh form. x + bias is rounded to dtype before the GELU.
void armserve_bias_gelu(int32_t dtype, void* x, const void* bias, int64_t rows, int64_t n, int64_t ld,
                        int32_t tanh_approx);
// out[r] = LayerNorm(x[r] + x_bias + residual[r]) * w + b over n columns (x, residual, out
// contiguous [rows, n]; x_bias, residual, b may be null), each sum rounded to dtype first.
void armserve_layer_norm(int32_t dtype, void* out, const void* x, const void* x_bias, const void* residual,
                         const void* w, const void* b, int64_t rows, int64_t n, float eps);
// Skinny matmul for decode: out [M, N] = x [M, K] @ w [N, K]^T, M small, x and w of one dtype;
// each weight row is read once per call as one sequential stream per thread.
void armserve_gemv(int32_t dtype, void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k);
// Batched LoRA (punica's shrink and expand; lora_impl.h). Token t uses adapter slot idx[t]; a slot
// outside [0, slots) (-1: the base model alone) means no adapter.
// shrink: out [t, r] float32 (rows `ldo` apart) = x [t, k] (dtype, rows `ldx` apart) @ a[idx[t]].T for
//         a [slots, r, k] of x's dtype (slots `a_slot` and rows `a_row` elements apart: a slice of
//         a fused layer's A); rows of tokens without an adapter are zeros.
void armserve_lora_shrink(int32_t dtype, float* out, const void* x, const void* a, const int64_t* idx, int64_t t,
                          int64_t r, int64_t k, int64_t slots, int64_t ldx, int64_t ldo, int64_t a_slot,
                          int64_t a_row);
// expand: y [t, n] (dtype, rows `ldy` apart) += scales[idx[t]] * buf [t, r] (float32, rows `ldb`
//         apart) @ b[idx[t]].T for b [slots, n, r] of y's dtype (slots `b_slot` elements apart, each
//         an [n, r] block); the sum in fp32, rounded once to y's dtype. Rows of tokens without an
//         adapter are not touched.
void armserve_lora_expand(int32_t dtype, void* y, const float* buf, const void* b, const int64_t* idx,
                          const float* scales, int64_t t, int64_t n, int64_t r, int64_t slots, int64_t ldy,
                          int64_t ldb, int64_t b_slot);

// ---- quantized linear layers (qdispatch.cpp; layouts in qgemm.h) --------------------------------
// x [M, K] (f32/bf16/f16) -> q int8 [M, K], scale [M, K / G] (group absmax / 127), gsum int32 [M, K / G].
void armserve_quantize_act(int32_t dtype, const void* x, int64_t m, int64_t k, int64_t group, int8_t* q,
                           float* scale, int32_t* gsum);
// out [M, N] (dtype, rows `ldo` elements apart) = the quantized activations times dequant(W)^T.
void armserve_gemm_w4(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo);
void armserve_gemm_w8(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const int8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo);
void armserve_gemm_w5(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo);  // group 32
void armserve_gemm_w6(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                      const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo);  // group 16
// (k / group even)
void armserve_gemm_w8h(int32_t dtype, void* out, const int8_t* q, const float* ascale, const int32_t* agsum,
                       const uint8_t* w, int64_t m, int64_t n, int64_t k, int64_t group, int64_t ldo);
// codes [n, k] (fmt 0 = w4: uint8 0..15, 1 = w8: int8, 3 = w5: uint8 0..31, group 32, 4 = w6: uint8
// 0..63, group 16, 5 = w8h: int8, scales float16 values, k / group even) and float32 scales
// [n, k / group] (w4: and szp, the same shape; w6: `szp` is d [n, k / 256], and scales / d are the
// int8 sub-scales) -> the packed tiles the GEMMs above read (formats.py `pack` is the reference),
// at load.
void armserve_pack_q(int32_t fmt, const void* codes, const float* scales, const float* szp, int64_t n, int64_t k,
                     int64_t group, void* packed);
// Token embedding rows of a quantized table held in the packed tiles above (fmt 0 = w4, 1 = w8,
// 3 = w5, 4 = w6, 5 = w8h; n rows, k columns, `group` columns per scale): out [m, k] (dtype) row i =
// dequant(W)[ids[i] - start], or zeros where ids[i] - start is outside [0, n) (a tensor-parallel
// rank's vocabulary share). Only the rows asked for are dequantized: w4 as float(u) * s - szp, w8 as
// float(q) * s (w5, w6: float(u - offset) * s), in float32, then rounded to dtype
// (what a float table dequantized from the same codes held). `exact`: null, or float32 [n, k / group, 2]
// (s, szp) replacing a w4 table's inline float16 scales (GGUF Q4_K's d * sc is not a float16 value).
void armserve_qembedding(int32_t fmt, int32_t dtype, void* out, const void* w, const float* exact,
                         const int64_t* ids, int64_t m, int64_t start, int64_t n, int64_t k, int64_t group);
// Token embedding rows of a GGUF table as the file stores it (e.g. where its memory map has it: the
// table is never copied): `type` is the ggml type (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 8 Q8_0,
// 12 Q4_K, 14 Q6_K, 30 BF16), row r of n at blocks + r * row_bytes, k values each. out [m, k] (dtype)
// row i = row ids[i] - start dequantized in float32 as armserve's loader converts such blocks
// (csrc/gguf_rows.h), then rounded to dtype; zeros where ids[i] - start is outside [0, n).
void armserve_gguf_embedding(int32_t type, int32_t dtype, void* out, const void* blocks, int64_t row_bytes,
                             const int64_t* ids, int64_t m, int64_t start, int64_t n, int64_t k);

// Mixture-of-Experts MLP of one layer (moe_impl.h): out [T, hidden] float32 = the sum over j < top_k
// of weights[t, j] * E_{ids[t, j]}(x[t]), with E(x) = down(silu(gate(x)) * up(x)). Per expert e,
// gate[e] and up[e] ([inter, hidden] each) and down[e] ([hidden, inter]) point at w4 (fmt 0), w8
// (fmt 1), w5 (fmt 3), w6 (fmt 4) or w8h (fmt 5) tiles of qgemm.h (groups group_gu and group_dn), or at bf16
// blocks packed for the dense GEMM (fmt 2, dense_gemm.h; x bf16): the first tile / block of that
// projection, which may lie inside a fused gate_up weight. inter a multiple of 16; ids in
// [0, num_experts); top_k <= 64.
// A token's expert outputs are rounded to `dtype` and added to its row in expert order (fp32),
// as the unfused layers and index_add_ do; a token's result never depends on the others routed.
void armserve_fused_moe(int32_t fmt, int32_t dtype, float* out, const void* x, int64_t tokens, int64_t hidden,
                        int64_t inter, int32_t top_k, const int64_t* ids, const float* weights, int32_t num_experts,
                        const void* const* gate, const void* const* up, const void* const* down, int64_t group_gu,
                        int64_t group_dn);

// ---- dense bf16 GEMM on prepacked weights (dense_dispatch.cpp; layout in dense_gemm.h) ----------
// out [m, n] (out_dtype AS_F32 or AS_BF16, rows `ldo` elements apart) = x [m, k] bf16 @ W^T.
void armserve_gemm_bf16(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n,
                        int64_t k, int64_t ldo);
// w [n, k] bf16 -> packed [ceil(n / 16)][ceil(k / 2)][16][2], zero-padded.
void armserve_pack_bf16(const void* w, int64_t n, int64_t k, void* packed);
// The same GEMM on quantized weights (the packed tiles of qgemm.h: fmt 0 = w4, 1 = w8, 3 = w5, 4 = w6, 5 = w8h, `group`
// columns per scale), dequantized to bf16 one column panel at a time, against bf16 activations:
// the prefill path of the quantized layers (the w4a8 / w8a8 GEMM keeps the few-row steps).
void armserve_gemm_q_bf16(int32_t fmt, int32_t out_dtype, void* out, const void* x, const void* wq, int64_t m,
                          int64_t n, int64_t k, int64_t group, int64_t ldo);
// ---- dense float32 GEMM on prepacked weights (the same driver and tiles, float32 layout) -------
// out [m, n] (out_dtype AS_F32 or AS_BF16, rows `ldo` elements apart) = x [m, k] float32 @ W^T.
void armserve_gemm_f32(int32_t out_dtype, void* out, const void* x, const void* packed, int64_t m, int64_t n,
                       int64_t k, int64_t ldo);
// w [n, k] float32 -> packed [ceil(n / 16)][ceil(k / 2)][2][16] (k-pair p: the 16 columns at
// k = 2p, then at 2p + 1), zero-padded.
void armserve_pack_f32(const void* w, int64_t n, int64_t k, void* packed);

// ---- small ops a recorded step needs besides the kernels (graph.cpp) ----------------------------
void armserve_add_bias(int32_t dtype, void* out, int32_t bias_dtype, const void* bias, int64_t rows, int64_t n,
                       int64_t ldo);
void armserve_mul_cols(int32_t dtype, void* x, const float* mul, int64_t rows, int64_t n, int64_t ld);
void armserve_embedding(void* out, const void* table, const int64_t* ids, int64_t m, int64_t row_bytes);
void armserve_cast(int32_t src_dtype, const void* src, int32_t dst_dtype, void* dst, int64_t n);
void armserve_argmax(const float* x, int64_t rows, int64_t n, int64_t ld, int64_t* out);

// ---- step graphs (graph.cpp) ----------------------------------------------------------------------
int32_t armserve_graph_kind(const char* name);  // -1: not recordable
int32_t armserve_graph_op_size();
int64_t armserve_graph_run(const GraphOp* ops, int64_t n);  // index of an unknown op, or -1
int64_t armserve_graph_team_replays();  // replays that ran as one parallel region of several threads

// ---- variants, CPU, threads (dispatch.cpp, qdispatch.cpp, dense_dispatch.cpp, threads.cpp) -------
int32_t armserve_select_isa(const char* name);  // 0 ok, 1 unknown name, 2 this CPU cannot run it
const char* armserve_isa();
const char* armserve_compiled_variants();  // every variant linked in, space-separated
const char* armserve_qgemm_isa();
const char* armserve_dense_isa();
const char* armserve_dense_f32_isa();
void armserve_cpu_features(char* buf, int32_t n);
int32_t armserve_set_bf16_dot(int32_t on);  // 0 ok, 2 this CPU has no bf16 dot instruction
int32_t armserve_bf16_dot_wanted();          // the last armserve_set_bf16_dot (default: the CPU has one)
int32_t armserve_native_bf16();
int32_t armserve_set_amx(int32_t on);  // 0 ok, 2 no AMX-BF16 here (CPU, or Linux refused its tile data)
int32_t armserve_amx_wanted();         // the last armserve_set_amx (default 1)
int32_t armserve_bind_threads(const int32_t* cores, int32_t n);
int32_t armserve_thread_cores(int32_t* out, int32_t max);
int32_t armserve_openmp_library(char* buf, int32_t n);

// ---- tensor-parallel collectives over a shared-memory region (shm_comm.cpp) ----------------------
// Ops are numbered 1, 2, ... (`seq`), the same on every rank; each returns 0, or 1 when another rank
// aborted the group (armserve_shm_abort), 2 when the data does not fit a slot.
int64_t armserve_shm_header_bytes(int32_t world);  // the slots start this far into the region
int32_t armserve_shm_barrier(void* shm, int32_t rank, int32_t world, int64_t seq);
void armserve_shm_abort(void* shm, int32_t world);
// In place: data <- the sum over ranks of every rank's data (n elements of ArmDType dtype; 16-bit
// types summed in float32, rounded once).
int32_t armserve_shm_allreduce(void* shm, int32_t rank, int32_t world, int64_t slot_bytes, int64_t seq, int32_t dtype,
                               void* data, int64_t n);

// ---- the ABI described at run time (api.cpp) -----------------------------------------------------
const char* armserve_exports();  // comma-separated names of everything Python binds
// "r:a1a2..." for an exported function: return and argument types, one letter each (v void,
// i int32, l int64, f float, d double, s char pointer, P any other pointer); nullptr if unknown.
const char* armserve_signature(const char* name);
}

// Functions a step graph may record, in GraphKind order (graph.cpp).
#define ARMSERVE_RECORDABLE(X)                                                                                 \
  X(armserve_rms_norm)                                                                                         \
  X(armserve_rotary)                                                                                           \
  X(armserve_act_and_mul)                                                                                      \
  X(armserve_reshape_and_cache)                                                                                \
  X(armserve_paged_attention)                                                                                  \
  X(armserve_reshape_and_cache_i8)                                                                             \
  X(armserve_paged_attention_i8)                                                                               \
  X(armserve_gemv)                                                                                             \
  X(armserve_quantize_act)                                                                                     \
  X(armserve_gemm_w4)                                                                                          \
  X(armserve_gemm_w8)                                                                                          \
  X(armserve_add_bias)                                                                                         \
  X(armserve_mul_cols)                                                                                         \
  X(armserve_embedding)                                                                                        \
  X(armserve_cast)                                                                                             \
  X(armserve_gemm_bf16)                                                                                        \
  X(armserve_gemm_f32)                                                                                         \
  X(armserve_lora_shrink)                                                                                      \
  X(armserve_lora_expand)                                                                                      \
  X(armserve_qembedding)                                                                                       \
  X(armserve_gguf_embedding)                                                                                   \
  X(armserve_gemm_w5)                                                                                          \
  X(armserve_gemm_w6)                                                                                          \
  X(armserve_gemm_w8h)

// Everything Python binds (armserve/kernels/library.py asks for this list and each signature).
#define ARMSERVE_EXPORTS(X)                                                                                    \
  ARMSERVE_RECORDABLE(X)                                                                                       \
  X(armserve_pack_bf16)                                                                                        \
  X(armserve_pack_f32)                                                                                         \
  X(armserve_pack_q)                                                                                           \
  X(armserve_gemm_q_bf16)                                                                                      \
  X(armserve_fused_moe)                                                                                        \
  X(armserve_argmax)                                                                                           \
  X(armserve_encoder_attention)                                                                                \
  X(armserve_bias_gelu)                                                                                        \
  X(armserve_layer_norm)                                                                                       \
  X(armserve_graph_kind)                                                                                       \
  X(armserve_graph_op_size)                                                                                    \
  X(armserve_graph_run)                                                                                        \
  X(armserve_select_isa)                                                                                       \
  X(armserve_isa)                                                                                              \
  X(armserve_compiled_variants)                                                                                \
  X(armserve_qgemm_isa)                                                                                        \
  X(armserve_dense_isa)                                                                                        \
  X(armserve_dense_f32_isa)                                                                                    \
  X(armserve_cpu_features)                                                                                     \
  X(armserve_set_bf16_dot)                                                                                     \
  X(armserve_bf16_dot_wanted)                                                                                  \
  X(armserve_native_bf16)                                                                                      \
  X(armserve_set_amx)                                                                                          \
  X(armserve_amx_wanted)                                                                                       \
  X(armserve_bind_threads)                                                                                     \
  X(armserve_thread_cores)                                                                                     \
  X(armserve_openmp_library)                                                                                    \
  X(armserve_shm_header_bytes)                                                                                 \
  X(armserve_shm_barrier)                                                                                      \
  X(armserve_shm_abort)                                                                                        \
  X(armserve_shm_allreduce)
