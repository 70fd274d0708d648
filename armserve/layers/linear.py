"""Linear layers and the token embedding, whole or split over tensor-parallel ranks.

A model is built inside `parallel_context(ctx)` (the loader does it for each rank); each layer
reads the context once, allocates only its rank's part and keeps only that part of each
checkpoint tensor its `weight_loader` is given, float or quantized alike (a `QuantizedTensor`
is cut at whole rows, or at whole groups of input columns). With one rank every part is the
whole tensor and no collective runs: the plain layers, bit for bit.

The Megatron-style split of a decoder over N ranks (distributed.py runs them):

    qkv_proj      QKVParallelLinear: rank r keeps its query heads and their KV heads (a KV head
                  shared by several ranks when there are fewer KV heads than ranks)
    o_proj        RowParallelLinear: the input columns of those heads; all-reduce of the output
    gate_up_proj  ColumnParallelLinear: its slice of the intermediate width, of gate and of up
    down_proj     RowParallelLinear; all-reduce (an MoE block: every expert split the same way,
                  one all-reduce of the block's output; the router is replicated)
    embed_tokens  VocabEmbedding: shares of ceil(vocab / N) rows (the last one shorter); a rank
                  looks up the ids it holds, zeros elsewhere; all-reduce
    lm_head       ParallelLMHead: the same vocabulary shares (a tied head is the embedding's);
                  logits gathered on rank 0 (`ParallelContext.gather_logits`), None elsewhere
    KV cache      each rank caches only its KV heads, in the same blocks

Every rank adds the partial sums in rank order, so all hold bit-identical activations.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from armserve import kernels


@dataclass(frozen=True)
class ParallelContext:
    """The rank a model is built for, of `world`, and the group its collectives go through
    (distributed.ShmGroup or GlooGroup: `all_reduce(x)`, `gather(x)`); one rank has none."""

    rank: int = 0
    world: int = 1
    group: Any = None

    def gather_logits(self, logits: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """Rank 0: every rank's vocabulary share of the logits side by side, cut to `vocab`;
        the other ranks: None. One rank: `logits` as they are."""
        if self.world == 1:
            return logits
        per = -(-vocab // self.world)  # the gather takes equal widths: the last share zero-padded
        full = self.group.gather(F.pad(logits.float(), (0, per - logits.shape[1])).contiguous())
        return None if full is None else full[:, :vocab]


_CONTEXT: ContextVar[ParallelContext] = ContextVar("armserve_parallel_context", default=ParallelContext())


@contextlib.contextmanager
def parallel_context(ctx: ParallelContext | None) -> Iterator[None]:
    """Layers built inside are `ctx`'s rank's part (None: one rank, whole layers)."""
    token = _CONTEXT.set(ctx or ParallelContext())
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def get_parallel_context() -> ParallelContext:
    """The context layers being built now take."""
    return _CONTEXT.get()


def share(n: int, rank: int, world: int) -> tuple[int, int]:
    """(first, count) of rank's part of n items split as evenly as possible (the first ranks get
    the smaller parts): a model whose heads or width the rank count does not divide still splits."""
    a, b = n * rank // world, n * (rank + 1) // world
    if b <= a:
        raise ValueError(f"tensor_parallel_size {world} leaves rank {rank} none of {n}")
    return a, b - a


@dataclass
class Split:
    """Which part of its checkpoint tensors a layer of this rank holds.

    rows:   (shard id, checkpoint rows, first row kept, rows kept) of each checkpoint tensor the
            layer is filled from, in the order of its output rows ("all" for a layer filled from
            one tensor; "q"/"k"/"v" or 0/1 for a fused one)
    cols:   (first, count) of the input columns kept (row-parallel); None: all
    reduce: the group whose all-reduce sums the output (row-parallel); None: no collective
    """

    in_features: int
    rows: list[tuple[Any, int, int, int]]
    cols: tuple[int, int] | None = None
    reduce: Any = None

    def sizes(self) -> list[tuple[Any, int]]:
        """(shard id, rows held) in output order (a QuantizedLinear's shards)."""
        return [(s, n) for s, _, _, n in self.rows]

    def _index(self, shard: Any) -> int:
        for i, r in enumerate(self.rows):
            if r[0] == shard:
                return i
        raise ValueError(f"has no shard {shard!r} (expected one of {[r[0] for r in self.rows]})")

    def take(self, shard: Any, t: Any) -> Any:
        """This rank's part of checkpoint tensor `t` (float or QuantizedTensor; weight or bias) of
        `shard`: its rows and its input columns."""
        i = self._index(shard)
        _, full, first, n = self.rows[i]
        expected = (full, self.in_features)[: len(t.shape)]
        if tuple(t.shape) != expected:
            raise ValueError(f"has shape {tuple(t.shape)}, expected {expected}")
        part = t if n == full else t.narrow(0, first, n)
        return part.narrow(1, *self.cols) if self.cols is not None and len(t.shape) == 2 else part

    def load(self, param: torch.Tensor, shard: Any, t: torch.Tensor) -> None:
        """Copy this rank's part of float tensor `t` of `shard` into its rows of `param`."""
        part = self.take(shard, t)
        start = sum(n for _, n in self.sizes()[: self._index(shard)])
        param.data.narrow(0, start, part.shape[0]).copy_(part)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """A linear layer, whole on every rank unless `split` says which part this rank holds (the
    parallel layers below build one), filled shard by shard through `weight_loader`.

    After loading, `finalize()` prepacks a bfloat16 or float32 weight for the dense GEMM kernel
    (every row count, decode to prefill) and drops the row-major copy; float16 keeps the skinny
    decode kernel and PyTorch's GEMM.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, split: Split | None = None) -> None:
        super().__init__()
        self.split = split or Split(in_features, [("all", out_features, 0, out_features)])
        self.in_features = in_features if self.split.cols is None else self.split.cols[1]
        self.out_features = sum(n for *_, n in self.split.rows)
        self.weight = _param(self.out_features, self.in_features)
        self.bias = _param(self.out_features) if bias else None
        self.packed: torch.Tensor | None = None
        self.lora = None  # LoRAWeights (layers/lora.py) when the engine serves adapters

    def weight_loader(self, name: str, tensor: torch.Tensor, shard: Any = "all") -> None:
        """Copy this rank's part of checkpoint tensor `tensor` (`shard` of a fused layer) into
        parameter `name` ("weight" or "bias")."""
        self.split.load(getattr(self, name), shard, tensor)

    def finalize(self) -> None:
        """Repack the weight into the kernel layout once (process_weights_after_loading; again
        later does nothing)."""
        if self.weight is not None and kernels.use_kernel("dense_pack", self.weight):
            pack = kernels.pack_f32 if self.weight.dtype == torch.float32 else kernels.pack_bf16
            self.packed = pack(self.weight.data)
            self.weight = None  # the packed copy is the weight now

    def row_blocks(self, rows: int) -> tuple[str, int, list[int]] | None:
        """("bf16", 0, addresses of the packed row blocks [0, rows), [rows, 2 rows), ...) for the
        fused MoE kernel (layers/fused_moe.py), or None unless packed in bfloat16."""
        if self.packed is None or self.packed.dtype != torch.bfloat16:  # float32 (its own GEMM) / float16
            return None
        block = -(-self.in_features // 2) * 64  # bytes of one 16-row block (dense_gemm.h)
        return "bf16", 0, [self.packed.data_ptr() + i * rows // 16 * block for i in range(self.out_features // rows)]

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None, with_bias: bool = True) -> torch.Tensor:
        """x @ W^T (+ bias; `with_bias=False` leaves it to a caller that fuses it into the next op)."""
        bias = self.bias if with_bias else None
        if self.packed is not None:
            out = kernels.dense(x, self.packed, self.out_features, self.in_features, out_dtype)
            if bias is not None:
                out = kernels.add_bias(out, bias)
        else:
            # Decode: a few tokens against 16-bit weights is memory-bound, where the kernel streams
            # the weight near copy speed and PyTorch's bf16 GEMM does not.
            if kernels.use_kernel("gemv", x):
                out = kernels.gemv(x, self.weight)
                out = out if bias is None else kernels.add_bias(out, bias)
            else:
                out = F.linear(x, self.weight, bias)
            if out_dtype is not None:
                out = out.to(out_dtype)
        if self.lora is not None:
            self.lora.apply_(x, out)
        # a row-parallel layer's output is this rank's partial sum until the ranks add theirs
        return out if self.split.reduce is None else self.split.reduce.all_reduce(out)


class ColumnParallelLinear(Linear):
    """Output rows split over the ranks in even slices; a fused layer (gate_up) is filled from
    the checkpoint tensors of `sizes` rows, shards 0, 1, ..., each sliced alike."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        tp = get_parallel_context()
        ids = ["all"] if len(sizes) == 1 else range(len(sizes))
        rows = [(s, n, *share(n, tp.rank, tp.world)) for s, n in zip(ids, sizes)]
        super().__init__(in_features, sum(sizes), bias, Split(in_features, rows))


class QKVParallelLinear(Linear):
    """q, k and v as one projection, split by heads: whole KV groups per rank (SmolLM2's 3 over 2
    ranks: 1 and 2); with fewer KV heads than ranks the query heads split evenly and each rank
    keeps the one KV head they read. `num_heads`, `num_kv_heads`: this rank's; `q_cols`: the
    input columns of the output projection that read its heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = get_parallel_context()
        h, kv, d, world = num_heads, num_kv_heads, head_dim, tp.world
        group = h // kv
        if kv >= world:
            k0, kn = share(kv, tp.rank, world)
            q0, qn = k0 * group, kn * group
        else:
            if world % kv or h % world:
                raise ValueError(f"tensor_parallel_size {world} exceeds the {kv} KV heads and does not split "
                                 f"them and the {h} attention heads evenly")
            q0, qn = share(h, tp.rank, world)
            k0, kn = q0 // group, 1
        rows = [("q", h * d, q0 * d, qn * d), ("k", kv * d, k0 * d, kn * d), ("v", kv * d, k0 * d, kn * d)]
        super().__init__(hidden_size, (h + 2 * kv) * d, bias, Split(hidden_size, rows))
        self.num_heads, self.num_kv_heads = qn, kn
        self.q_cols = (q0 * d, qn * d)


class RowParallelLinear(Linear):
    """Input columns split over the ranks (`input_cols`: those the layer before keeps, else even
    slices), the output summed over them by all-reduce (`reduce=False`: the caller sums, as an
    MoE block does once for all its experts). The bias lives on rank 0 only: the sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 input_cols: tuple[int, int] | None = None, reduce: bool = True) -> None:
        tp = get_parallel_context()
        cols = input_cols or share(in_features, tp.rank, tp.world)
        split = Split(in_features, [("all", out_features, 0, out_features)],
                      None if cols == (0, in_features) else cols, reduce=tp.group if reduce and tp.world > 1 else None)
        super().__init__(in_features, out_features, bias and tp.rank == 0, split)


def _vocab_split(vocab: int, hidden: int, tp: ParallelContext) -> Split:
    """Rows [rank * per, (rank + 1) * per) of a [vocab, hidden] table, per = ceil(vocab / world)."""
    per = -(-vocab // tp.world)
    start = min(vocab, tp.rank * per)
    return Split(hidden, [("all", vocab, start, min(vocab, start + per) - start)])


class ParallelLMHead(Linear):
    """The LM head, split by vocabulary as the embedding is; `compute_logits` gathers the shares."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, False, _vocab_split(vocab_size, hidden_size, get_parallel_context()))

    def weight_loader(self, name: str, tensor: torch.Tensor, shard: Any = "all") -> None:
        super().weight_loader(name, tensor, shard)
        # Packed as soon as loaded: the largest matrix of most models, its float copy would
        # otherwise wait beside every other weight until the load ends (a peak of one more head).
        self.finalize()


class VocabEmbedding(nn.Module):
    """Token embedding table (left uninitialised until the checkpoint fills it). Under tensor
    parallelism each rank holds a share of the rows, looks up the ids it holds (zeros for the
    others), and the all-reduce puts the rows together.

    A quantized checkpoint table (GGUF blocks) stays quantized: `weight_loader` keeps this rank's
    rows as they came in `table` (no float weight), which the model turns into a lookup that
    dequantizes only the rows asked for (quantization/embedding.py) once the weights are loaded.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_parallel_context()
        self.split = _vocab_split(vocab_size, hidden_size, tp)
        self.start = self.split.rows[0][2]
        self.group = tp.group if tp.world > 1 else None
        self.weight = _param(self.split.rows[0][3], hidden_size)
        self.dtype = self.weight.dtype  # of the rows it returns
        self.table: Any = None  # QuantizedTensor at load, then a quantization.embedding.QuantizedEmbedding

    def weight_loader(self, name: str, tensor: Any, shard: Any = "all") -> None:
        """This rank's rows of the checkpoint table: copied into `weight`, or kept quantized."""
        if isinstance(tensor, torch.Tensor):
            self.split.load(self.weight, shard, tensor)
            return
        self.table = self.split.take(shard, tensor)
        self.weight = None  # never written: no float table

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:  # ids of other ranks' rows come out as zeros
            out = self.table(input_ids, self.start)
            return out if self.group is None else self.group.all_reduce(out)
        if self.group is not None:
            local = input_ids - self.start
            outside = (local < 0) | (local >= self.weight.shape[0])
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out.masked_fill_(outside.unsqueeze(-1), 0)
            return self.group.all_reduce(out)
        if kernels.use_kernel("embedding", self.weight) and input_ids.dim() == 1:
            return kernels.embedding(input_ids, self.weight)
        return F.embedding(input_ids, self.weight)
