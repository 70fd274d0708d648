"""This machine's roofline: memory bandwidth (read, copy) and matmul peak, and a model's bandwidth
limit. Every benchmark measures bandwidth and matmul peak here (timing.py times the rest).

Decode at small batch reads every weight once per step, so a step can not be faster than
`weight bytes / memory bandwidth`; reporting each decode speed as a share of that limit says how
much of the machine an engine uses, independent of how fast the machine is.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any, Callable


def measure_bandwidth(kind: str, nbytes: int = 256 * 2**20, reps: int = 7, threads: int | None = None,
                      stat: Callable[[list[float]], float] = statistics.median) -> float:
    """Memory bandwidth in GB/s (1e9 bytes/s), `stat` (median; max for the best) of `reps` passes
    over a float32 buffer of `nbytes`, far larger than any cache, after one untimed pass.

    "read": a sum over it, counting the bytes read (decode's access pattern: weights are only read).
    "copy": a copy of it, counting bytes read plus bytes written (as STREAM's Copy).
    `threads`: torch threads for the measurement (default: all cores), restored afterwards.
    """
    import torch

    if kind not in ("read", "copy"):
        raise ValueError(f"kind must be 'read' or 'copy', not {kind!r}")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        if kind == "read":
            step, moved = src.sum, src.numel() * 4
        else:
            dst = torch.empty_like(src)
            step, moved = (lambda: dst.copy_(src)), 2 * src.numel() * 4
        step()  # fault the pages in before timing
        rates = []
        for _ in range(reps):
            t = time.perf_counter()
            step()
            rates.append(moved / (time.perf_counter() - t) / 1e9)
        return stat(rates)
    finally:
        torch.set_num_threads(prev)


def measure_matmul_peak(dtype: str = "float32", shape: tuple[int, int, int] = (2048, 2048, 2048), reps: int = 5,
                        threads: int | None = None, stat: Callable[[list[float]], float] = statistics.median) -> float:
    """GFLOP/s of an (m x k) @ (k x n) matmul in `dtype` (PyTorch's CPU GEMM, `threads` threads, default all
    cores), `stat` (median; max for the best) of `reps` after a warm-up; `shape` is (m, k, n)."""
    import torch

    m, k, n = shape
    prev = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        dt = getattr(torch, dtype)
        a = torch.randn(m, k).to(dt)
        b = torch.randn(k, n).to(dt)
        torch.mm(a, b)  # warm-up: packing buffers, thread pool
        rates = []
        for _ in range(reps):
            t = time.perf_counter()
            torch.mm(a, b)
            rates.append(2 * m * k * n / (time.perf_counter() - t) / 1e9)
        return stat(rates)
    finally:
        torch.set_num_threads(prev)


def measure_roofline(threads: int | None = None) -> dict[str, Any]:
    """Read and copy bandwidth and fp32/bf16 matmul peak of this machine (takes a few seconds)."""
    threads = threads or os.cpu_count() or 1
    return {
        "threads": threads,
        "read_bandwidth_gbs": measure_bandwidth("read", threads=threads),
        "copy_bandwidth_gbs": measure_bandwidth("copy", threads=threads),
        "matmul_gflops": {dt: measure_matmul_peak(dt, threads=threads) for dt in ("float32", "bfloat16")},
    }


def load_or_measure(path: str | None, threads: int | None = None) -> dict[str, Any]:
    """The roofline saved in `path` (written by an earlier measurement in the same run), else a new one."""
    if path and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    roof = measure_roofline(threads)
    if path:
        with open(path, "w") as f:
            json.dump(roof, f, indent=1)
    return roof


def weight_bytes_per_token(path: str, dtype: str | None = None) -> int:
    """Bytes of weights one decode step reads for one model: every weight except an untied input
    embedding (a step reads one row of it).

    `path` is an HF folder (safetensors) or a GGUF file. `dtype` is the dtype the engine computes in;
    None counts the bytes as stored (right for llama.cpp, which runs a GGUF as it is).
    """
    from armserve.dtypes import resolve_dtype

    itemsize = resolve_dtype(dtype).itemsize if dtype is not None else None
    path = os.path.expanduser(path)
    sizes: dict[str, tuple[int, int]] = {}  # name -> (elements, bytes as stored)
    if path.endswith(".gguf") and os.path.isfile(path):
        from gguf import GGUFReader

        sizes = {t.name: (int(t.n_elements), int(t.n_bytes)) for t in GGUFReader(path).tensors}
        embedding, head = "token_embd.weight", "output.weight"
    else:
        import glob

        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"{path}: no *.safetensors files to count weights from")
        for fpath in files:
            with safe_open(fpath, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    numel = math.prod(sl.get_shape())
                    stored = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I8": 1, "U8": 1}.get(sl.get_dtype(), 4)
                    sizes[name] = (numel, numel * stored)
        embedding, head = "embed_tokens.weight", "lm_head.weight"
    untied = head in sizes
    return sum(stored if itemsize is None else numel * itemsize
               for name, (numel, stored) in sizes.items() if not (untied and name.endswith(embedding)))


def bandwidth_limit(weight_bytes: int, roof: dict[str, Any]) -> float:
    """Decode steps per second at the bandwidth limit (= tok/s of one sequence): the higher of
    read and copy bandwidth (decode mostly reads)."""
    return max(roof.get("read_bandwidth_gbs", 0.0), roof["copy_bandwidth_gbs"]) * 1e9 / weight_bytes


def describe(roof: dict[str, Any]) -> str:
    mm = roof["matmul_gflops"]
    return (f"memory read {roof.get('read_bandwidth_gbs', float('nan')):.1f} GB/s, copy "
            f"{roof['copy_bandwidth_gbs']:.1f} GB/s (read + written), matmul peak fp32 {mm['float32']:.0f} / "
            f"bf16 {mm['bfloat16']:.0f} GFLOP/s, {roof['threads']} thread(s)")


def module_weight_bytes(model) -> int:
    """`weight_bytes_per_token` for a loaded torch module (an untied input embedding left out)."""
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}  # tied tensors appear once
    # Prepacked dense weights (layers/linear.py Linear.finalize) replace their parameter, and so
    # do quantized layers' packed parts (quantization/linear.py); a tied head's packed copy is what
    # decode reads instead of the table.
    for n, m in model.named_modules():
        if getattr(m, "packed", None) is not None:
            sizes[n + ".weight"] = m.packed.numel() * m.packed.element_size()
        elif isinstance(getattr(m, "parts", None), list) and hasattr(m, "weight_bytes"):
            sizes[n + ".weight"] = m.weight_bytes
    tied_head = getattr(model, "tied_head", None)
    untied = "lm_head.weight" in sizes
    if tied_head is not None and tied_head.packed is not None:
        sizes["lm_head.weight"] = tied_head.packed.numel() * tied_head.packed.element_size()
        untied = True
    return sum(b for n, b in sizes.items() if not (untied and n.endswith("embed_tokens.weight")))
