// Run-time choice of the kernel variant from the CPU's features (cpuid on x86, HWCAP on
// aarch64), overridable with ARMSERVE_ISA for testing, and the exported C entry points.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dense_gemm.h"
#include "kernels.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP_SVE
#define HWCAP_SVE (1 << 22)
#endif
#ifndef HWCAP2_SVE2
#define HWCAP2_SVE2 (1 << 1)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
#ifndef PR_SVE_GET_VL
#define PR_SVE_GET_VL 51
#endif
#endif

namespace {

CpuFeatures detect() {
  CpuFeatures f{};
#if defined(__x86_64__)
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.f16c = true;  // every AVX2 CPU has F16C; checked below through cpuid anyway
  unsigned a, b, c, d;
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(1), "c"(0));
  f.f16c = (c >> 29) & 1;
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  f.avx512_vnni = __builtin_cpu_supports("avx512vnni");
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(1));
  f.avx512_bf16 = f.avx512 && ((a >> 5) & 1);
  __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
  f.amx = (d >> 24) & 1;  // AMX-TILE
  f.amx_bf16 = (d >> 22) & 1;
#elif defined(__aarch64__) && defined(__linux__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  f.neon = true;  // AdvSIMD is mandatory on aarch64 Linux
  f.dotprod = hw & HWCAP_ASIMDDP;
  f.sve = hw & HWCAP_SVE;
  f.sve2 = hw2 & HWCAP2_SVE2;
  f.bf16 = hw2 & HWCAP2_BF16;
  f.i8mm = hw2 & HWCAP2_I8MM;
  if (f.sve) {
    const int vl = prctl(PR_SVE_GET_VL);
    if (vl > 0) f.sve_bits = (vl & 0xffff) * 8;
  }
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}

const KernelTable* best() {
  const CpuFeatures& f = features();
#if defined(__x86_64__)
  if (f.avx512) return armserve_table_avx512();
  if (f.avx2 && f.fma && f.f16c) return armserve_table_avx2();
#elif defined(__aarch64__)
  if (f.sve) return armserve_table_sve();
  return armserve_table_neon();
#endif
  (void)f;
  return armserve_table_scalar();
}

// Returns nullptr if `name` is unknown on this architecture or not supported by this CPU.
const KernelTable* by_name(const char* name, int* unsupported) {
  const CpuFeatures& f = features();
  *unsupported = 0;
  if (!std::strcmp(name, "scalar")) return armserve_table_scalar();
#if defined(__x86_64__)
  if (!std::strcmp(name, "avx2")) {
    if (f.avx2 && f.fma && f.f16c) return armserve_table_avx2();
    *unsupported = 1;
    return nullptr;
  }
  if (!std::strcmp(name, "avx512")) {
    if (f.avx512) return armserve_table_avx512();
    *unsupported = 1;
    return nullptr;
  }
#elif defined(__aarch64__)
  if (!std::strcmp(name, "neon")) return armserve_table_neon();
  if (!std::strcmp(name, "sve")) {
    if (f.sve) return armserve_table_sve();
    *unsupported = 1;
    return nullptr;
  }
#endif
  (void)f;
  return nullptr;
}

bool has_bf16_dot() {
  const CpuFeatures& f = features();
  return f.avx512_bf16 || f.bf16;
}

const KernelTable* g_table = nullptr;

const KernelTable* table() {
  if (!g_table) g_table = best();
  return g_table;
}

// Whether variant `t` computes bf16 natively on this CPU. A variant stands for the CPUs it is
// built for: forced to avx2 (or scalar) on an AVX512-BF16 machine, armserve behaves as on a CPU
// without bf16 instructions (no bf16 dot, dtype "auto" -> float32), so that CPU can be tested here.
bool variant_bf16(const KernelTable* t) {
  const CpuFeatures& f = features();
  if (!std::strcmp(t->name, "avx512")) return f.avx512_bf16 || f.amx;
  if (!std::strcmp(t->name, "neon") || !std::strcmp(t->name, "sve")) return f.bf16;
  return false;
}

int g_bf16_dot_wanted = -1;  // armserve_set_bf16_dot's last word; -1 until then: on where the CPU has one

}  // namespace

extern "C" {

int armserve_bf16_dot = 0;

const CpuFeatures* armserve_cpu() { return &features(); }

// Nonzero when the selected variant computes bf16 natively on this CPU (see variant_bf16).
int32_t armserve_native_bf16() { return variant_bf16(table()) ? 1 : 0; }

static void update_bf16_dot() {
  if (g_bf16_dot_wanted < 0) g_bf16_dot_wanted = has_bf16_dot() ? 1 : 0;
  armserve_bf16_dot = g_bf16_dot_wanted && variant_bf16(table()) ? 1 : 0;
}
static const bool g_bf16_dot_init = (update_bf16_dot(), true);  // for the variant picked at load

// Use the CPU's bf16 dot instruction in the skinny matmul (on = 1) or widen to fp32 (on = 0).
// Returns 0 on success, 2 if `on` and this CPU has no such instruction. The instruction is used
// only while the selected variant has it (avx512 with AVX512-BF16, neon/sve with BF16).
int32_t armserve_set_bf16_dot(int32_t on) {
  if (on && !has_bf16_dot()) return 2;
  g_bf16_dot_wanted = on ? 1 : 0;
  update_bf16_dot();
  return 0;
}

int32_t armserve_bf16_dot_wanted() { return g_bf16_dot_wanted > 0 ? 1 : 0; }

// Pick a variant: "" or "auto" = best for this CPU. Returns 0 on success, 1 if the name is
// unknown on this architecture, 2 if this CPU cannot run it.
int32_t armserve_select_isa(const char* name) {
  if (!name || !*name || !std::strcmp(name, "auto")) {
    g_table = best();
    update_bf16_dot();
    return 0;
  }
  int unsupported = 0;
  const KernelTable* t = by_name(name, &unsupported);
  if (!t) return unsupported ? 2 : 1;
  g_table = t;
  update_bf16_dot();
  return 0;
}

const char* armserve_isa() { return table()->name; }

// Space-separated names of the variants linked into this library, whether or not this CPU runs
// them (`armserve info`: a prebuilt wheel must carry every variant of its architecture).
const char* armserve_compiled_variants() {
  static const std::string names = [] {
#if defined(__x86_64__)
    const char* list[] = {armserve_table_scalar()->name, armserve_table_avx2()->name,
                          armserve_table_avx512()->name, armserve_dense_amx()->name};
#elif defined(__aarch64__)
    const char* list[] = {armserve_table_scalar()->name, armserve_table_neon()->name, armserve_table_sve()->name};
#else
    const char* list[] = {armserve_table_scalar()->name};
#endif
    std::string s;
    for (const char* n : list) s += (s.empty() ? "" : " ") + std::string(n);
    return s;
  }();
  return names.c_str();
}

// Space-separated list of the CPU features that matter to armserve.
void armserve_cpu_features(char* buf, int32_t n) {
  const CpuFeatures& f = features();
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (on) {
      if (!s.empty()) s += ' ';
      s += name;
    }
  };
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512, "avx512");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.avx512_vnni, "avx512_vnni");
  add(f.amx, "amx");
  add(f.amx_bf16, "amx_bf16");
  add(f.neon, "neon");
  add(f.dotprod, "dotprod");
  add(f.bf16, "bf16");
  add(f.i8mm, "i8mm");
  add(f.sve, "sve");
  add(f.sve2, "sve2");
  if (f.sve_bits) s += " sve_bits=" + std::to_string(f.sve_bits);
  std::snprintf(buf, n, "%s", s.c_str());
}

void armserve_rms_norm(int32_t dtype, void* out, const void* x, void* residual, const void* w, int64_t rows,
                       int64_t dim, float eps, float w_offset, int32_t heads, int64_t row_stride) {
  table()->rms_norm(dtype, out, x, residual, w, rows, dim, eps, w_offset, heads, row_stride);
}

void armserve_rotary(int32_t dtype, const int64_t* positions, void* q, void* k, const float* cos_sin,
                     int64_t tokens, int32_t nq, int32_t nk, int32_t head_dim, int32_t rot_dim, int32_t neox,
                     int64_t q_stride, int64_t k_stride) {
  table()->rotary(dtype, positions, q, k, cos_sin, tokens, nq, nk, head_dim, rot_dim, neox, q_stride, k_stride);
}

void armserve_act_and_mul(int32_t dtype, int32_t act, void* out, const void* x, int64_t rows, int64_t d) {
  table()->act_and_mul(dtype, act, out, x, rows, d);
}

void armserve_reshape_and_cache(int32_t dtype, const void* k, const void* v, void* k_cache, void* v_cache,
                                const int64_t* slots, int64_t tokens, int32_t hk, int32_t hd, int64_t src_stride,
                                int32_t bs) {
  table()->reshape_and_cache(dtype, k, v, k_cache, v_cache, slots, tokens, hk, hd, src_stride, bs);
}

void armserve_paged_attention(int32_t dtype, void* out, const void* q, const void* k_cache, const void* v_cache,
                              const AttnBatch* batch, int32_t hq, int32_t hk, int32_t hd, float scale,
                              int32_t sliding_window, float softcap, int64_t q_stride) {
  table()->paged_attention(dtype, out, q, k_cache, v_cache, batch, hq, hk, hd, scale, sliding_window, softcap,
                           q_stride);
}

void armserve_reshape_and_cache_i8(int32_t dtype, const void* k, const void* v, int8_t* k_cache, int8_t* v_cache,
                                   float* k_scale, float* v_scale, const int64_t* slots, int64_t tokens, int32_t hk,
                                   int32_t hd, int64_t src_stride, int32_t bs) {
  table()->reshape_and_cache_i8(dtype, k, v, k_cache, v_cache, k_scale, v_scale, slots, tokens, hk, hd, src_stride,
                                bs);
}

void armserve_paged_attention_i8(int32_t dtype, void* out, const void* q, const int8_t* k_cache,
                                 const int8_t* v_cache, const float* k_scale, const float* v_scale,
                                 const AttnBatch* batch, int32_t hq, int32_t hk, int32_t hd, float scale,
                                 int32_t sliding_window, float softcap, int64_t q_stride) {
  table()->paged_attention_i8(dtype, out, q, k_cache, v_cache, k_scale, v_scale, batch, hq, hk, hd, scale,
                              sliding_window, softcap, q_stride);
}

void armserve_encoder_attention(int32_t dtype, void* out, const void* qkv, const void* qkv_bias,
                                const int32_t* seq_lens, int32_t num_seqs, int32_t heads, int32_t hd, float scale,
                                int64_t qkv_stride) {
  table()->encoder_attention(dtype, out, qkv, qkv_bias, seq_lens, num_seqs, heads, hd, scale, qkv_stride);
}

void armserve_bias_gelu(int32_t dtype, void* x, const void* bias, int64_t rows, int64_t n, int64_t ld,
                        int32_t tanh_approx) {
  table()->bias_gelu(dtype, x, bias, rows, n, ld, tanh_approx);
}

void armserve_layer_norm(int32_t dtype, void* out, const void* x, const void* x_bias, const void* residual,
                         const void* w, const void* b, int64_t rows, int64_t n, float eps) {
  table()->layer_norm(dtype, out, x, x_bias, residual, w, b, rows, n, eps);
}

void armserve_gemv(int32_t dtype, void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k) {
  table()->gemv(dtype, out, x, w, m, n, k);
}

void armserve_lora_shrink(int32_t dtype, float* out, const void* x, const void* a, const int64_t* idx, int64_t t,
                          int64_t r, int64_t k, int64_t slots, int64_t ldx, int64_t ldo, int64_t a_slot,
                          int64_t a_row) {
  table()->lora_shrink(dtype, out, x, a, idx, t, r, k, slots, ldx, ldo, a_slot, a_row);
}

void armserve_lora_expand(int32_t dtype, void* y, const float* buf, const void* b, const int64_t* idx,
                          const float* scales, int64_t t, int64_t n, int64_t r, int64_t slots, int64_t ldy,
                          int64_t ldb, int64_t b_slot) {
  table()->lora_expand(dtype, y, buf, b, idx, scales, t, n, r, slots, ldy, ldb, b_slot);
}

}  // extern "C"
