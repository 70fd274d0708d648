"""Predicted speed of armserve's hot loops on Arm Neoverse N1, V1 and V2 (and x86 as the check), from
LLVM's machine-code analyser: no ARM machine needed.

For each hot kernel this compiles the kernel's source with the wheel's own flags (csrc/build.py's
VARIANTS) to assembly, finds the kernel's innermost loop (by the number of its work instructions:
e.g. the 16 BFDOTs of a 4-row dense tile step), runs `llvm-mca` on it for each core, and turns the
cycles per iteration into GFLOP/s (GOP/s for int8, GB/s for the memory-bound row kernels) per core
at each server's clock. llvm-mca assumes every load hits L1: these are compute ceilings of the loop
as compiled, not of the memory (docs/arm.md puts them beside the bandwidth roofline).

    apt-get install -y llvm-19 g++-aarch64-linux-gnu   # llvm-mca-19 (Neoverse V2 needs LLVM >= 17)
    python3 benchmarks/arm_model.py             # the ARM table
    python3 benchmarks/arm_model.py --x86       # plus this machine's AVX2 / Zen 4's AVX-512 loops
    python3 benchmarks/arm_model.py --show dense_bfdot_1  # one loop's assembly and llvm-mca report

Every loop is identified by its function (a regex on the demangled name; the loop may be inlined into
its callers, any copy will do) and by how many work instructions one iteration holds, so a changed
loop shape is reported as "loop not found" rather than silently modelling another loop.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "csrc"))

import build  # noqa: E402  (csrc/build.py: the flags the wheel is built with)

MCA = "llvm-mca-19"


@dataclass(frozen=True)
class Core:
    """A core llvm-mca models, and the servers built on it: (name, GHz) with the clock's source in docs/arm.md."""

    name: str
    triple: str
    mcpu: str
    arch: str  # build.py's VARIANTS key
    servers: tuple[tuple[str, float], ...]
    sve_bits: int = 0


N1 = Core("Neoverse N1", "aarch64", "neoverse-n1", "aarch64", (("Graviton2", 2.5), ("Altra", 3.0)))
V1 = Core("Neoverse V1", "aarch64", "neoverse-v1", "aarch64", (("Graviton3", 2.6),), 256)
V2 = Core("Neoverse V2", "aarch64", "neoverse-v2", "aarch64", (("Graviton4", 2.8), ("Grace", 3.1)), 128)
ZEN3 = Core("Zen 3 (this machine)", "x86_64", "znver3", "x86_64", (("this VM", 0.0),))  # per cycle, measured
ZEN4 = Core("Zen 4", "x86_64", "znver4", "x86_64", (("EPYC 9654 (3.7 GHz boost)", 3.7),))


@dataclass(frozen=True)
class Loop:
    """One hot loop: where it is compiled from, how to find it, and what one iteration computes."""

    key: str  # short id (--show)
    kernel: str  # what armserve calls it
    cores: tuple[Core, ...]  # the cores whose dispatch runs this variant (dispatch.cpp, *_dispatch.cpp)
    src: str  # csrc/ file, compiled with its VARIANTS flags
    func: str  # regex on the demangled name of a function holding the loop
    insn: str  # regex on the work instruction's mnemonic
    count: int  # work instructions in one iteration: which of the function's loops it is
    work: float  # FLOPs (int ops, bytes) of one iteration
    unit: str = "GFLOP/s"
    note: str = ""
    peak: str = ""  # PEAKS key: the instruction whose modelled peak the loop is measured against


# The instructions' peaks, modelled the same way: 16 independent copies per block (no chain), the
# work of one (fp32 FLOPs or int8 ops); SVE's at 256 bits, scaled to the core's vector length.
PEAKS = {
    "fmla": ("fmla v{d}.4s, v30.4s, v31.s[0]", 8),
    "bfdot": ("bfdot v{d}.4s, v30.8h, v31.2h[0]", 16),
    "bfmmla": ("bfmmla v{d}.4s, v30.8h, v31.8h", 32),
    "sdot": ("sdot v{d}.4s, v30.16b, v31.16b", 32),
    "smmla": ("smmla v{d}.4s, v30.16b, v31.16b", 64),
    "sve_sdot": ("sdot z{d}.s, z30.b, z31.b", 64),
    "vfmadd": ("vfmadd231ps %ymm14, %ymm15, %ymm{d}", 16),
}


# Work per iteration, written out from the loop's source (the `count` check keeps them honest):
# dense tile<R, 1> step: R rows x 16 columns x (4 k: BFDOT's 4 pairs / NEON's 2 pairs unrolled twice) x 2.
# SDOT (4 lanes x 4 bytes x 2) = 32 ops, SMMLA (2 x 2 x 8 x 2) = 64, SVE-256 SDOT = 64.
LOOPS = [
    # ---- dense bf16 / f32 GEMM tiles (dense_gemm_neon.h; the sve variant compiles the same tiles) ----
    Loop("dense_bf16_1", "dense bf16 GEMM m=1, widening FMLA", (N1,), "dense_gemm_neon.cpp",
         r"NeonP<false>::tile<1, 1>", r"fmla", 16, 1 * 16 * 4 * 2, peak="fmla"),
    # m >= 3 tiles run their sums in passes (dense_gemm_neon.h: one summation order for every tile
    # shape): the loop modelled is the first pass's, the others alike, each with its share of the work
    Loop("dense_bf16_4", "dense bf16 GEMM m>=4, widening FMLA (2 passes)", (N1,), "dense_gemm_neon.cpp",
         r"NeonP<false>::tile<4, 1>", r"fmla", 32, 4 * 16 * 2 * 2, peak="fmla"),
    Loop("dense_bfdot_1", "dense bf16 GEMM m=1, BFDOT", (V1, V2), "dense_gemm_sve.cpp",
         r"NeonBf16P::pass<1, 1, 4, 0>", r"bfdot", 16, 1 * 16 * 8 * 2, peak="bfdot"),
    Loop("dense_bfdot_4", "dense bf16 GEMM m>=4, BFDOT (4 passes)", (V1, V2), "dense_gemm_sve.cpp",
         r"NeonBf16P::pass<4, 1, 1, 0>", r"bfdot", 16, 4 * 16 * 2 * 2, peak="bfdot"),
    Loop("dense_f32_4", "dense f32 GEMM m>=4, FMLA (2 passes)", (N1,), "dense_gemm_neon.cpp",
         r"NeonP<true>::tile<4, 1>", r"fmla", 32, 4 * 16 * 2 * 2, peak="fmla"),
    Loop("dense_f32_4s", "dense f32 GEMM m>=4, FMLA (2 passes)", (V1, V2), "dense_gemm_sve.cpp",
         r"NeonP<true>::tile<4, 1>", r"fmla", 32, 4 * 16 * 2 * 2, peak="fmla"),
    # ---- w4a8 / w8a8 (qgemm_*.cpp): per 64-byte chunk step, 16 weight rows x 8 (w4) / 4 (w8) columns ----
    Loop("w4a8_neon_1", "w4a8 GEMM 1 token, SDOT", (N1, V2), "qgemm_neon.cpp",
         r"QNeon>::tile_rows<true>", r"sdot", 8, 16 * 8 * 1 * 2, "GOP/s", peak="sdot"),
    Loop("w4a8_neon_4", "w4a8 GEMM 4 tokens, SDOT", (N1,), "qgemm_neon.cpp",
         r"QNeon>::tile_rows<true>", r"sdot", 32, 16 * 8 * 4 * 2, "GOP/s", peak="sdot"),
    Loop("w4a8_mmla_4", "w4a8 GEMM 4 tokens, SMMLA", (V2,), "qgemm_neon.cpp",
         r"QNeonI8mm::tile4_mmla<true>", r"smmla", 8, 8 * 8 * 4 * 2, "GOP/s", peak="smmla"),
    Loop("w4a8_sve_1", "w4a8 GEMM 1 token, SVE SDOT", (V1,), "qgemm_sve.cpp",
         r"QSve>::tile_rows<true>", r"sdot", 4, 2 * 32 * 2 * 1 * 2, "GOP/s",
         "256-bit SVE: 2 x 32 bytes a step", peak="sve_sdot"),
    Loop("w4a8_sve_4", "w4a8 GEMM 4 tokens, SVE SDOT", (V1,), "qgemm_sve.cpp",
         r"QSve>::tile_rows<true>", r"sdot", 8, 32 * 2 * 4 * 2, "GOP/s",
         "256-bit SVE: 32 bytes a step", peak="sve_sdot"),
    Loop("w8a8_neon_1", "w8a8 GEMM 1 token, SDOT", (N1, V2), "qgemm_neon.cpp",
         r"QNeon>::tile_rows<false>", r"sdot", 4, 16 * 4 * 1 * 2, "GOP/s", peak="sdot"),
    Loop("w8a8_neon_4", "w8a8 GEMM 4 tokens, SDOT", (N1,), "qgemm_neon.cpp",
         r"QNeon>::tile_rows<false>", r"sdot", 16, 16 * 4 * 4 * 2, "GOP/s", peak="sdot"),
    Loop("w8a8_mmla_4", "w8a8 GEMM 4 tokens, SMMLA", (V2,), "qgemm_neon.cpp",
         r"QNeonI8mm::tile4_mmla<false>", r"smmla", 8, 8 * 8 * 4 * 2, "GOP/s", peak="smmla"),
    Loop("w8a8_sve_1", "w8a8 GEMM 1 token, SVE SDOT", (V1,), "qgemm_sve.cpp",
         r"QSve>::tile_rows<false>", r"sdot", 2, 2 * 32 * 1 * 2, "GOP/s",
         "256-bit SVE: 2 x 32 bytes a step", peak="sve_sdot"),
    Loop("w8a8_sve_4", "w8a8 GEMM 4 tokens, SVE SDOT", (V1,), "qgemm_sve.cpp",
         r"QSve>::tile_rows<false>", r"sdot", 4, 32 * 4 * 2, "GOP/s", "256-bit SVE", peak="sve_sdot"),
    # ---- paged attention, bf16 cache, 4 query rows (a GQA group of 4: Llama-3.1-8B decode; prefill
    # tiles are 4 rows too on ARM, RB): per head-dim pair (scores) / key pair (values) x 16 ----
    Loop("attn_qk_n1", "attention q.K, widening FMLA", (N1,), "kernels_neon.cpp",
         r"Attention<.*>::scores<1, 4>", r"fmla", 32, 4 * 16 * 2 * 2, peak="fmla"),
    Loop("attn_qk", "attention q.K, BFDOT", (V1, V2), "kernels_sve.cpp",
         r"scores_bf16_dot<4>", r"bfdot", 16, 4 * 16 * 2 * 2, peak="bfdot"),
    Loop("attn_pv", "attention p.V, BFDOT", (V1, V2), "kernels_sve.cpp",
         r"values_bf16_dot<4>", r"bfdot", 16, 4 * 16 * 2 * 2, peak="bfdot"),
    # ---- row kernels, bf16 rows: bytes read + written per iteration (16 elements) ----
    Loop("rmsnorm1_n", "RMSNorm pass 1 (x + residual, sum of squares), bf16", (N1,), "kernels_neon.cpp",
         r"rms_norm_row<1>", r"fadd", 8, 16 * 2 * 3, "GB/s"),
    Loop("rmsnorm1_s", "RMSNorm pass 1 (x + residual, sum of squares), bf16", (V1, V2), "kernels_sve.cpp",
         r"rms_norm_row<1>", r"fadd", 8, 16 * 2 * 3, "GB/s"),
    Loop("rmsnorm2_n", "RMSNorm pass 2 (scale, round, times weight), bf16", (N1,), "kernels_neon.cpp",
         r"rms_norm_row<1>", r"ushr|fmul", 20, 16 * 2 * 3, "GB/s"),
    Loop("rmsnorm2_s", "RMSNorm pass 2 (scale, round, times weight), bf16", (V1, V2), "kernels_sve.cpp",
         r"rms_norm_row<1>", r"ushr|fmul", 20, 16 * 2 * 3, "GB/s"),
    Loop("silu_n", "SiLU-and-mul, bf16", (N1,), "kernels_neon.cpp",
         r"silu_and_mul_row<1>", r"frecps", 12, 16 * 2 * 3, "GB/s"),
    Loop("silu_s", "SiLU-and-mul, bf16", (V1, V2), "kernels_sve.cpp",
         r"silu_and_mul_row<1>", r"frecps", 12, 16 * 2 * 3, "GB/s"),
    Loop("rotary_n", "rotary (NeoX), fp32 rotation loop", (N1,), "kernels_neon.cpp",
         r"Kernels<.*>::rotary", r"fmul", 4, 8, "Gelem/s", "4 pairs a step; the bf16 load/store loops aside"),
    Loop("rotary_s", "rotary (NeoX), fp32 rotation loop", (V1, V2), "kernels_sve.cpp",
         r"Kernels<.*>::rotary", r"fmul", 4, 8, "Gelem/s", "4 pairs a step; the bf16 load/store loops aside"),
]
# The fused MoE (moe_impl.h) has no loop of its own: its experts run the w4a8 / w8a8 tiles above
# (QKernels::tile_rows) or the dense tiles (DenseTable::cols), and SiLU-and-mul between them.

# The x86 check: this machine's AVX2 loops (znver3) and Zen 4's AVX-512 ones.
X86_LOOPS = [
    # (a 5-row bf16 tile takes its even-k and odd-k sums in 2 passes: the first pass's loop, each half the work)
    Loop("x_dense_bf16", "dense bf16 GEMM m>=5, AVX2 widening FMA (2 passes)", (ZEN3,), "dense_gemm_avx2.cpp",
         r"Avx2<false>::(run|pass)<5, 1, false", r"vfmadd\w+", 10, 5 * 16 * 1 * 2, peak="vfmadd"),
    Loop("x_dense_f32", "dense f32 GEMM m>=5, AVX2 FMA", (ZEN3,), "dense_gemm_avx2.cpp",
         r"Avx2<true>::(run|pass)<5, 1, false", r"vfmadd\w+", 20, 5 * 16 * 2 * 2, peak="vfmadd"),
    Loop("x_w4a8", "w4a8 GEMM 4 tokens, AVX2 vpmaddubsw", (ZEN3,), "qgemm_avx2.cpp",
         r"QAvx2>::tile_rows<true>", r"vpmaddubsw", 16, 16 * 8 * 4 * 2, "GOP/s"),
    Loop("x_w8a8", "w8a8 GEMM 4 tokens, AVX2 vpmaddubsw", (ZEN3,), "qgemm_avx2.cpp",
         r"QAvx2>::tile_rows<false>", r"vpmaddubsw", 8, 16 * 4 * 4 * 2, "GOP/s"),
    Loop("x_dense_bf16_512", "dense bf16 GEMM m>=6, AVX512-BF16 vdpbf16ps", (ZEN4,), "dense_gemm_avx512.cpp",
         r"Avx512Bf16::run<6, 4, false>", r"vdpbf16ps", 24, 6 * 64 * 2 * 2),
    Loop("x_dense_f32_512", "dense f32 GEMM m>=4, AVX-512 FMA", (ZEN4,), "dense_gemm_avx512.cpp",
         r"Avx512<true>::(run|pass)<4, 4, false", r"vfmadd\w+", 32, 4 * 64 * 2 * 2),
]


# ---- assembly: functions and their innermost loops ----------------------------------------------------

def compile_asm(src: str, arch: str, workdir: str) -> str:
    """`src` compiled to assembly with the wheel's flags for `arch` (build.py)."""
    flags = dict(build.VARIANTS[arch])[src]
    cxx = "aarch64-linux-gnu-g++" if arch == "aarch64" else "g++"
    out = os.path.join(workdir, f"{arch}-{src}.s")
    if not os.path.exists(out):
        subprocess.check_call([cxx, *build.COMMON, *flags, "-I", os.path.join(REPO, "csrc"), "-S",
                               os.path.join(REPO, "csrc", src), "-o", out])
    return out


def functions(asm_path: str) -> dict[str, list[str]]:
    """Demangled function name -> its lines."""
    lines = open(asm_path).read().splitlines()
    starts = [(i, ln[:-1]) for i, ln in enumerate(lines) if re.match(r"^[A-Za-z_][\w.$]*:$", ln)]
    names = subprocess.run(["c++filt"], input="\n".join(n for _, n in starts), capture_output=True, text=True,
                           check=True).stdout.splitlines()
    out = {}
    for (i, _), name, nxt in zip(starts, names, starts[1:] + [(len(lines), "")]):
        out[name] = lines[i + 1:nxt[0]]
    return out


BRANCH = re.compile(r"^\s+(b[\w.]*|cbn?z|tbn?z|j\w+)\s+(.*,\s*)?(\.L\w+)\s*$")


def innermost_loops(body: list[str]) -> list[list[str]]:
    """Each loop with no loop inside it: a label and the last backward branch to it, their lines."""
    labels = {ln[:-1]: i for i, ln in enumerate(body) if re.match(r"^\.L\w+:$", ln)}
    spans = {}
    for i, ln in enumerate(body):
        m = BRANCH.match(ln)
        if m and m.group(3) in labels and labels[m.group(3)] < i:
            spans[labels[m.group(3)]] = i
    spans = sorted(spans.items())
    inner = [(a, b) for a, b in spans if not any(a < c and d <= b and (c, d) != (a, b) for c, d in spans)]
    return [body[a:b + 1] for a, b in inner]


def instructions(lines: list[str]) -> list[str]:
    """The instruction lines (no labels, directives or comments: `//` on aarch64, `#` in AT&T x86)."""
    out = []
    for ln in lines:
        s = ln.split("//")[0] if "//" in ln or not ln.lstrip().startswith("#") else ""
        s = s.rstrip()
        t = s.strip()
        if t and not t.endswith(":") and not t.startswith((".", "#")):
            out.append(s)
    return out


def find_loop(loop: Loop, asm_path: str) -> list[str] | None:
    """The loop's instructions: an innermost loop of a matching function with `count` work instructions."""
    pat = re.compile(loop.func)
    insn = re.compile(rf"^\s*({loop.insn})\b")
    for name, body in functions(asm_path).items():
        if not pat.search(name):
            continue
        for lp in innermost_loops(body):
            ins = instructions(lp)
            if sum(1 for x in ins if insn.match(x)) == loop.count:
                return ins
    return None


# ---- llvm-mca ------------------------------------------------------------------------------------------

@dataclass
class Mca:
    cycles: float  # per iteration, simulated (loop-carried dependencies included)
    rthroughput: float  # per iteration, from resources and dispatch alone
    insns: int
    bottleneck: str
    report: str


def run_mca(core: Core, ins: list[str], iterations: int = 200) -> Mca:
    text = "\n".join(ins) + "\n"
    r = subprocess.run([MCA, f"-mtriple={core.triple}", f"-mcpu={core.mcpu}", f"-iterations={iterations}",
                        "-bottleneck-analysis"], input=text, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[0] if r.stderr.strip() else "llvm-mca failed")
    out = r.stdout
    total = float(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    rtp = float(re.search(r"Block RThroughput:\s+([\d.]+)", out).group(1))
    cycles = total / iterations
    return Mca(cycles, rtp, len(ins), bottleneck(out, cycles, rtp, len(ins), core), out)


def resource_pressure(out: str) -> dict[str, float]:
    """Resource -> cycles per iteration, from llvm-mca's 'Resource pressure per iteration' table."""
    m = re.search(r"Resources:\n(.*?)\n\n.*?Resource pressure per iteration:\n(.*?)\n(.*?)\n", out, re.S)
    if not m:
        return {}
    names = {}
    for ln in m.group(1).splitlines():
        mm = re.match(r"\[([\w.]+)\]\s+-\s+(\S+)", ln.strip())
        if mm:
            names[mm.group(1)] = mm.group(2)
    cols = re.findall(r"\[([\w.]+)\]", m.group(2))
    vals = m.group(3).split()
    return {names.get(c, c): (0.0 if v == "-" else float(v)) for c, v in zip(cols, vals)}


def bottleneck(out: str, cycles: float, rtp: float, n: int, core: Core) -> str:
    """What sets the pace: a dependency chain when the simulation is well above the resource bound, else
    the busiest resource (pipes) or the dispatch width."""
    pressure = resource_pressure(out)
    top = max(pressure.items(), key=lambda kv: kv[1]) if pressure else ("?", 0.0)
    if cycles > 1.15 * rtp:
        return f"dependency chain ({cycles:.1f} cy vs {rtp:.1f} from resources)"
    width = re.search(r"Dispatch Width:\s+(\d+)", out)
    if width and n / int(width.group(1)) >= top[1] - 0.01:
        return f"dispatch ({n} insns / {width.group(1)} wide)"
    busy = sorted((k for k, v in pressure.items() if v >= top[1] - 0.01), key=str)
    return f"{'/'.join(busy)} ({top[1]:.1f} cy)"


# ---- the table -------------------------------------------------------------------------------------------

CLOCK_SRC = """
long chain(long n) {  /* 4 n dependent integer adds: 1 cycle each on every x86 core since the Pentium 4 */
  long x = 0;
  for (long i = 0; i < n; ++i) __asm__ volatile("add $1,%0\\n\\tadd $1,%0\\n\\tadd $1,%0\\n\\tadd $1,%0" : "+r"(x));
  return x;
}
"""


def x86_measured(workdir: str, slices: int = 15) -> dict[str, tuple[float, float]]:
    """This machine's work per cycle of the x86 loops' kernels, one thread, operands in cache (what llvm-mca
    models): key -> (best, median) over `slices` slices. The machine is shared, so each slice times the
    kernel and then a chain of dependent adds, and their ratio cancels the share of the core the process got."""
    import ctypes
    import statistics
    import time

    import torch

    from armserve import kernels
    from armserve.quantization import pack, quantize_weight

    so = os.path.join(workdir, "chain.so")
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-x", "c", "-", "-o", so], input=CLOCK_SRC, text=True, check=True)
    chain = ctypes.CDLL(so).chain
    chain.argtypes = [ctypes.c_long]
    torch.set_num_threads(1)
    kernels.select_isa("avx2")  # the loops modelled, whatever else the CPU has
    m, n, k = 400, 128, 256  # weights (64 / 128 KiB) and activations (200 / 400 KiB) in L2, a panel in L1
    w = torch.randn(n, k)
    x = torch.randn(m, k)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    pb, pf = kernels.pack_bf16(w.bfloat16()), kernels.pack_f32(w)
    p4 = pack(quantize_weight(w, 32, False))
    xb = x.bfloat16()
    acts = kernels.quantize_act(xb, 32)  # (once: the activations' quantization is not the modelled loop)
    calls = {
        "x_dense_bf16": lambda: kernels.gemm_bf16(xb, pb, n, k, out=out),
        "x_dense_f32": lambda: kernels.gemm_f32(x, pf, n, k),
        "x_w4a8": lambda: kernels.qgemm("w4", out, 0, acts, p4, n, 32),
    }
    res = {}
    for key, fn in calls.items():
        fn()
        ratios = []
        for _ in range(slices):
            t0 = time.perf_counter()
            reps = 0
            while time.perf_counter() - t0 < 0.1:
                fn()
                reps += 1
            flops = 2.0 * m * n * k * reps / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            chain(25_000_000)
            hz = 1e8 / (time.perf_counter() - t0)
            ratios.append(flops / hz)
        res[key] = (max(ratios), statistics.median(ratios))
    kernels.select_isa("auto")
    return res


@dataclass
class Row:
    loop: Loop
    core: Core
    mca: Mca | None
    error: str = ""

    def rate(self, ghz: float) -> float:
        """Predicted work per second per core (GFLOP/s, GOP/s, GB/s, Gelem/s) at `ghz`."""
        return self.loop.work / self.mca.cycles * ghz


def model(loops: list[Loop], workdir: str) -> list[Row]:
    rows = []
    for lp in loops:
        asm = compile_asm(lp.src, lp.cores[0].arch, workdir)
        ins = find_loop(lp, asm)
        calls = sorted({x.split()[1] for x in ins or [] if x.split()[0] == "bl"})
        for core in lp.cores:
            if ins is None:
                rows.append(Row(lp, core, None, f"loop not found ({lp.count} x {lp.insn} in {lp.func})"))
                continue
            if calls:  # llvm-mca would count a call as one branch, not the callee's work
                rows.append(Row(lp, core, None, f"not modelled: the loop calls {', '.join(calls)}"))
                continue
            try:
                rows.append(Row(lp, core, run_mca(core, ins)))
            except RuntimeError as e:
                rows.append(Row(lp, core, None, f"llvm-mca cannot model it: {e}"))
    return rows


def peak_per_cycle(core: Core, key: str) -> float | None:
    """Work per cycle of PEAKS[key] on `core` (None: the core lacks the instruction)."""
    text, work = PEAKS[key]
    if key.startswith("sve_"):
        work = work * core.sve_bits // 256
    try:
        m = run_mca(core, [f"\t{text.format(d=d)}" for d in range(16)])
    except RuntimeError:
        return None
    return 16 * work / m.cycles


def peaks_table(cores: list[Core]) -> str:
    out = ["| instruction | work each | " + " | ".join(f"{c.name} per cycle" for c in cores) + " |",
           "|---|---|" + "---|" * len(cores)]
    for key, (text, work) in PEAKS.items():
        if key == "vfmadd":
            continue
        vals = [peak_per_cycle(c, key) for c in cores]
        out.append(f"| `{text.split()[0]}` ({key}) | {work}{' at 256 bits' if key.startswith('sve_') else ''} | " +
                   " | ".join("not on this core" if v is None else f"{v:.0f}" for v in vals) + " |")
    return "\n".join(out)


def table(rows: list[Row], measured: dict[str, tuple[float, float]] | None = None) -> str:
    out = ["| kernel loop | core | insns/iter | cycles/iter | bottleneck (llvm-mca) | work/iter | % of instr. peak "
           "| predicted per core |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lp = r.loop
        if r.mca is None:
            out.append(f"| {lp.kernel} | {r.core.name} | - | - | {r.error} | {lp.work:g} | - | - |")
            continue
        pk = peak_per_cycle(r.core, lp.peak) if lp.peak else None
        frac = f"{100 * lp.work / r.mca.cycles / pk:.0f}% of {lp.peak}" if pk else "-"
        rates = []
        for server, ghz in r.core.servers:
            if ghz:
                rates.append(f"{server} {ghz:.2f} GHz: **{r.rate(ghz):.1f}** {lp.unit}")
        if not rates and not (measured and lp.key in measured):
            rates.append(f"{lp.work / r.mca.cycles:.1f} {lp.unit.split('/')[0][1:]}/cycle (not measured)")
        if measured and lp.key in measured:
            best, med = measured[lp.key]
            pred = lp.work / r.mca.cycles
            rates.append(f"predicted {pred:.1f} {lp.unit.split('/')[0][1:]}/cycle, measured best {best:.1f} (median "
                         f"{med:.1f}): error {100 * (pred - best) / best:+.0f}%")
        note = f" ({lp.note})" if lp.note else ""
        out.append(f"| {lp.kernel}{note} | {r.core.name} | {r.mca.insns} | {r.mca.cycles:.2f} | {r.mca.bottleneck} | "
                   f"{lp.work:g} | {frac} | {'; '.join(rates)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--x86", action="store_true", help="also this machine's AVX2 loops and Zen 4's AVX-512 ones")
    ap.add_argument("--show", metavar="KEY", help="print one loop's assembly and llvm-mca report per core")
    ap.add_argument("--keep", metavar="DIR", help="keep the generated assembly in DIR")
    args = ap.parse_args()
    for tool in (MCA, "aarch64-linux-gnu-g++"):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found: apt-get install -y llvm-19 g++-aarch64-linux-gnu")
    loops = LOOPS + (X86_LOOPS if args.x86 or (args.show or "").startswith("x_") else [])
    workdir = args.keep or tempfile.mkdtemp(prefix="arm_model.")
    os.makedirs(workdir, exist_ok=True)
    try:
        if args.show:
            lp = next(x for x in loops if x.key == args.show)
            rows = model([lp], workdir)
            ins = find_loop(lp, compile_asm(lp.src, lp.cores[0].arch, workdir))
            print("\n".join(ins or ["(loop not found)"]))
            for r in rows:
                print(f"\n==== {r.core.name} ====\n" + (r.mca.report if r.mca else r.error))
            return
        measured = x86_measured(workdir) if args.x86 else None
        print(table(model(loops, workdir), measured))
        print("\nModelled peaks of the instructions (work per cycle per core; SVE SDOT at 256 bits on V1, "
              "128 on V2):\n")
        print(peaks_table([N1, V1, V2]))
        print("\nllvm-mca assumes every load hits L1 and perfect branch prediction: compute ceilings of the "
              "loops as compiled. The fused MoE runs the w4a8 / w8a8 / dense tiles above.")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
