"""Tensor parallelism on one machine: one model split over N ranks, each a process on its own cores
(its own NUMA node on a big machine), one scheduler.

    rank 0 (the engine's process)                        rank 1..N-1 (spawned workers)
    -----------------------------                        -----------------------------
    scheduler -> ModelRunner.execute(step)
        _prepare -> step inputs ──── pipe (numpy) ────►  the same inputs
        model forward  ◄═══ all-reduce after attention and MLP (shared memory) ═══►  model forward
        compute_logits ◄═══ gather of the vocabulary shards ═══  compute_logits
        sample (rank 0 only)

Megatron-style split (`shard_model`), applied to the loaded weights before they are packed:

    qkv_proj      column-parallel by heads: rank r keeps its query heads and their KV heads
                  (a KV head shared by several ranks when there are fewer KV heads than ranks)
    o_proj        row-parallel (its input columns of those heads); outputs summed by all-reduce
    gate_up_proj  column-parallel (its slice of the intermediate width, of gate and of up)
    down_proj     row-parallel; all-reduce (an MoE block: every expert split the same way, one
                  all-reduce of the block's output; the router is replicated)
    embed_tokens  split by vocabulary: a rank looks up the ids it holds, zeros elsewhere; all-reduce
    lm_head       split by vocabulary (a tied head is the embedding's shard); logits gathered on rank 0
    KV cache      each rank caches only its KV heads, in the same blocks (the scheduler's block ids)

Collectives go through `ShmGroup` (csrc/shm_comm.cpp: one shared-memory region, a spin-then-yield
barrier, rank-ordered sums so all ranks hold bit-identical results) or, with
`ARMSERVE_TP_COMM=gloo` or without the C++ kernels, torch.distributed's gloo backend.
Quantized checkpoints are dequantized under tensor parallelism (a quantized weight's blocks
run along the input dimension, which the row-parallel split would have to cut; not done yet).
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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from armserve import kernels

logger = logging.getLogger("armserve")

# Model classes whose layers `shard_model` knows (attention: LlamaAttention; MLP: LlamaMLP or
# SparseMoeBlock).
TP_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
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
        code = _DTYPE_CODES[x.dtype]
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


# ---- splitting a loaded model -----------------------------------------------------------------


def _share(n: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of rank's part of n items split as evenly as possible (the first ranks get
    the smaller parts): a model whose heads or width the rank count does not divide still splits."""
    a, b = n * rank // world, n * (rank + 1) // world
    if b <= a:
        raise ValueError(f"tensor_parallel_size {world} leaves rank {rank} none of {n}")
    return a, b - a


def _keep_rows(linear: nn.Module, ranges: list[tuple[int, int]]) -> None:
    """Keep output rows [a, a + n) for each (a, n) of a float Linear (column-parallel)."""
    w = linear.weight.data
    linear.weight = nn.Parameter(torch.cat([w[a:a + n] for a, n in ranges]).contiguous(), requires_grad=False)
    if linear.bias is not None:
        b = linear.bias.data
        linear.bias = nn.Parameter(torch.cat([b[a:a + n] for a, n in ranges]).contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_cols(linear: nn.Module, start: int, n: int, rank: int) -> None:
    """Keep input columns [start, start + n) of a float Linear (row-parallel); the bias stays on rank 0
    only, so the all-reduce adds it once."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:start + n].contiguous(), requires_grad=False)
    linear.in_features = n
    if linear.bias is not None and rank != 0:
        linear.bias = None


def _shard_attention(attn: nn.Module, rank: int, world: int) -> None:
    """LlamaAttention: this rank's query heads and the KV heads they read."""
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    group = h // kv
    if kv >= world:  # whole KV groups per rank (SmolLM2's 3 over 2 ranks: 1 and 2)
        k0, kn = _share(kv, rank, world)
        q0, qn = k0 * group, kn * group
    else:  # fewer KV heads than ranks: the query heads split, each rank keeps the KV head they read
        if world % kv or h % world:
            raise ValueError(f"tensor_parallel_size {world} exceeds the {kv} KV heads and does not split "
                             f"them and the {h} attention heads evenly")
        q0, qn = _share(h, rank, world)
        k0, kn = q0 // group, 1
    q_size, kv_size = h * d, kv * d
    _keep_rows(attn.qkv_proj, [(q0 * d, qn * d), (q_size + k0 * d, kn * d), (q_size + kv_size + k0 * d, kn * d)])
    _keep_cols(attn.o_proj, q0 * d, qn * d, rank)
    attn.num_heads, attn.num_kv_heads = qn, kn
    attn.q_size, attn.kv_size = qn * d, kn * d
    inner = attn.attn
    inner.num_heads, inner.num_kv_heads = qn, kn
    if inner.key_channel_rms is not None:
        inner.key_channel_rms = inner.key_channel_rms.view(kv, d)[k0:k0 + kn].reshape(-1).clone()


def _shard_mlp(mlp: nn.Module, rank: int, world: int) -> None:
    """LlamaMLP: this rank's slice of the intermediate width (of gate and of up alike)."""
    inter = mlp.gate_up_proj.weight.shape[0] // 2
    i0, n = _share(inter, rank, world)
    _keep_rows(mlp.gate_up_proj, [(i0, n), (inter + i0, n)])
    _keep_cols(mlp.down_proj, i0, n, rank)


class VocabShardEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding table (zero-padded to equal shards): each rank
    looks up the ids it holds, zeros for the others, and the all-reduce puts the rows together."""

    def __init__(self, weight: torch.Tensor, start: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.group = start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


def _vocab_shard(w: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a [vocab, hidden] table padded to ceil(vocab / world) rows, first row)."""
    vocab = w.shape[0]
    per = -(-vocab // world)
    start = rank * per
    part = w[start:min(vocab, start + per)]
    if part.shape[0] < per:
        part = torch.cat([part, part.new_zeros(per - part.shape[0], w.shape[1])])
    return part.contiguous(), start


def _all_reduce_output(group) -> Callable:
    def hook(module, args, out):
        return group.all_reduce(out)
    return hook


def shard_model(model: nn.Module, group, rank: int, world: int) -> None:
    """Split a loaded (not yet packed) model in place for `rank` of `world` (see the module
    docstring) and add its collectives: all-reduce after each attention and MLP, the embedding's
    all-reduce, and `compute_logits` gathering the full vocabulary on rank 0 (None elsewhere)."""
    from armserve.layers.quantized_linear import QuantizedLinear
    from armserve.models.llama import Linear, LlamaAttention, LlamaMLP
    from armserve.models.moe import SparseMoeBlock

    name = type(model).__name__
    if name not in TP_ARCHITECTURES:
        raise ValueError(f"tensor parallelism supports {', '.join(TP_ARCHITECTURES)}; not {name}")
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):
        raise ValueError("tensor parallelism needs float weights (load with quantization='none')")
    for layer in model.layers:
        if not isinstance(layer.self_attn, LlamaAttention):
            raise ValueError(f"{name}: layer attention {type(layer.self_attn).__name__} cannot be split")
        _shard_attention(layer.self_attn, rank, world)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            for expert in mlp.experts:
                _shard_mlp(expert, rank, world)
            if mlp.shared_expert is not None:
                _shard_mlp(mlp.shared_expert, rank, world)
        elif isinstance(mlp, LlamaMLP):
            _shard_mlp(mlp, rank, world)
        else:
            raise ValueError(f"{name}: MLP {type(mlp).__name__} cannot be split")
        layer.self_attn.register_forward_hook(_all_reduce_output(group))
        mlp.register_forward_hook(_all_reduce_output(group))
    vocab = model.config.vocab_size
    table, start = _vocab_shard(model.embed_tokens.weight.data, rank, world)
    model.embed_tokens = VocabShardEmbedding(table, start, group)
    if model.lm_head is not None:
        head = Linear(model.lm_head.in_features, table.shape[0])
        head.weight = nn.Parameter(_vocab_shard(model.lm_head.weight.data, rank, world)[0], requires_grad=False)
        model.lm_head = head
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor | None:
        full = group.gather(local_logits(hidden).float().contiguous())
        return None if full is None else full[:, :vocab]

    model.compute_logits = compute_logits  # an instance attribute: the class's method stays as it was
    model.tp_group = group


def load_model_shard(config, group, rank: int, world: int) -> tuple[nn.Module, torch.dtype, torch.dtype]:
    """(this rank's part of the model, its dtype, its KV cache dtype). Every rank reads the whole
    checkpoint and keeps its part (loading only the part is future work: peak memory is one full
    copy per rank while loading)."""
    from armserve import model_loader
    from armserve.config import resolve_dtype, resolve_kv_cache_dtype

    src = model_loader.resolve_model_path(config.model)
    hf = model_loader.load_config(src)
    dtype = resolve_dtype(config.dtype, model_loader.checkpoint_dtype(hf))
    if config.quantization not in (None, "none", "auto") or model_loader.armserve_quantization(hf) or src.is_gguf:
        logger.info("tensor parallel: quantized weights of %s are dequantized to %s", config.model,
                    str(dtype).replace("torch.", ""))
    model = model_loader.load_model(src, hf, dtype, "none", prepare=lambda m: shard_model(m, group, rank, world))
    return model, dtype, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)


# ---- the workers ----------------------------------------------------------------------------


def _worker_main(config, rank: int, world: int, comm: CommSpec, conn, bind: str | None, log_level: int) -> None:
    """A tensor-parallel rank > 0: load and split the model, allocate its KV cache shard, then run
    every step rank 0 sends until the pipe closes."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(asctime)s tp{rank} %(message)s")
    logger.setLevel(log_level)
    group = None
    try:
        from armserve.cpu import init_threads
        from armserve.engine.model_runner import ModelRunner

        if bind:
            # A spawned process inherits the affinity of the thread that started it, which may be
            # rank 0's own binding: take this rank's cores first (cgroup limits still apply).
            from armserve.cpu import parse_cpu_list

            os.sched_setaffinity(0, parse_cpu_list(bind))
        init_threads(bind=bind)
        group = comm.join(rank)
        model, dtype, cache_dtype = load_model_shard(config, group, rank, world)
        num_blocks = conn.recv()
        runner = ModelRunner(model, num_blocks, config.block_size, dtype, cache_dtype, config.max_model_len,
                             enforce_eager=True)
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
