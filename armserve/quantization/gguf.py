"""GGUF quantized blocks -> armserve's int4/int8 formats (formats.py), bit-exactly, without a
float detour.

    Q4_0  (32 per block: d, 4-bit q; w = d * (q - 8))          -> w4, group 32, szp = 8 d
    Q4_1  (32 per block: d, m, 4-bit q; w = d * q + m)          -> w4, group 32, szp = -m
    Q4_K  (256 per super-block, 8 sub-blocks of 32 with 6-bit scale and min;
           w = d * sc * q - dmin * mn)                          -> w4, group 32, szp = dmin * mn
    Q8_0  (32 per block: d, int8 q; w = d * q)                  -> w8h, group 32 (w8 for an odd
                                                                   number of blocks a row)
    Q5_0  (32 per block: d, 5-bit q; w = d * (q - 16))         -> w5, group 32
    Q6_K  (256 per super-block, 16 sub-blocks of 16 with int8 scales, 6-bit q;
           w = d * sc * (q - 32))                               -> w6, group 16 (d per 256 in szp)
Layouts follow llama.cpp's ggml-common.h block structs (read for the bit positions only).
Other types are not converted (the caller dequantizes them to float).

A token table is not converted at all when the model's head is its own tensor: `GGUFRows` keeps
it as the file stores it, for the `gguf_embedding` kernel to read where the file is mapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from armserve.quantization.formats import QuantizedTensor

# ggml_type codes of the types whose rows the `gguf_embedding` kernel reads as stored (csrc/gguf_rows.h)
GGUF_ROW_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "BF16": 30}
# armserve format and group each converted type becomes (the converters below)
# (Q8_0: w8 where a row has an odd number of blocks; `gguf_format`)
GGUF_FORMATS = {"Q4_0": ("w4", 32), "Q4_1": ("w4", 32), "Q4_K": ("w4", 32), "Q5_0": ("w5", 32), "Q8_0": ("w8h", 32),
                "Q6_K": ("w6", 16)}


def gguf_format(type_name: str, k: int) -> tuple[str, int] | None:
    """armserve format and group a GGUF tensor of this type with rows of k values becomes, or None."""
    fmt = GGUF_FORMATS.get(type_name)
    if fmt == ("w8h", 32) and k % 64:
        return "w8", 32
    return fmt


@dataclass
class GGUFRows:
    """A GGUF table's rows as the file stores them: uint8 [n, bytes per row], a view of the file's
    memory map (nothing copied; the map stays open while a view of it lives), `k` values a row."""

    type_name: str
    rows: np.ndarray
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.k

    def narrow(self, dim: int, start: int, length: int) -> GGUFRows:
        """Rows [start, start + length) (a tensor-parallel rank's vocabulary share), still a view."""
        if dim != 0:
            raise ValueError("a GGUF table kept as stored is split by rows only")
        return GGUFRows(self.type_name, self.rows[start:start + length], self.k)

    def dequantize(self, r: np.ndarray) -> torch.Tensor:
        """float32 [len(r), k] of rows r, as the loader converts them: the `gguf_embedding`
        kernel's reference."""
        data = np.ascontiguousarray(self.rows[r])
        if self.type_name == "F32":
            return torch.from_numpy(data.view(np.float32).copy())
        if self.type_name == "F16":
            return torch.from_numpy(data.view(np.float16).astype(np.float32))
        if self.type_name == "BF16":
            return torch.from_numpy((data.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
        return convert(self.type_name, data).dequantize()  # type: ignore[union-attr]


def gguf_rows(type_name: str, data: np.ndarray, rows: int, k: int) -> GGUFRows | None:
    """A GGUF tensor's blocks (`data`, the reader's view) as GGUFRows, or None for a type the
    `gguf_embedding` kernel does not read."""
    if type_name not in GGUF_ROW_TYPES:
        return None
    table = np.ascontiguousarray(data).reshape(rows, -1).view(np.uint8)  # (a view: the data is contiguous)
    return GGUFRows(type_name, table, k)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from the last axis of 2 bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)


def _q4_0(data: np.ndarray) -> QuantizedTensor:
    b = _blocks(data, 18)
    d = _f16(b[..., 0:2])
    qs = b[..., 2:18]
    u = np.concatenate([qs & 15, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
    return _w4(u, d, 8.0 * d, 32)


def _q4_1(data: np.ndarray) -> QuantizedTensor:
    b = _blocks(data, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    qs = b[..., 4:20]
    u = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return _w4(u, d, -m, 32)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in Q4_K's 12 scale bytes."""
    sc = sc.astype(np.uint8)
    scale = np.empty(sc.shape[:-1] + (8,), np.uint8)
    mins = np.empty_like(scale)
    scale[..., :4] = sc[..., 0:4] & 63
    mins[..., :4] = sc[..., 4:8] & 63
    scale[..., 4:] = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return scale.astype(np.float32), mins.astype(np.float32)


def _q4_k(data: np.ndarray) -> QuantizedTensor:
    b = _blocks(data, 144)
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k4_scales(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 32)  # 4 chunks of 64 values
    u = np.stack([qs & 15, qs >> 4], axis=3).reshape(*b.shape[:2], 256)  # low nibbles first
    return _w4(u, d[..., None] * sc, dmin[..., None] * mn, 32)


def _q8_0(data: np.ndarray) -> QuantizedTensor:
    b = _blocks(data, 34)
    d = _f16(b[..., 0:2])
    q = b[..., 2:34].view(np.int8)
    # held with its float16 d as stored (w8h: 8.5 bits a weight, w8's float32 scales took 9), where
    # a row has an even number of blocks (the layout pairs them); the same products either way
    fmt, _ = gguf_format("Q8_0", b.shape[1] * 32)
    return QuantizedTensor(fmt, _rows(q, np.int8), _rows(d, np.float32), None, 32)


def _q5_0(data: np.ndarray) -> QuantizedTensor:
    # Q5_0 is what llama.cpp writes for rows too short for k-quants (Qwen2.5-0.5B's hidden size 896
    # is not a multiple of 256: most of its Q4_K_M file is Q5_0): held as w5, 5.5 bits a weight as
    # in the file (w8 took 9), and computed bit for bit as w8 computed the same blocks.
    b = _blocks(data, 22)
    d = _f16(b[..., 0:2])
    # qh: a little-endian uint32 whose bit j is the 5th bit of element j, i.e. bit j % 8 of byte j // 8
    high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # [rows, blocks, 32] of 0/1
    qs = b[..., 6:22]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
    q |= high << 4
    return QuantizedTensor("w5", _rows(q, np.uint8), _rows(d, np.float32), None, 32)


def _q6_k(data: np.ndarray) -> QuantizedTensor:
    b = _blocks(data, 210)
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 64)
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210])
    # Each half of 128 values: 4 runs of 32 built from ql's nibbles and 2 bits of qh each.
    lo_a, lo_b = ql[..., :32], ql[..., 32:]
    q = np.stack([
        (lo_a & 15) | (((qh >> 0) & 3) << 4),
        (lo_b & 15) | (((qh >> 2) & 3) << 4),
        (lo_a >> 4) | (((qh >> 4) & 3) << 4),
        (lo_b >> 4) | (((qh >> 6) & 3) << 4),
    ], axis=3)  # [rows, blocks, 2 halves, 4 runs, 32], codes 0..63
    # held as w6, 6.625 bits a weight as in the file (w8 took 10), computed bit for bit as w8 computed
    # the same blocks: d * sc is exact in float32
    u = q.reshape(*b.shape[:2], 256)
    return QuantizedTensor("w6", _rows(u, np.uint8), _rows(d[..., None] * sc, np.float32), _rows(d, np.float32), 16)


def _w4(u: np.ndarray, scale: np.ndarray, szp: np.ndarray, group: int) -> QuantizedTensor:
    return QuantizedTensor("w4", _rows(u, np.uint8), _rows(scale, np.float32), _rows(szp, np.float32), group)


def _rows(a: np.ndarray, dtype: type) -> torch.Tensor:
    """[rows, blocks, ...] as a contiguous [rows, rest] tensor of `dtype`."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype).reshape(a.shape[0], -1))


_CONVERTERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q6_K": _q6_k}


def convert(type_name: str, data: np.ndarray) -> QuantizedTensor | None:
    """armserve format of one GGUF tensor's raw blocks ([rows, bytes per row]), or None when
    `type_name` has no direct conversion. Converted a few MB of blocks at a time into the result:
    the unpacking's temporaries (several times the blocks' size) stay small beside it."""
    fn = _CONVERTERS.get(type_name)
    if fn is None:
        return None
    rows = data.shape[0]
    step = max(1, (1 << 22) // max(1, data.shape[1]))
    first = fn(data[:step])
    if rows <= step:
        return first
    parts = [t for t in (first.codes, first.scales, first.szp) if t is not None]
    full = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype) for t in parts]
    for r in range(0, rows, step):
        got = first if r == 0 else fn(data[r:r + step])
        for dst, src in zip(full, (t for t in (got.codes, got.scales, got.szp) if t is not None)):
            dst[r:r + src.shape[0]] = src
    return QuantizedTensor(first.fmt, full[0], full[1], full[2] if len(full) > 2 else None, first.group)
