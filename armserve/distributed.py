"""Tensor parallelism on one machine: one model split over N ranks, each a process on its own cores
(its own NUMA node on a big machine), one scheduler.

    rank 0 (the engine's process)                      rank 1..N-1 (spawned workers)
    -----------------------------                      -----------------------------
    load_model(..., ParallelContext(0, N, group))      load_model(..., ParallelContext(r, N, group))
    scheduler -> ModelRunner.execute(step)
        _prepare -> step inputs ──── pipe (numpy) ────►  the same inputs
        model forward  ◄═══ all-reduce: embedding, each row-parallel layer ═══►  model forward
        compute_logits ◄═══ gather of the LM head's vocabulary shares ═══  compute_logits
        sample (rank 0 only)

Each rank builds only its part of the model: its layers are the parallel layers of
layers/linear.py (the split is drawn there) and its weights are cut as they load, quantized
ones (w4a8, GGUF blocks) included, which stay quantized.

Collectives go through `ShmGroup` (csrc/shm_comm.cpp: one shared-memory region, a spin-then-yield
barrier, rank-ordered sums so all ranks hold bit-identical results) or, with
`ARMSERVE_TP_COMM=gloo` or without the C++ kernels, torch.distributed's gloo backend.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import socket
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from armserve import kernels
from armserve.kernels.library import DTYPE_CODES
from armserve.memory import page_out_library_code, release_free_heap

logger = logging.getLogger("armserve")

# Slots hold at most this much; larger all-reduces and gathers go in pieces.
MAX_SLOT_BYTES = 64 << 20


class TPError(RuntimeError):
    """A tensor-parallel rank failed or left; the group cannot go on."""


# ---- collectives ----------------------------------------------------------------------------


class ShmGroup:
    """All-reduce (sum) and gather-to-rank-0 between local ranks through one shared-memory region.

    `buffer` is a shared uint8 tensor made by `ShmGroup.allocate` in rank 0 and handed to the
    workers at spawn (torch shares its memory with them). Every rank must call the same ops in
    the same order.
    """

    def __init__(self, buffer: torch.Tensor, rank: int, world: int, slot_bytes: int) -> None:
        if not kernels.available():
            raise TPError(f"the shared-memory all-reduce needs the C++ kernels ({kernels.load_error()})")
        self.buffer, self.rank, self.world, self.slot_bytes = buffer, rank, world, slot_bytes
        self.lib = kernels.library.load()
        self.ptr = buffer.data_ptr()
        self.header = int(self.lib.armserve_shm_header_bytes(world))
        self.seq = 0

    @staticmethod
    def allocate(world: int, slot_bytes: int) -> torch.Tensor:
        """The region for `world` ranks: a header and two sets of slots (csrc/shm_comm.cpp)."""
        header = 64 * (world + 1)
        return torch.zeros(header + 2 * world * slot_bytes, dtype=torch.uint8).share_memory_()

    def _check(self, rc: int) -> None:
        if rc == 1:
            raise TPError("another tensor-parallel rank failed or left")
        if rc:
            raise TPError(f"shared-memory collective failed ({rc})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x <- sum over ranks of x (in place; x contiguous)."""
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        code = DTYPE_CODES[x.dtype]
        for a in range(0, flat.numel(), step):
            part = flat[a:a + step]
            self.seq += 1
            self._check(self.lib.armserve_shm_allreduce(self.ptr, self.rank, self.world, self.slot_bytes, self.seq,
                                                        code, part.data_ptr(), part.numel()))
        return x

    def _slot(self, seq: int, rank: int, nbytes: int) -> torch.Tensor:
        start = self.header + ((seq & 1) * self.world + rank) * self.slot_bytes
        return self.buffer[start:start + nbytes]

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's x [rows, n] side by side [rows, world * n]; other ranks: None."""
        rows, n = x.shape
        per = max(1, self.slot_bytes // (n * x.element_size()))
        out = torch.empty(rows, self.world * n, dtype=x.dtype) if self.rank == 0 else None
        for a in range(0, rows, per):
            part = x[a:a + per]
            nbytes = part.numel() * part.element_size()
            self.seq += 1
            self._slot(self.seq, self.rank, nbytes).view(x.dtype).view(part.shape).copy_(part)
            self._check(self.lib.armserve_shm_barrier(self.ptr, self.rank, self.world, self.seq))
            if out is not None:
                for r in range(self.world):
                    out[a:a + part.shape[0], r * n:(r + 1) * n] = self._slot(self.seq, r, nbytes).view(x.dtype).view(
                        part.shape)
        return out

    def abort(self) -> None:
        """Make every rank's pending and future ops fail (a rank died or raised)."""
        self.lib.armserve_shm_abort(self.ptr, self.world)


class GlooGroup:
    """The same collectives over torch.distributed's gloo backend (TCP): the fallback."""

    def __init__(self, init_method: str, rank: int, world: int) -> None:
        import datetime

        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, rank, world
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=300))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(x)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1) if self.rank == 0 else None

    def abort(self) -> None:
        pass  # gloo ops time out on their own


@dataclass
class CommSpec:
    """How a rank joins the group: a shared buffer (shm) or a TCP rendezvous (gloo)."""

    kind: str
    world: int
    slot_bytes: int = 0
    buffer: torch.Tensor | None = None
    init_method: str = ""

    def join(self, rank: int) -> ShmGroup | GlooGroup:
        if self.kind == "shm":
            return ShmGroup(self.buffer, rank, self.world, self.slot_bytes)
        return GlooGroup(self.init_method, rank, self.world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_comm_spec(world: int, slot_bytes: int, kind: str | None = None) -> CommSpec:
    """`ARMSERVE_TP_COMM` (shm or gloo) picks the transport; shm by default where the kernels load."""
    kind = kind or os.environ.get("ARMSERVE_TP_COMM", "").strip().lower() or ("shm" if kernels.available() else "gloo")
    if kind == "shm":
        slot_bytes = min(MAX_SLOT_BYTES, -(-slot_bytes // 64) * 64)
        return CommSpec("shm", world, slot_bytes, ShmGroup.allocate(world, slot_bytes))
    if kind == "gloo":
        return CommSpec("gloo", world, init_method=f"tcp://127.0.0.1:{_free_port()}")
    raise ValueError(f"ARMSERVE_TP_COMM must be shm or gloo, got {kind!r}")


# ---- the workers ----------------------------------------------------------------------------


# What rank 0 sends instead of a step when its engine goes idle (a step is a pickle, which never
# starts so): the rank hands its free heap back, as rank 0's IdleTrim does (memory.py).
TRIM_MESSAGE = b"trim"


def _worker_main(config, rank: int, world: int, comm: CommSpec, conn, bind: str | None, log_level: int) -> None:
    """A tensor-parallel rank > 0: load its part of the model, allocate its KV cache shard, then
    run every step rank 0 sends until the pipe closes."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s tp{rank} %(message)s")
    logger.setLevel(log_level)
    group = None
    try:
        from armserve import model_loader
        from armserve.cpu import init_threads, parse_cpu_list
        from armserve.dtypes import resolve_dtypes
        from armserve.engine.model_runner import ModelRunner
        from armserve.layers.linear import ParallelContext

        if bind:
            # A spawned process inherits the affinity of the thread that started it, which may be
            # rank 0's own binding: take this rank's cores first (cgroup limits still apply).
            os.sched_setaffinity(0, parse_cpu_list(bind))
        init_threads(bind=bind)
        group = comm.join(rank)
        # (every rank reads the whole checkpoint and keeps its part of each tensor as it loads)
        src = model_loader.resolve_model_path(config.model)
        hf = model_loader.load_config(src, config.hf_overrides)
        dtype, cache_dtype = resolve_dtypes(config, model_loader.checkpoint_dtype(hf), src.is_gguf)
        model = model_loader.load_model(src, hf, dtype, config.quantization, ParallelContext(rank, world, group),
                                        share_weights=bool(config.share_weights))
        from armserve.layers.rotary_embedding import trim_rope_tables

        trim_rope_tables(model, config.positions_reached())  # (as rank 0 does: torch_backend)
        num_blocks = conn.recv()
        runner = ModelRunner(model, num_blocks, config.block_size, dtype, cache_dtype, config.max_model_len,
                             enforce_eager=True)
        # (as rank 0's core does: the code that ran only for the imports and the load goes back)
        page_out_library_code()
        conn.send(("ready", None))
        parent = os.getppid()

        def watch_parent() -> None:  # rank 0 gone while this rank waits in a collective
            while os.getppid() == parent:
                time.sleep(1)
            group.abort()
            os._exit(1)

        threading.Thread(target=watch_parent, daemon=True).start()
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            if not data:
                return
            if data == TRIM_MESSAGE:
                release_free_heap()
                continue
            runner.execute_worker(pickle.loads(data))
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then this rank exits
        if group is not None:
            group.abort()
        try:
            conn.send(("failed", f"tensor-parallel rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except (OSError, BrokenPipeError):
            pass
        os._exit(1)


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: spawn them, send each step's inputs, notice a death."""

    def __init__(self, config, comm: CommSpec, binds: list[str | None]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.world = comm.world
        self.conns = []
        self.procs = []
        level = logging.getLogger("armserve").getEffectiveLevel()
        for rank in range(1, self.world):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"armserve-tp-{rank}", daemon=True,
                            args=(config, rank, self.world, comm, child_end, binds[rank], level))
            p.start()
            child_end.close()
            self.conns.append(parent_end)
            self.procs.append(p)
        self.group = None
        self.closed = False

    def start(self, group, num_blocks: int) -> None:
        """Tell the workers the cache size and wait until each has loaded its shard."""
        self.group = group
        for c in self.conns:
            c.send(num_blocks)
        for rank, (c, p) in enumerate(zip(self.conns, self.procs), start=1):
            while not c.poll(0.5):
                if not p.is_alive():
                    raise TPError(f"tensor-parallel rank {rank} exited with code {p.exitcode} while loading")
            try:
                kind, detail = c.recv()
            except EOFError:
                raise TPError(f"tensor-parallel rank {rank} exited while loading") from None
            if kind != "ready":
                raise TPError(detail)
        threading.Thread(target=self._watch, name="armserve-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.closed:
            for rank, p in enumerate(self.procs, start=1):
                if not p.is_alive() and not self.closed:
                    logger.error("tensor-parallel rank %d exited (code %s)", rank, p.exitcode)
                    self.group.abort()
                    return
            time.sleep(0.5)

    def send_step(self, data: bytes) -> None:
        for c in self.conns:
            try:
                c.send_bytes(data)
            except (BrokenPipeError, OSError):
                raise TPError("a tensor-parallel rank is gone") from None

    def trim(self) -> None:
        """Have every rank hand its free heap back (rank 0's engine is idle); a rank that is gone
        is found by the next step."""
        for c in self.conns:
            try:
                c.send_bytes(TRIM_MESSAGE)
            except (BrokenPipeError, OSError):
                pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send_bytes(b"")
                c.close()
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
