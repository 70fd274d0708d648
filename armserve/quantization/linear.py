"""Linear layers with int4 (w4a8), int8 (w8a8) or GGUF Q5_0 (w5a8) weights and per-token int8
activations.

Weights arrive as `QuantizedTensor`s (formats.py; from an `armserve quantize` checkpoint or
straight from GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q6_K blocks, see gguf.py), one per checkpoint tensor. A
fused layer (qkv, gate/up) collects its shards; `finalize()` then concatenates shards of the same
format into one *part* and repacks it into the kernel layout of csrc/qgemm.h once. A layer
whose shards differ in format (GGUF Q4_K_M mixes Q4_K and Q6_K) keeps several parts, each
writing its own column range of the output.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
from torch import nn

from armserve import kernels
from armserve.kernels import capture
from armserve.kernels.reference import quantize_act_ref
from armserve.layers.linear import Split
from armserve.quantization.formats import QuantizedTensor, kernel_scales, quantize_weight_int8, tile_bytes

_ACT_BUFFERS: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _act_buffers(m: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reused int8-activation buffers: a decode step quantizes ~90 activation rows, and three fresh
    allocations each cost more than the quantization itself. Safe because a layer's activations
    are consumed by its own GEMMs before the next layer quantizes (the engine runs one model
    step at a time); kept only for decode-sized inputs."""
    key = (m, k, group)
    buf = _ACT_BUFFERS.get(key)
    if buf is None:
        keep = m <= 8
        # (kept ones serve later steps and other step graphs: never in a recording's arena)
        with capture.persistent() if keep else contextlib.nullcontext():
            buf = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // group, dtype=torch.float32),
                   torch.empty(m, k // group, dtype=torch.int32))
        if keep:
            _ACT_BUFFERS[key] = buf
    return buf


@dataclass
class _Part:
    fmt: str
    group: int
    col: int  # first output column
    n: int
    packed: torch.Tensor | None
    ref: QuantizedTensor | None  # kept only when the kernels are unavailable


class QuantizedLinear(nn.Module):
    """y = x @ W^T (+ bias) with W quantized; `shards` lists (shard id, rows) of a fused layer.

    `split` (layers/linear.py): the part of each checkpoint tensor this tensor-parallel rank
    holds and the all-reduce of a row-parallel layer, taken over from the float layer this one
    replaces; by default the whole of each shard, no collective.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, shards: list[tuple[object, int]],
                 split: Split | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.shards = shards
        self.split = split or Split(in_features, [(s, n, 0, n) for s, n in shards])
        self._pending: dict[object, QuantizedTensor] = {}
        self.parts: list[_Part] = []
        self._dequantized: torch.Tensor | None = None
        self.lora = None  # LoRAWeights (layers/lora.py): the adapters' deltas, in float, over the quantized base

    def weight_loader(self, name: str, tensor: torch.Tensor | QuantizedTensor, shard: object = "all") -> None:
        """This rank's part of a checkpoint tensor, as Linear.weight_loader; a float weight (a fused
        layer's shard beside quantized ones, as GGUF files mix types) is quantized to int8 first."""
        if name == "bias":
            self.split.load(self.bias, shard, tensor)
            return
        part = self.split.take(shard, tensor)
        self.load_shard(shard, part if isinstance(part, QuantizedTensor) else quantize_weight_int8(part))

    def load_shard(self, shard: object, qt: QuantizedTensor) -> None:
        rows = dict(self.shards)[shard]
        if qt.shape != (rows, self.in_features):
            raise ValueError(f"quantized shard {shard} has shape {qt.shape}, expected {(rows, self.in_features)}")
        self._pending[shard] = qt
        if len(self._pending) == len(self.shards):
            # NOTE: packed as soon as the layer is complete, not after the whole checkpoint: the
            # unpacked codes (a byte per 4-bit weight) then never pile up beside the packed ones.
            self.finalize()

    def finalize(self) -> None:
        """Concatenate same-format shards and repack them for the kernels (once, at load; again
        later does nothing)."""
        if self.parts and not self._pending:
            return
        missing = [s for s, _ in self.shards if s not in self._pending]
        if missing:
            raise ValueError(f"quantized layer is missing shard(s) {missing}")
        col = 0
        shards = (self._pending[s] for s, _ in self.shards)
        for (fmt, group), same in itertools.groupby(shards, key=lambda q: (q.fmt, q.group)):
            run = list(same)

            def cat(ts: list[torch.Tensor]) -> torch.Tensor:
                return ts[0] if len(ts) == 1 else torch.cat(ts)  # (one shard: no copy)

            szp = cat([q.szp for q in run]) if run[0].szp is not None else None  # (w4; w6's d)
            qt = kernel_scales(QuantizedTensor(fmt, cat([q.codes for q in run]), cat([q.scales for q in run]), szp,
                                               group))
            del run
            # (the PyTorch path, `ref`, then applies the kernels' scales too)
            n = qt.codes.shape[0]
            packed = kernels.pack_q(qt) if kernels.use_kernel("qgemm_pack", qt.codes) else None
            self.parts.append(_Part(fmt, group, col, n, packed, None if packed is not None else qt))
            col += n
        self._pending = {}

    @property
    def weight_bytes(self) -> int:
        return sum(p.packed.numel() for p in self.parts if p.packed is not None)

    def row_blocks(self, rows: int) -> tuple[str, int, list[int]] | None:
        """(format, group, addresses of the packed row blocks [0, rows), [rows, 2 rows), ...) for
        the fused MoE kernel (layers/fused_moe.py), or None where it cannot read them in one format."""
        parts, k = self.parts, self.in_features
        if not parts or any(p.packed is None or p.fmt != parts[0].fmt or p.group != parts[0].group for p in parts):
            return None
        fmt, group = parts[0].fmt, parts[0].group
        tile = tile_bytes(fmt, k, group)
        addrs = []
        for p in parts:  # a part may hold several of the row ranges (a fused gate_up), or one
            if p.col % rows or p.n % rows:
                return None
            addrs += [p.packed.data_ptr() + i * rows // 16 * tile for i in range(p.n // rows)]
        return fmt, group, addrs

    def keep_row_tiles(self, tiles: list[int]) -> tuple[QuantizedLinear, torch.Tensor]:
        """(a layer computing only the output rows of these 16-row tiles, in ascending order; those
        rows' indices here): the tiles' packed bytes copied, nothing repacked or requantized, so each
        kept row's output is bit for bit this layer's. For a draft model's LM head over part of the
        vocabulary (engine/draft_proposer.py)."""
        if len(self.parts) != 1 or self.bias is not None or self.lora is not None or self.split.reduce is not None:
            raise ValueError("only a single-format layer without bias, adapters or a tensor-parallel split "
                             "keeps a subset of its rows")
        p = self.parts[0]
        last = -(-p.n // 16) - 1
        if not tiles or tiles != sorted(set(tiles)) or tiles[0] < 0 or tiles[-1] > last:
            raise ValueError(f"row tiles must be ascending, distinct and within 0..{last}")
        # (the last tile may be partial: the kernels then write its real rows only, as here)
        rows = torch.cat([torch.arange(16 * t, min(16 * t + 16, p.n)) for t in tiles])
        n = rows.numel()
        out = QuantizedLinear(self.in_features, n, False, [("all", n)])
        if p.packed is not None:
            tile = tile_bytes(p.fmt, self.in_features, p.group)
            packed = p.packed.view(-1, tile).index_select(0, torch.tensor(tiles)).view(-1)
            out.parts = [_Part(p.fmt, p.group, 0, n, packed, None)]
        else:
            q = p.ref
            out.parts = [_Part(p.fmt, p.group, 0, n, None, QuantizedTensor(
                q.fmt, q.codes[rows], q.scales[rows], None if q.szp is None else q.szp[rows], q.group))]
        return out, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.parts and self.parts[0].packed is not None and kernels.use_kernel("qgemm", x2):
            out = torch.empty(x2.shape[0], self.out_features, dtype=x.dtype)
            acts: dict[int, tuple] = {}
            for p in self.parts:
                if kernels.use_kernel("qgemm_dense", x2, fmt=p.fmt):  # prefill rows: bf16 tiles
                    kernels.qgemm_dense(p.fmt, out, p.col, x2, p.packed, p.n, p.group)
                    continue
                if p.group not in acts:  # one activation quantization per group size
                    acts[p.group] = kernels.quantize_act(x2, p.group, _act_buffers(x2.shape[0], x2.shape[1], p.group))
                kernels.qgemm(p.fmt, out, p.col, acts[p.group], p.packed, p.n, p.group)
        else:
            out = self._forward_ref(x2)
        if self.bias is not None:
            kernels.add_bias(out, self.bias)  # the kernel on a decode step's rows: it stays kernel calls only
        if self.lora is not None:
            self.lora.apply_(x2, out)
        if self.split.reduce is not None:  # row-parallel: add the ranks' partial sums
            self.split.reduce.all_reduce(out)
        return out.view(*shape[:-1], self.out_features)

    def _forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch path (no C++ kernels): the same math with a cached dequantized weight.
        if any(p.ref is None for p in self.parts):
            raise RuntimeError("quantized weights were packed for kernels that are now unavailable")
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if self._dequantized is None:
            self._dequantized = torch.cat([pp.ref.dequantize() for pp in self.parts])
        for p in self.parts:
            q, scale, _ = quantize_act_ref(x, p.group)
            xd = q.float() * scale.repeat_interleave(p.group, dim=1)
            out[:, p.col:p.col + p.n] = (xd @ self._dequantized[p.col:p.col + p.n].T).to(x.dtype)
        return out
