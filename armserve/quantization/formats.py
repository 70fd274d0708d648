"""armserve's quantized weight formats: `QuantizedTensor`, rounding float weights to them, and
the packed layout the qgemm kernels read (csrc/qgemm.h).

Dequantized meaning of the formats, per group of `group` input columns:
    w4:  w = scale * u - szp      u in 0..15 (unsigned code), szp = scale * zero point
    w8:  w = scale * q            q in -127..127
    w8h: w8 whose scales are float16 values (GGUF Q8_0) and whose rows hold an even number of
         groups: packed with float16 scales, two groups' to a block (8.5 bits a weight, not 9)
    w5:  w = scale * (u - 16)     u in 0..31 (GGUF Q5_0 as stored), group 32
    w6:  w = scale * (u - 32)     u in 0..63 (GGUF Q6_K as stored), group 16, scale = d * sc with
                                  an int8 sub-scale sc per group and d (`szp`) per 256 columns
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class QuantizedTensor:
    """One checkpoint weight [n, k] in an armserve quantized format (unpacked, row-major)."""

    fmt: str  # "w4", "w8", "w8h", "w5" or "w6"
    codes: torch.Tensor  # w4: uint8 [n, k] values 0..15; w8, w8h: int8 [n, k]; w5, w6: uint8 [n, k] values 0..31, 0..63
    scales: torch.Tensor  # float32 [n, k // group]
    # w4: float32 [n, k // group] (scale * zero point); w6: float32 [n, k // 256], the factor d of
    # each 256 columns' scales (d * an int8); w8, w8h, w5: None
    szp: torch.Tensor | None
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [n, k]."""
        g = self.group
        s = self.scales.repeat_interleave(g, dim=1)
        if self.fmt == "w4":
            return self.codes.float() * s - self.szp.repeat_interleave(g, dim=1)
        if self.fmt in PLANE_OFFSETS:  # (u - offset as an integer first: the w8 codes of the same blocks)
            return (self.codes.to(torch.int16) - PLANE_OFFSETS[self.fmt]).float() * s
        return self.codes.float() * s

    def as_w8(self) -> QuantizedTensor:
        """The same weight as w8, exactly: a w5 / w6 one's int8 codes u - offset, a w8h one's codes as
        they are, the same scales (a split the compact layouts cannot hold)."""
        if self.fmt == "w8h":
            return QuantizedTensor("w8", self.codes, self.scales, None, self.group)
        if self.fmt not in PLANE_OFFSETS:
            return self
        codes = (self.codes.to(torch.int16) - PLANE_OFFSETS[self.fmt]).to(torch.int8)
        return QuantizedTensor("w8", codes, self.scales, None, self.group)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Output rows (dim 0) or input columns (dim 1, whole groups only) [start, start + length),
        copied, so that the rest can be freed (a tensor-parallel rank keeps its part only)."""
        g = self.group if dim == 1 else 1
        if dim == 1 and self.fmt == "w8h" and length // self.group % 2:  # (w8h packs groups in pairs)
            return self.as_w8().narrow(dim, start, length)
        if dim == 1 and self.fmt == "w6":
            if start % W6_SUPER or length % W6_SUPER:  # (a split inside d's 256 columns: as w8, exactly)
                return self.as_w8().narrow(dim, start, length)
            g = W6_SUPER
        if start % g or length % g:
            raise ValueError(f"cannot be split at input columns {start}..{start + length} of {self.shape[1]}: "
                             f"not on the boundaries of its quantization groups of {g} columns (use a "
                             "tensor_parallel_size that splits the layer there, or quantization='none')")

        def cut(t: torch.Tensor, scale: int) -> torch.Tensor:
            return t.narrow(dim, start // scale, length // scale).clone(memory_format=torch.contiguous_format)

        sg = self.group if dim == 1 else 1
        return QuantizedTensor(self.fmt, cut(self.codes, 1), cut(self.scales, sg),
                               None if self.szp is None else cut(self.szp, g), self.group)

    def split(self, sizes: list[int]) -> list[QuantizedTensor]:
        """Row blocks of `sizes` rows, as torch.Tensor.split (a fused checkpoint weight cut into its
        projections; each row has its own scales), copied as `narrow` does."""
        return [self.narrow(0, start, n) for start, n in zip(itertools.accumulate(sizes, initial=0), sizes)]


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


def kernel_scales(qt: QuantizedTensor) -> QuantizedTensor:
    """`qt` with the scales the kernels apply: float16 for w4 and w5 (packed inline, see
    csrc/qgemm.h), float32 for w8. Rounding a scale to float16 moves it by at most 2^-11 of itself,
    far below the 4-bit step; GGUF Q4_0 / Q4_1 / Q5_0 scales are float16 already, so only derived
    ones (Q4_K's d * sc, `armserve quantize`'s s * zero) change. w6 keeps its exact d * sc; w8h's
    scales are float16 values (GGUF Q8_0's d)."""
    if qt.fmt in ("w8", "w6", "w8h"):
        return qt
    szp = None if qt.szp is None else qt.szp.half().float()
    return QuantizedTensor(qt.fmt, qt.codes, qt.scales.half().float(), szp, qt.group)


def packed_bytes(fmt: str, n: int, k: int, group: int) -> int:
    """Bytes of an [n, k] weight packed for the qgemm kernels (`pack`): whole 16-row tiles of
    codes (w4: half a byte a weight, w8: a byte) and 64 bytes of scales per group; w5: 352 bytes
    per group of 32 columns (low nibbles, the plane of bit 4, float16 scales: 5.5 bits a weight);
    w6: 3392 bytes per 256 columns (low nibbles, the plane of bits 4-5, int8 sub-scales, float32 d:
    6.625 bits a weight); w8h: 32 bytes of float16 scales per group."""
    return -(-n // 16) * tile_bytes(fmt, k, group)


W5_GROUP = 32  # the one group size of w5 (GGUF Q5_0's block)
W6_GROUP, W6_SUPER = 16, 256  # w6's group and the columns sharing one d (GGUF Q6_K's sub-block and block)
PLANE_OFFSETS = {"w5": 16, "w6": 32}  # the code offset of the formats with a plane of high bits


def tile_bytes(fmt: str, k: int, group: int) -> int:
    """Bytes of one 16-row tile of a packed [n, k] weight (csrc/qgemm.h)."""
    if fmt == "w5":
        if group != W5_GROUP or k % group:
            raise ValueError(f"w5 weights come in groups of {W5_GROUP} columns, not {group} (k = {k})")
        return k // W5_GROUP * 352
    if fmt == "w6":
        if group != W6_GROUP or k % W6_SUPER:
            raise ValueError(f"w6 weights come in groups of {W6_GROUP} columns and rows of a multiple of "
                             f"{W6_SUPER}, not group {group}, k = {k}")
        return k // W6_SUPER * 3392
    if fmt == "w8h":
        if k % (2 * group):
            raise ValueError(f"w8h weights hold an even number of groups of {group} columns, not k = {k}")
        return 16 * k + 32 * (k // group)
    return (8 * k if fmt == "w4" else 16 * k) + 64 * (k // group)


def pack(qt: QuantizedTensor) -> torch.Tensor:
    """The packed bytes the qgemm kernels read (csrc/qgemm.h): 16-row tiles, each group's weight
    chunks followed by its scales (w4: float16 s and s * zero point; w8: float32 s). Packed a few
    MB of rows at a time straight into the result, so that the temporaries stay small beside it
    (an LM head is 100M+ weights)."""
    n, k = qt.codes.shape
    tile = tile_bytes(qt.fmt, k, qt.group)  # bytes of a 16-row tile
    out = torch.empty(packed_bytes(qt.fmt, n, k, qt.group), dtype=torch.uint8)
    step = max(16, (1 << 22) // k // 16 * 16)
    for r in range(0, n, step):
        e = min(r + step, n)
        szp = None if qt.szp is None else qt.szp[r:e]
        _pack_rows(QuantizedTensor(qt.fmt, qt.codes[r:e], qt.scales[r:e], szp, qt.group),
                   out[r // 16 * tile:-(-e // 16) * tile])
    return out


def _pack_rows(qt: QuantizedTensor, out: torch.Tensor) -> None:
    """`pack` of rows that fit in memory several times over, into `out` (their whole tiles' bytes).

    The weight bytes move as int32 words (4 codes of a row, or 4 pairs of nibbles), so each copy
    that reorders them moves a quarter as many elements as a byte-wise one: loading a GGUF spent
    most of its time here otherwise."""
    n, k = qt.codes.shape
    g = qt.group
    n_pad = -(-n // 16) * 16
    tiles, ng = n_pad // 16, k // g
    codes, scales, szp = qt.codes, qt.scales, qt.szp
    if n_pad != n:  # zero rows up to whole tiles
        rows = (0, 0, 0, n_pad - n)
        codes, scales = F.pad(codes, rows), F.pad(scales, rows)
        szp = None if szp is None else F.pad(szp, rows)
    if qt.fmt == "w5":
        _pack_w5(codes, scales, out.view(torch.int32).view(tiles, ng, 88))
        return
    if qt.fmt == "w6":
        _pack_w6(codes, scales, szp, out.view(tiles, k // W6_SUPER, 3392))
        return
    if qt.fmt == "w8h":  # per pair of groups: both groups' words, then their 2 x 16 float16 scales
        w = codes.contiguous().view(torch.int32).view(tiles, 16, ng // 2, 2 * g // 4).permute(0, 2, 3, 1)
        sc = scales.half().view(tiles, 16, ng // 2, 2).permute(0, 2, 3, 1).contiguous().view(torch.int32)
        dst = out.view(torch.int32).view(tiles, ng // 2, -1)
        dst[:, :, :-16] = w.reshape(tiles, ng // 2, -1)
        dst[:, :, -16:] = sc.reshape(tiles, ng // 2, 16)
        return
    words = codes.contiguous().view(torch.int32)  # [n_pad, k // 4]: 4 columns a word
    dst = out.view(torch.int32).view(tiles, ng, -1)  # per tile and group: weight words, then 16 scale words
    if qt.fmt == "w4":
        # columns 8c..8c+3 in the low nibbles, 8c+4..8c+7 in the high ones (codes are 0..15)
        w = words.view(tiles, 16, k // 8, 2)
        w = (w[..., 0] | (w[..., 1] << 4)).permute(0, 2, 1)  # [tiles, k // 8, 16]
        sc = torch.stack([scales, szp], dim=0).half()  # [2, n_pad, ng]
        sc = sc.view(2, tiles, 16, ng).permute(1, 3, 0, 2).contiguous().view(tiles, ng, 32).view(torch.int32)
    else:
        w = words.view(tiles, 16, k // 4).permute(0, 2, 1)  # [tiles, k // 4, 16]
        sc = scales.float().view(tiles, 16, ng).permute(0, 2, 1).contiguous().view(torch.int32)  # [tiles, ng, 16]
    nw = dst.shape[2] - 16
    dst[:, :, :nw] = w.reshape(tiles, ng, nw)
    dst[:, :, nw:] = sc


def _pack_w5(codes: torch.Tensor, scales: torch.Tensor, dst: torch.Tensor) -> None:
    """w5 rows (whole tiles, [n_pad, k]) into dst int32 [tiles, groups, 88] (csrc/qgemm.h): per group
    64 words of low nibbles (w4's chunk order), 16 of the bit-4 plane, 8 of float16 scales."""
    tiles, ng = dst.shape[:2]
    c = codes.view(tiles, 16, ng, 4, 2, 4).to(torch.int32)  # [tile, row, group, chunk cl, nibble h, byte j]
    low = c & 15
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [tile, group, cl, row, j]
    # plane byte (row, j): bit cl from chunk cl's low-nibble code, bit 4 + cl from its high-nibble one
    shift = (torch.arange(4).view(4, 1, 1) + 4 * torch.arange(2).view(1, 2, 1)).to(torch.int32)
    plane = ((c >> 4) << shift).sum(dim=(3, 4)).permute(0, 2, 1, 3)  # [tile, group, row, j]
    dst[:, :, :64] = nibbles.to(torch.uint8).contiguous().view(torch.int32).view(tiles, ng, 64)
    dst[:, :, 64:80] = plane.to(torch.uint8).contiguous().view(torch.int32).view(tiles, ng, 16)
    sc = scales.half().view(tiles, 16, ng).permute(0, 2, 1).contiguous().view(torch.int32)  # [tiles, ng, 8]
    dst[:, :, 80:] = sc


def _pack_w6(codes: torch.Tensor, scales: torch.Tensor, d: torch.Tensor, dst: torch.Tensor) -> None:
    """w6 rows (whole tiles, [n_pad, k]; d [n_pad, k // 256]) into dst uint8 [tiles, super-blocks, 3392]
    (csrc/qgemm.h): per super-block 16 groups of 2 chunks of low nibbles (w4's chunk order) and the
    plane of bits 4-5, then the int8 sub-scales scales / d [group][row], then float32 d [row]."""
    tiles, nsb = dst.shape[:2]
    c = codes.view(tiles, 16, nsb, 16, 2, 2, 4).to(torch.int32)  # [tile, row, sb, group, chunk cl, nibble h, byte j]
    low = c & 15
    nibbles = (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 4, 1, 5)  # [tile, sb, group, cl, row, j]
    # plane byte (row, j): bits 2cl..2cl+1 from chunk cl's low-nibble code, 4 + 2cl.. from its high-nibble one
    shift = (2 * torch.arange(2).view(2, 1, 1) + 4 * torch.arange(2).view(1, 2, 1)).to(torch.int32)
    plane = ((c >> 4) << shift).sum(dim=(4, 5)).permute(0, 2, 3, 1, 4)  # [tile, sb, group, row, j]
    groups = torch.cat([nibbles.reshape(tiles, nsb, 16, 128), plane.reshape(tiles, nsb, 16, 64)], dim=-1)
    dst[:, :, :3072] = groups.to(torch.uint8).reshape(tiles, nsb, 3072)
    df = d.float().view(tiles, 16, nsb)
    safe = torch.where(df == 0, torch.ones_like(df), df).repeat_interleave(16, dim=2)
    sc = scales.float().view(tiles, 16, -1) / safe
    sc = torch.where(df.repeat_interleave(16, dim=2) == 0, torch.zeros_like(sc), sc)
    sc = sc.to(torch.int8).view(tiles, 16, nsb, 16).permute(0, 2, 3, 1)  # [tile, sb, group, row]
    dst[:, :, 3072:3328] = sc.contiguous().view(torch.uint8).reshape(tiles, nsb, 256)
    dst[:, :, 3328:] = df.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(tiles, nsb, 64)
