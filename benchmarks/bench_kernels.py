"""Micro-benchmark: each C++ kernel against the PyTorch path it replaces, on this machine.

For every kernel family: the PyTorch path (what armserve runs with ARMSERVE_ISA=torch) and the
kernel on every ISA variant this CPU runs, median of `--runs` timings of `--iters` calls each.
Decode attention is measured the way the engine calls it: paged, GQA, one query per sequence.
Also measures this machine's memory copy bandwidth (the decode roofline). Writes the "kernels"
section of docs/benchmarks.md.

    python benchmarks/bench_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from report import git_revision, load_average, machine_description, update_section  # noqa: E402

from armserve.benchmarks.roofline import measure_bandwidth  # noqa: E402
from armserve.benchmarks.timing import seconds_per_call  # noqa: E402


def timeit(fn, iters: int, runs: int) -> float:
    """Median microseconds per call."""
    return seconds_per_call(fn, runs, iters) * 1e6


def attention_cases(dtype: torch.dtype):
    """(label, PyTorch-path fn, kernel fn) for paged decode attention at several contexts."""
    from armserve import kernels
    from armserve.layers.attention import Attention, AttentionMetadata, kv_cache_shapes, set_attention_metadata

    out = []
    for label, hq, hk, hd, batch, ctx in [
        ("SmolLM2 shape (9q/3kv x 64)", 9, 3, 64, 1, 2048),
        ("TinyLlama shape (32q/4kv x 64)", 32, 4, 64, 1, 2048),
        ("TinyLlama shape, 16 seqs", 32, 4, 64, 16, 512),
    ]:
        bs = 16
        nb = -(-ctx // bs)
        num_blocks = batch * nb + 1
        attn = Attention(hq, hd, hd**-0.5, hk)
        k_shape, v_shape, _ = kv_cache_shapes(num_blocks, bs, hk, hd, dtype)
        attn.k_cache = torch.randn(k_shape).to(dtype)
        attn.v_cache = torch.randn(v_shape).to(dtype)
        perm = torch.randperm(num_blocks - 1)[: batch * nb].view(batch, nb)  # scattered blocks, as in use
        slots_new = (perm[:, -1] * bs + (ctx - 1) % bs).long()
        q = torch.randn(batch, hq * hd).to(dtype)
        k = torch.randn(batch, hk * hd).to(dtype)
        v = torch.randn(batch, hk * hd).to(dtype)
        offs = torch.arange(ctx)
        md_ref = AttentionMetadata(slot_mapping=slots_new, num_decodes=batch)
        md_ref.decode_slots = perm[:, offs // bs].long() * bs + offs % bs
        md_ref.decode_context_lens = torch.full((batch,), ctx, dtype=torch.long)
        keep = (torch.arange(batch, dtype=torch.int32), torch.ones(batch, dtype=torch.int32),
                torch.full((batch,), ctx, dtype=torch.int32), perm.to(torch.int32).contiguous())
        md_k = AttentionMetadata(slot_mapping=slots_new, num_decodes=batch)
        md_k.kernel_batch = kernels.make_attn_batch(*keep, bs)
        md_k.kernel_batch._keepalive = keep

        def torch_path(md=md_ref, attn=attn, q=q, k=k, v=v):
            set_attention_metadata(md)
            attn(q, k, v)

        def kernel_path(md=md_k, attn=attn, q=q, k=k, v=v):
            set_attention_metadata(md)
            attn(q, k, v)

        out.append((f"paged attention decode, {label}, context {ctx}", torch_path, kernel_path))
    return out


def elementwise_cases(dtype: torch.dtype):
    from armserve import kernels
    from armserve.kernels.reference import act_and_mul_ref, rms_norm_ref, rotary_ref
    from armserve.layers.rotary_embedding import RotaryEmbedding

    out = []
    for rows in (1, 256):
        x = torch.randn(rows, 2048).to(dtype)
        w = torch.rand(2048).to(dtype)
        r = torch.randn(rows, 2048).to(dtype)
        out.append((f"RMSNorm + residual, {rows} x 2048", lambda x=x, w=w, r=r: rms_norm_ref(x, w, 1e-5, r),
                    lambda x=x, w=w, r=r: kernels.rms_norm(x, w, 1e-5, r)))
        g = torch.randn(rows, 2 * 5632).to(dtype)
        out.append((f"SiLU-and-mul, {rows} x 5632", lambda g=g: act_and_mul_ref(g, "silu"),
                    lambda g=g: kernels.act_and_mul(g, "silu")))
        rope = RotaryEmbedding(64, 4096, {"rope_type": "default", "rope_theta": 10000.0})
        qkv = torch.randn(rows, 40 * 64).to(dtype)
        q, k = qkv[:, : 32 * 64], qkv[:, 32 * 64: 36 * 64]
        pos = torch.arange(rows)
        out.append((f"RoPE (neox) 32q+4kv heads x 64, {rows} tokens",
                    lambda q=q, k=k, p=pos, c=rope.cos_sin: rotary_ref(p, q, k, c, 64, 64, True),
                    lambda q=q, k=k, p=pos, c=rope.cos_sin: kernels.rotary(p, q, k, c, 64, 64, True)))
    return out


def matmul_cases(dtype: torch.dtype):
    """Decode-sized matmuls (the skinny bf16/f16 kernel, and w4a8 for 1 and 256 tokens) against
    PyTorch's F.linear on the same dense weight. Each case cycles through several copies of its
    weight (> 32 MiB together) so it streams from memory, as in a real decode step, not from L3."""
    import torch.nn.functional as F

    from armserve.quantization import QuantizedLinear, quantize_weight

    n, k, copies = 5632, 2048, 4
    dense = [torch.randn(n, k).to(dtype) for _ in range(copies)]
    out = []
    if dtype in (torch.bfloat16, torch.float16):
        from armserve import kernels

        for rows in (1, 4):
            x = torch.randn(rows, k).to(dtype)
            nxt = itertools.cycle(dense).__next__
            out.append((f"decode matmul {rows} x {k} -> {n}",
                        lambda x=x, nxt=nxt: F.linear(x, nxt()), lambda x=x, nxt=nxt: kernels.gemv(x, nxt())))
    quant = []
    for w in dense:
        layer = QuantizedLinear(k, n, False, [("all", n)])
        layer.load_shard("all", quantize_weight(w.float(), 32, False))
        layer.finalize()
        quant.append(layer)
    for rows in (1, 256):
        x = torch.randn(rows, k).to(dtype)
        nxt = itertools.cycle(range(copies)).__next__
        out.append((f"w4a8 linear (int4 weights, g32) {rows} x {k} -> {n}, vs dense F.linear",
                    lambda x=x, nxt=nxt: F.linear(x, dense[nxt()]), lambda x=x, nxt=nxt: quant[nxt()](x)))
    return out


# (model, layer, N, K) of the dense GEMM table: Qwen2.5-0.5B and SmolLM2-135M projections and LM heads.
DENSE_SHAPES = [
    ("Qwen2.5-0.5B", "qkv", 1152, 896), ("Qwen2.5-0.5B", "gate+up", 9728, 896),
    ("Qwen2.5-0.5B", "down", 896, 4864), ("Qwen2.5-0.5B", "LM head", 151936, 896),
    ("SmolLM2-135M", "qkv", 960, 576), ("SmolLM2-135M", "gate+up", 3072, 576),
    ("SmolLM2-135M", "down", 576, 1536), ("SmolLM2-135M", "LM head", 49152, 576),
]
DENSE_ROWS = [1, 4, 8, 16, 32, 64, 128, 512]


def timeit_for(fn, seconds: float, runs: int) -> float:
    """Median microseconds per call, iterations sized so that a run takes about `seconds`."""
    return seconds_per_call(fn, runs, min_s=seconds) * 1e6


def dense_gemm_table(runs: int, seconds: float = 0.05) -> list[str]:
    """The dense bf16 GEMM on prepacked weights (kernels.gemm_bf16) against F.linear, oneDNN with a
    prepacked weight (mkldnn._reorder_linear_weight + _linear_pointwise: what a PyTorch-side
    prepacking would give) and the skinny matmul (kernels.gemv, up to 4 rows). Weights are cycled
    through copies of > 96 MiB together, so each call streams its weight from memory as a decode
    step does. bf16 in and out."""
    import torch.nn.functional as F

    from armserve import kernels

    results = []  # (model, layer, n, k, m, {method: us})
    for model, layer, n, k in DENSE_SHAPES:
        copies = max(1, -(-96 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k).to(torch.bfloat16) for _ in range(copies)]
        packed = [kernels.pack_bf16(w) for w in ws]
        try:
            dnn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        except RuntimeError:  # oneDNN's bf16 prepacking needs AVX-512 (or AVX-NE-CONVERT): not on AVX2 CPUs
            dnn = None
        for m in DENSE_ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            nxt = itertools.cycle(range(copies)).__next__
            fns = {
                "armserve gemm_bf16": lambda: kernels.gemm_bf16(x, packed[nxt()], n, k, out=out),
                "F.linear": lambda: F.linear(x, ws[nxt()]),
            }
            if dnn is not None:
                fns["oneDNN prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(x, dnn[nxt()], None, "none", [],
                                                                                     "")
            if m <= 4:
                fns["gemv"] = lambda: kernels.gemv(x, ws[nxt()])
            t = {name: timeit_for(fn, seconds, runs) for name, fn in fns.items()}
            results.append((model, layer, n, k, m, t))
            line = f"{model} {layer} {n}x{k} m={m}: " + "  ".join(f"{a} {b:.1f} us" for a, b in t.items())
            print(line, flush=True)
        del ws, packed, dnn
    # Practical bf16 peak: the best oneDNN rate of the run (its large-m GEMMs run at the core's
    # vdpbf16ps limit; benchmarks measured 491 GFLOP/s for a bare vdpbf16ps loop on Zen 5 at 1 thread).
    gf = lambda n, k, m, us: 2 * m * n * k / us / 1e3  # noqa: E731
    # (without oneDNN prepacking: the best rate of any method)
    peak = max(gf(n, k, m, t.get("oneDNN prepacked", min(t.values()))) for _, _, n, k, m, t in results)
    lines = [
        f"Dense bf16 GEMM on prepacked weights (`kernels.gemm_bf16`, variant `{kernels.dense_isa()}`) vs oneDNN: "
        f"practical bf16 peak (best oneDNN rate of this run; without oneDNN's bf16 prepacking, the best rate "
        f"of any method) **{peak:.0f} GFLOP/s**. GB/s = weight + x + out bytes per call / time (weights stream "
        "from memory: copies cycled). vs x = x's time / gemm_bf16's time (> 1: gemm_bf16 faster).",
        "",
        "| model | layer | N x K | m | gemm_bf16 us | GFLOP/s | % peak | GB/s | vs oneDNN prepacked | vs F.linear "
        "| vs gemv |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, layer, n, k, m, t in results:
        us = t["armserve gemm_bf16"]
        gbs = (n * k + m * k + m * n) * 2 / us / 1e3
        g = gf(n, k, m, us)
        gemv = f"{t['gemv'] / us:.2f}x" if "gemv" in t else "-"
        lines.append(f"| {model} | {layer} | {n} x {k} | {m} | {us:.1f} | {g:.0f} | {100 * g / peak:.0f}% | "
                     f"{gbs:.1f} | "
                     + (f"{t['oneDNN prepacked'] / us:.2f}x ({t['oneDNN prepacked']:.1f} us) | "
                        if "oneDNN prepacked" in t else "- (needs AVX-512) | ") +
                     f"{t['F.linear'] / us:.2f}x ({t['F.linear']:.1f} us) | {gemv} |")
    return lines


def write_dense_gemm(args) -> None:
    from armserve import kernels

    lines = [
        "## Kernels: dense bf16 GEMM on prepacked weights (csrc/dense_gemm.h)",
        "",
        f"Machine: {machine_description()}. {args.threads} thread(s); median of {args.runs} runs; "
        f"load average {load_average():.2f}. armserve rev `{git_revision()}`.",
        "",
    ] + dense_gemm_table(args.runs) + [
        "", f"Reproduce: `python benchmarks/bench_kernels.py --threads {args.threads} --only dense`"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("kernels-dense-gemm", text)
    assert kernels.available()


QDENSE_SHAPES = [("Qwen2.5-0.5B", "qkv", 1152, 896), ("Qwen2.5-0.5B", "gate+up", 9728, 896),
                 ("Qwen2.5-0.5B", "down", 896, 4864)]
QDENSE_ROWS = [16, 64, 128, 256, 1024]


def write_qdense(args) -> None:
    """Quantized layers at prefill sizes: the w4a8 / w8a8 GEMM (int8 activations, kernels.qgemm) against
    the weight dequantized to bf16 panel by panel for the dense tiles (kernels.qgemm_dense), and the
    dense GEMM on the same weight dequantized once and prepacked (what the dequantization costs)."""
    from armserve import kernels
    from armserve.quantization import pack, quantize_weight

    peak = 0.0
    rows = []
    for model, layer, n, k in QDENSE_SHAPES:
        w = torch.randn(n, k)
        for fmt in ("w4", "w8"):
            qt = quantize_weight(w, 32, symmetric=False) if fmt == "w4" else None
            if fmt == "w8":
                sc = w.view(n, k // 32, 32).abs().amax(-1) / 127
                from armserve.quantization import QuantizedTensor
                qt = QuantizedTensor("w8", torch.round(w / sc.repeat_interleave(32, 1)).clamp(-127, 127)
                                     .to(torch.int8), sc, None, 32)
            packed = pack(qt)
            dense = kernels.pack_bf16(qt.dequantize().to(torch.bfloat16))
            for m in QDENSE_ROWS:
                x = torch.randn(m, k).to(torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16)
                fns = {
                    "w4a8 GEMM": lambda: kernels.qgemm(fmt, out, 0, kernels.quantize_act(x, 32), packed, n, 32),
                    "dequantized bf16": lambda: kernels.qgemm_dense(fmt, out, 0, x, packed, n, 32),
                    "dense bf16": lambda: kernels.gemm_bf16(x, dense, n, k, out=out),
                }
                t = {name: timeit_for(fn, 0.05, args.runs) for name, fn in fns.items()}
                gf = {name: 2 * m * n * k / us / 1e3 for name, us in t.items()}
                peak = max(peak, gf["dense bf16"])
                rows.append((model, layer, n, k, fmt, m, t, gf))
                print(f"{layer} {fmt} m={m}: " + "  ".join(f"{a} {b:.0f} us ({gf[a]:.0f} GFLOP/s)"
                                                           for a, b in t.items()), flush=True)
    lines = [
        "## Kernels: quantized layers at prefill sizes (w4a8 GEMM vs dequantized bf16 tiles)",
        "",
        f"Machine: {machine_description()}. {args.threads} thread(s); median of {args.runs} runs; load average "
        f"{load_average():.2f}; kernel variant `{kernels.isa()}` (dense tiles `{kernels.dense_isa()}`, int8 GEMM "
        f"`{kernels.qgemm_isa()}`). armserve rev `{git_revision()}`. Group 32, bf16 activations in and out. "
        "w4a8 = int8 activations (quantized per call) against the packed int4 / int8 weight; dequantized bf16 = "
        f"the same packed weight dequantized panel by panel for the dense bf16 tiles (`kernels.qgemm_dense`, "
        f"used from {kernels.QDENSE_MIN_ROWS} rows with a bf16 dot instruction); dense bf16 = the GEMM on the weight "
        f"dequantized once and prepacked (2 bytes a weight). % peak: of the best dense bf16 rate of the run "
        f"({peak:.0f} GFLOP/s).",
        "",
        "| layer | N x K | weights | m | w4a8 us (GFLOP/s) | dequantized bf16 us (GFLOP/s, % peak) | dense bf16 us "
        "| dequantized / w4a8 speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, layer, n, k, fmt, m, t, gf in rows:
        lines.append(f"| {model} {layer} | {n} x {k} | {fmt} | {m} | {t['w4a8 GEMM']:.0f} ({gf['w4a8 GEMM']:.0f}) | "
                     f"{t['dequantized bf16']:.0f} ({gf['dequantized bf16']:.0f}, "
                     f"{100 * gf['dequantized bf16'] / peak:.0f}%) | {t['dense bf16']:.0f} | "
                     f"{t['w4a8 GEMM'] / t['dequantized bf16']:.2f}x |")
    lines += ["", f"Reproduce: `python benchmarks/bench_kernels.py --threads {args.threads} --only qdense`"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("kernels-qdense", text)


# (model, layer, K, N) of the LoRA targets: x [T, K] -> y [T, N] (qkv and gate_up are fused: one
# shrink, its rank buffer expanded into each slice; timed here as one expand over all N columns).
LORA_SHAPES = [("Llama-3-8B", "qkv", 4096, 6144), ("Llama-3-8B", "gate_up", 4096, 28672),
               ("Llama-3-8B", "down", 14336, 4096), ("Qwen2.5-0.5B", "gate_up", 896, 9728)]
LORA_TOKENS = [1, 8, 32, 64]


def write_lora(args) -> None:
    """Batched LoRA (kernels.lora_shrink + lora_expand_, 4 adapters of rank `--lora-rank` mixed
    round-robin in the batch) against the PyTorch reference (a loop over the batch's slots) and the
    dense gather formulation (vLLM's CPU punica fallback, vllm/lora/ops/torch_ops: A[idx] and B[idx]
    gathered per token, then two einsums). Adapter weights are cycled through copies of > 96 MiB, so
    each call streams them from memory as a decode step through every layer does."""
    from armserve import kernels
    from armserve.kernels.lora import lora_expand_, lora_expand_ref, lora_shrink, lora_shrink_ref

    dtype, r, slots = getattr(torch, args.dtype), args.lora_rank, 4
    rows = []
    for model, layer, k, n in LORA_SHAPES:
        per_set = slots * r * (k + n) * torch.finfo(dtype).bits // 8
        sets = [((torch.randn(slots, r, k) / k ** 0.5).to(dtype), (torch.randn(slots, n, r) * 0.01).to(dtype))
                for _ in range(max(1, -(-96 * 2**20 // per_set)))]
        scales = torch.ones(slots)
        for t in LORA_TOKENS:
            x, y = torch.randn(t, k).to(dtype), torch.zeros(t, n, dtype=dtype)
            idx = torch.arange(t, dtype=torch.int64) % slots
            ws = itertools.cycle(sets)

            def kernel():
                a, b = next(ws)
                lora_expand_(y, lora_shrink(x, a, idx), b, idx, scales)

            def reference():
                a, b = next(ws)
                lora_expand_ref(y, lora_shrink_ref(x, a, idx), b, idx, scales)

            def gather():
                a, b = next(ws)
                buf = torch.einsum("tk,trk->tr", x.float(), a[idx].float())
                y.add_((torch.einsum("tr,tnr->tn", buf, b[idx].float()) * scales[idx, None]).to(dtype))

            us = {name: timeit_for(fn, 0.05, args.runs)
                  for name, fn in (("kernel", kernel), ("reference", reference), ("gather", gather))}
            gflops = 2 * t * r * (k + n) / us["kernel"] / 1e3
            rows.append((model, layer, k, n, t, us, gflops))
            print(f"{model} {layer} T={t}: kernel {us['kernel']:.1f} us ({gflops:.1f} GFLOP/s), "
                  f"reference {us['reference']:.1f} us, gather {us['gather']:.1f} us", flush=True)
    lines = [
        "## Kernels: batched LoRA (csrc/lora_impl.h)",
        "",
        f"Machine: {machine_description()}. {args.threads} thread(s); median of {args.runs} runs; load average "
        f"{load_average():.2f}; kernel variant `{kernels.isa()}` (bf16 dot: {kernels.bf16_dot()}). armserve rev "
        f"`{git_revision()}`. {args.dtype}, {slots} adapters of rank {r} mixed round-robin in the batch; one call = "
        "shrink + expand of one layer (adapter weights streamed from memory). Reference = kernels/lora.py's "
        "PyTorch loop over the batch's slots; gather = A[idx], B[idx] gathered per token and two einsums "
        "(vLLM's CPU punica fallback).",
        "",
        "| layer | K -> N | tokens | kernel us | GFLOP/s | vs reference | vs gather |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, layer, k, n, t, us, gflops in rows:
        lines.append(f"| {model} {layer} | {k} -> {n} | {t} | {us['kernel']:.1f} | {gflops:.1f} | "
                     f"{us['reference'] / us['kernel']:.1f}x | {us['gather'] / us['kernel']:.1f}x |")
    lines += ["", f"Reproduce: `python benchmarks/bench_kernels.py --threads {args.threads} --only lora`"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("kernels-lora", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--only", choices=["dense", "qdense", "lora"],
                    help="run only the dense bf16 GEMM table, the quantized-prefill one or the LoRA one (own doc "
                         "sections)")
    ap.add_argument("--lora-rank", type=int, default=16, help="adapter rank of the --only lora table")
    args = ap.parse_args()

    from armserve import kernels

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    assert kernels.available(), kernels.load_error()
    if args.only == "dense":
        write_dense_gemm(args)
        return
    if args.only == "qdense":
        write_qdense(args)
        return
    if args.only == "lora":
        write_lora(args)
        return
    isas = kernels.supported_isas()
    load0 = load_average()
    bw = measure_bandwidth("copy", 512 * 2**20, reps=5, threads=args.threads)
    rows = []
    for label, ref, fast in attention_cases(dtype) + elementwise_cases(dtype) + matmul_cases(dtype):
        t_ref = timeit(ref, args.iters, args.runs)
        per_isa = {}
        for name in isas:
            kernels.select_isa(name)
            per_isa[name] = timeit(fast, args.iters, args.runs)
        kernels.select_isa("auto")
        rows.append((label, t_ref, per_isa))
        print(f"{label:70s} torch {t_ref:9.1f} us  " + "  ".join(f"{n} {t:8.1f} us ({t_ref / t:.1f}x)"
                                                                  for n, t in per_isa.items()), flush=True)
    lines = [
        "## Kernels: C++ kernels vs the PyTorch path (issue: CPU kernels)",
        "",
        f"Machine: {machine_description()}. {args.threads} thread(s), {args.dtype}; median of {args.runs} runs of "
        f"{args.iters} calls; load average {load0:.2f} before / {load_average():.2f} after. "
        f"Measured memory copy bandwidth: **{bw:.1f} GB/s** (read + write, 512 MiB). armserve rev `{git_revision()}`.",
        "",
        "The PyTorch path is what armserve runs with `ARMSERVE_ISA=torch` (gather + SDPA for attention; "
        "oneDNN's F.linear for the matmuls, on the dense weight the quantized layer was made from). "
        "Speed-up = PyTorch time / kernel time. The bf16 decode matmul uses AVX512-BF16 `vdpbf16ps` in the "
        "avx512 column where the CPU has it; the w4a8 rows follow each variant's quantized GEMM (avx512: VNNI).",
        "",
        "| kernel | PyTorch path (us) | " + " | ".join(f"{n} (us, speed-up)" for n in isas) + " |",
        "|---|---|" + "---|" * len(isas),
    ]
    for label, t_ref, per_isa in rows:
        lines.append(f"| {label} | {t_ref:.1f} | " + " | ".join(f"{t:.1f} ({t_ref / t:.2f}x)"
                                                               for t in per_isa.values()) + " |")
    lines += ["", f"Reproduce: `python benchmarks/bench_kernels.py --threads {args.threads} --dtype {args.dtype}`"]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        update_section("kernels", text)
    write_dense_gemm(args)


if __name__ == "__main__":
    main()
