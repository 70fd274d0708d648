"""Tensor-parallel all-reduce latency (issue 16): armserve's shared-memory ring (csrc/shm_comm.cpp,
`armserve.distributed.ShmGroup`) against torch.distributed's gloo backend, two ranks on this
machine, each pinned to its own core.

    python benchmarks/bench_allreduce.py                    # hidden 576 (SmolLM2) and 896 (Qwen2.5-0.5B)
    python benchmarks/bench_allreduce.py --hidden 4096 --rows 1 8 64

A tensor-parallel decode step does two all-reduces per layer of [rows, hidden] (after attention
and after the MLP) plus one for the embedding, so the figure per step is about (2 x layers + 1)
times the latency at the step's row count. Results: the "allreduce" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from report import git_revision, machine_description, update_section  # noqa: E402

DTYPES = ("bfloat16", "float32")


def _rank(kind: str, spec, rank: int, core: int | None, shapes: list[tuple[int, int, str]], iters: int,
          queue) -> None:
    """One rank: time `iters` all-reduces per shape (after a warm-up), rank 0 reports medians."""
    import torch

    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    group = spec.join(rank)
    results = {}
    for rows, hidden, dtype in shapes:
        x = torch.randn(rows, hidden).to(getattr(torch, dtype))
        for _ in range(max(10, iters // 10)):
            group.all_reduce(x.clone())
        times = []
        for _ in range(iters):
            y = x.clone()
            t0 = time.perf_counter()
            group.all_reduce(y)
            times.append(time.perf_counter() - t0)
        results[(rows, hidden, dtype)] = statistics.median(times) * 1e6
    if rank == 0:
        queue.put(results)
    if kind == "gloo":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()  # (a gloo group left open aborts the process at exit)


def measure(kind: str, shapes: list[tuple[int, int, str]], iters: int, cores: list[int]) -> dict:
    """{(rows, hidden, dtype): median us} for `kind` (shm or gloo) with 2 ranks."""
    from armserve.distributed import make_comm_spec

    slot = max(r * h * 4 for r, h, _ in shapes)
    spec = make_comm_spec(2, slot, kind)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(kind, spec, r, cores[r] if len(cores) > r else None, shapes, iters, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[576, 896])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()

    from armserve.cpu import physical_cores

    cores = physical_cores()
    shapes = [(r, h, d) for h in args.hidden for d in DTYPES for r in args.rows]
    load = os.getloadavg()[0]
    shm = measure("shm", shapes, args.iters, cores)
    gloo = measure("gloo", shapes, args.iters, cores)
    lines = [
        "## Tensor-parallel all-reduce: shared memory vs gloo (issue 16)",
        "",
        f"Machine: {machine_description()}. armserve rev `{git_revision()}`. Two ranks, each a process pinned to its "
        f"own core ({cores[:2]}), one thread each; median of {args.iters} all-reduces of [rows, hidden] per cell after a "
        f"warm-up; load average {load:.2f} before the run. A decode step of a tensor-parallel model does 2 per layer "
        "plus one for the embedding, at the step's row count.",
        "",
        "| hidden | dtype | rows | shm us | gloo us | gloo / shm | shm GB/s (bytes in / time) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, h, d in shapes:
        s, g = shm[(r, h, d)], gloo[(r, h, d)]
        nbytes = r * h * (2 if d == "bfloat16" else 4)
        lines.append(f"| {h} | {d} | {r} | {s:.1f} | {g:.1f} | {g / s:.1f}x | {nbytes / s / 1e3:.2f} |")
    lines += ["", "Reproduce: `python benchmarks/bench_allreduce.py`"]
    body = "\n".join(lines)
    print(body)
    if not args.no_doc:
        update_section("allreduce", body)


if __name__ == "__main__":
    main()
