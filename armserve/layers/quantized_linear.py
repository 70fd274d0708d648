"""Linear layers with int4 (w4a8) or int8 (w8a8) weights and per-token int8 activations.

Weights arrive as `QuantizedTensor`s (from an `armserve quantize` checkpoint or straight from
GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q6_K blocks, see gguf_quants.py), one per checkpoint tensor. A fused
layer (qkv, gate/up) collects its shards; `finalize()` then concatenates shards of the same
format into one *part* and repacks it into the kernel layout of csrc/qgemm.h once. A layer
whose shards differ in format (GGUF Q4_K_M mixes Q4_K and Q6_K) keeps several parts, each
writing its own column range of the output.

Dequantized meaning of the formats, per group of `group` input columns:
    w4:  w = scale * u - szp      u in 0..15 (unsigned code), szp = scale * zero point
    w8:  w = scale * q            q in -127..127
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from armserve import kernels
from armserve.layers.linear import Split


@dataclass
class QuantizedTensor:
    """One checkpoint weight [n, k] in an armserve quantized format (unpacked, row-major)."""

    fmt: str  # "w4" or "w8"
    codes: torch.Tensor  # w4: uint8 [n, k] values 0..15; w8: int8 [n, k]
    scales: torch.Tensor  # float32 [n, k // group]
    szp: torch.Tensor | None  # w4: float32 [n, k // group] (scale * zero point); w8: None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.group
        s = self.scales.repeat_interleave(g, dim=1)
        if self.fmt == "w4":
            return self.codes.float() * s - self.szp.repeat_interleave(g, dim=1)
        return self.codes.float() * s

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Output rows (dim 0) or input columns (dim 1, whole groups only) [start, start + length),
        copied, so that the rest can be freed (a tensor-parallel rank keeps its part only)."""
        g = self.group if dim == 1 else 1
        if start % g or length % g:
            raise ValueError(f"cannot be split at input columns {start}..{start + length} of {self.shape[1]}: "
                             f"not on the boundaries of its quantization groups of {g} columns (use a "
                             "tensor_parallel_size that splits the layer there, or quantization='none')")

        def cut(t: torch.Tensor, scale: int) -> torch.Tensor:
            return t.narrow(dim, start // scale, length // scale).clone(memory_format=torch.contiguous_format)

        return QuantizedTensor(self.fmt, cut(self.codes, 1), cut(self.scales, g),
                               None if self.szp is None else cut(self.szp, g), self.group)


def quantize_weight(w: torch.Tensor, group: int, symmetric: bool, search: bool = True) -> QuantizedTensor:
    """Round a float weight [n, k] to int4 codes with one scale (and zero point) per group.

    `search` (the default) picks each group's scale and offset to minimise the squared error of
    the dequantized group, as llama.cpp's k-quant rounding does, instead of stretching the 16 levels
    over [min, max]: a slightly narrower range that clips one outlier usually rounds the other 31
    weights better (about a quarter less squared error on Qwen2.5's projections).
    """
    n, k = w.shape
    if k % group:
        raise ValueError(f"input size {k} is not a multiple of the group size {group}")
    scale = torch.empty(n, k // group)
    szp = torch.empty(n, k // group)
    codes = torch.empty(n, k, dtype=torch.uint8)
    # Row chunks bound the temporaries (an LM head is 100M+ weights).
    step = max(1, (1 << 22) // k)
    for r in range(0, n, step):
        e = min(r + step, n)
        wg = w[r:e].float().reshape(-1, group)
        s, m, u = (_round_symmetric if symmetric else _round_asymmetric)(wg, search)
        scale[r:e] = s.view(e - r, -1)
        szp[r:e] = m.view(e - r, -1)
        codes[r:e] = u.view(e - r, k)
    return QuantizedTensor("w4", codes, scale, szp, group)


def _codes(x: torch.Tensor, s: torch.Tensor, szp: torch.Tensor) -> torch.Tensor:
    """Nearest codes 0..15 of x [groups, g] for w = s * u - szp (s, szp [groups, 1])."""
    return torch.clamp(torch.round((x + szp) / s), 0, 15)


def _sq_err(x: torch.Tensor, s: torch.Tensor, szp: torch.Tensor) -> torch.Tensor:
    return (_codes(x, s, szp) * s - szp - x).square().sum(dim=1, keepdim=True)


# Candidate inverse step sizes, in steps per group range: llama.cpp's k-quants try the 21 values
# 14.0..16.0 (`make_qkx2_quants`); wider ranges found nothing more on Qwen2.5's weights.
_SEARCH_STEPS = [14.0 + 0.1 * i for i in range(21)]


def _round_asymmetric(x: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, szp, codes) of groups x [groups, g], asymmetric: w = scale * u - szp, u in 0..15."""
    g = x.shape[1]
    lo = x.amin(dim=1, keepdim=True)
    hi = x.amax(dim=1, keepdim=True)
    rng = hi - lo
    flat = rng <= 0
    # Like GGUF's Q4_1: the group's exact minimum is the offset (a real-valued zero point), so the
    # 16 levels span [min, max] without wasting any on a range that includes 0.
    s = torch.where(flat, torch.ones_like(rng), rng / 15.0)
    szp = -lo
    if search:
        err = _sq_err(x, s, szp)
        inv = 1.0 / torch.where(flat, torch.ones_like(rng), rng)  # (x - lo is 0 in a flat group)
        sx = x.sum(dim=1, keepdim=True)
        for steps in _SEARCH_STEPS:
            u = torch.clamp(torch.round((x - lo) * (inv * steps)), 0, 15)
            # least-squares line x ~ a * u + b through this rounding
            su = u.sum(dim=1, keepdim=True)
            suu = u.square().sum(dim=1, keepdim=True)
            sxu = (x * u).sum(dim=1, keepdim=True)
            det = g * suu - su * su
            ok = det > 0
            det = torch.where(ok, det, torch.ones_like(det))
            a = (g * sxu - su * sx) / det
            b = (suu * sx - su * sxu) / det
            # a float16 scale must stay a normal number (the kernels read it as float16)
            ok &= a > 6.2e-5
            a = torch.where(ok, a, s)
            b = torch.where(ok, -b, szp)
            e = _sq_err(x, a, b)
            better = e < err
            err = torch.where(better, e, err)
            s = torch.where(better, a, s)
            szp = torch.where(better, b, szp)
    return s, szp, _codes(x, s, szp).to(torch.uint8)


def _round_symmetric(x: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, szp, codes) of groups x [groups, g], symmetric: codes u = q + 8, q in -8..7."""
    amax = x.abs().amax(dim=1, keepdim=True)
    s = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    if search:
        err = _sq_err(x, s, 8 * s)
        for f in (0.80, 0.85, 0.90, 0.95, 1.05, 1.10):
            a = s * f
            e = _sq_err(x, a, 8 * a)
            better = e < err
            err = torch.where(better, e, err)
            s = torch.where(better, a, s)
    return s, 8 * s, _codes(x, s, 8 * s).to(torch.uint8)


def quantize_weight_int8(w: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 codes, one scale per 32 columns (per row when k is not a multiple of 32).

    Used for a float shard of a fused layer whose other shards are quantized (GGUF files mix
    types, e.g. Q5_0 q/k beside Q6_K v): int8 keeps it within ~0.4% of each group's range.
    """
    n, k = w.shape
    group = 32 if k % 32 == 0 else k
    wg = w.float().reshape(n, k // group, group)
    scale = wg.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(wg / scale[..., None]), -127, 127).to(torch.int8)
    return QuantizedTensor("w8", codes.reshape(n, k), scale, None, group)


# ---- packing into the kernel layout (csrc/qgemm.h) -----------------------------------------


def _pad_rows(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    if t.shape[0] == n_pad:
        return t
    return torch.cat([t, t.new_zeros(n_pad - t.shape[0], *t.shape[1:])])


def kernel_scales(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` with the scales the kernels apply: float16 for w4 (packed inline, see csrc/qgemm.h),
    float32 for w8. Rounding a scale to float16 moves it by at most 2^-11 of itself, far below the
    4-bit step; GGUF Q4_0 / Q4_1 scales are float16 already, so only derived ones (Q4_K's d * sc,
    `armserve quantize`'s s * zero) change."""
    if qt.fmt != "w4":
        return qt
    return QuantizedTensor(qt.fmt, qt.codes, qt.scales.half().float(), qt.szp.half().float(), qt.group)


def pack(qt: QuantizedTensor) -> torch.Tensor:
    """The packed bytes the qgemm kernels read (csrc/qgemm.h): 16-row tiles, each group's weight
    chunks followed by its scales (w4: float16 s and s * zero point; w8: float32 s)."""
    n, k = qt.codes.shape
    g = qt.group
    n_pad = -(-n // 16) * 16
    tiles, ng = n_pad // 16, k // g
    codes = _pad_rows(qt.codes, n_pad)
    if qt.fmt == "w4":
        u = codes.view(tiles, 16, k // 8, 2, 4)
        wb = (u[:, :, :, 0, :] | (u[:, :, :, 1, :] << 4)).permute(0, 2, 1, 3).reshape(tiles, ng, g // 8 * 64)
        sc = torch.stack([_pad_rows(qt.scales, n_pad), _pad_rows(qt.szp, n_pad)], dim=0)  # [2, n_pad, ng]
        sc = sc.view(2, tiles, 16, ng).permute(1, 3, 0, 2).contiguous().half()  # [tiles, ng, 2, 16]
        wb = wb.to(torch.uint8)
    else:
        wb = codes.view(tiles, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(tiles, ng, g // 4 * 64)
        sc = _pad_rows(qt.scales, n_pad).float().view(tiles, 16, ng).permute(0, 2, 1).contiguous()  # [tiles, ng, 16]
        wb = wb.view(torch.uint8)
    return torch.cat([wb, sc.view(torch.uint8).view(tiles, ng, 64)], dim=2).flatten()


# ---- PyTorch reference ---------------------------------------------------------------------


def quantize_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token and group of `group` columns: (codes [m, k], scales [m, k // group],
    group sums [m, k // group]). One scale per group, not per token, so an outlier channel only
    costs its own group precision."""
    xf = x.float().reshape(-1, x.shape[-1])
    m, k = xf.shape
    xg = xf.view(m, k // group, group)
    amax = xg.abs().amax(dim=-1)
    nz = amax > 0
    scale = torch.where(nz, amax / 127.0, torch.ones_like(amax))
    # NOTE: not `127.0 / amax`: PyTorch computes a scalar-by-tensor division as a reciprocal times
    # 127, one ulp off the IEEE quotient the kernels use, which flips rounding ties.
    inv = torch.where(nz, torch.full_like(amax, 127.0) / amax, torch.ones_like(amax))
    q = torch.round(xg * inv[..., None]).to(torch.int8)  # round half to even, as the kernels
    return q.view(m, k), scale, q.sum(dim=-1, dtype=torch.int32)


def qlinear_ref(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """What the kernels compute: int8 activations times the dequantized weight (with the
    kernels' scales, `kernel_scales`), in float64."""
    q, scale, _ = quantize_act_ref(x, qt.group)
    xd = q.double() * scale.double().repeat_interleave(qt.group, dim=1)
    y = xd @ kernel_scales(qt).dequantize().double().T
    return y.to(x.dtype).reshape(*x.shape[:-1], qt.codes.shape[0])


def qgemm_dense_ref(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """What `kernels.qgemm_dense` (the prefill path) computes: x times the weight dequantized with the
    kernels' scales and rounded to bf16, summed in float64."""
    w = kernel_scales(qt).dequantize().to(torch.bfloat16)
    return (x.double() @ w.double().T).to(x.dtype)


# ---- the layer -----------------------------------------------------------------------------


_ACT_BUFFERS: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _act_buffers(m: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reused int8-activation buffers: a decode step quantizes ~90 activation rows, and three fresh
    allocations each cost more than the quantization itself. Safe because a layer's activations
    are consumed by its own GEMMs before the next layer quantizes (the engine runs one model
    step at a time); kept only for decode-sized inputs."""
    key = (m, k, group)
    buf = _ACT_BUFFERS.get(key)
    if buf is None:
        buf = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // group, dtype=torch.float32),
               torch.empty(m, k // group, dtype=torch.int32))
        if m <= 8:
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

    def finalize(self) -> None:
        """Concatenate same-format shards and repack them for the kernels (once, at load)."""
        missing = [s for s, _ in self.shards if s not in self._pending]
        if missing:
            raise ValueError(f"quantized layer is missing shard(s) {missing}")
        groups: list[list[QuantizedTensor]] = []
        for s, _ in self.shards:
            qt = self._pending[s]
            if groups and groups[-1][0].fmt == qt.fmt and groups[-1][0].group == qt.group:
                groups[-1].append(qt)
            else:
                groups.append([qt])
        col = 0
        for run in groups:
            qt = kernel_scales(QuantizedTensor(
                run[0].fmt,
                torch.cat([q.codes for q in run]),
                torch.cat([q.scales for q in run]),
                torch.cat([q.szp for q in run]) if run[0].fmt == "w4" else None,
                run[0].group,
            ))  # the PyTorch path (ref) then applies the kernels' scales too
            n = qt.codes.shape[0]
            if kernels.use_kernel("qgemm_pack", qt.codes):
                self.parts.append(_Part(qt.fmt, qt.group, col, n, pack(qt), None))
            else:
                self.parts.append(_Part(qt.fmt, qt.group, col, n, None, qt))
            col += n
        self._pending = {}

    @property
    def weight_bytes(self) -> int:
        return sum(p.packed.numel() for p in self.parts if p.packed is not None)

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
            if kernels.use_kernel("small", out):
                kernels.add_bias(out, self.bias)  # a decode step stays kernel calls only (step_graph.py)
            else:
                out += self.bias
        if self.split.reduce is not None:  # row-parallel: add the ranks' partial sums
            self.split.reduce.all_reduce(out)
        return out.view(*shape[:-1], self.out_features)

    def _forward_ref(self, x: torch.Tensor) -> torch.Tensor:
        # PyTorch path (no C++ kernels): the same math with a cached dequantized weight.
        parts = [p.ref if p.ref is not None else None for p in self.parts]
        if any(p is None for p in parts):
            raise RuntimeError("quantized weights were packed for kernels that are now unavailable")
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        if self._dequantized is None:
            self._dequantized = torch.cat([pp.ref.dequantize() for pp in self.parts])
        for p in self.parts:
            q, scale, _ = quantize_act_ref(x, p.group)
            xd = q.float() * scale.repeat_interleave(p.group, dim=1)
            out[:, p.col:p.col + p.n] = (xd @ self._dequantized[p.col:p.col + p.n].T).to(x.dtype)
        return out
