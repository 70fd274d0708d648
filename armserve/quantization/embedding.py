"""A token embedding table kept quantized: the rows a step looks up are dequantized by the
`qembedding` kernel, the table is never held in float.

The table sits in the packed tiles the qgemm kernels read (csrc/qgemm.h), so a head tied to it
(GGUF files without `output.weight`) is the same bytes: the lookup reads the head's packed weight
and the model holds one copy. Rows come out as the float table dequantized from the same blocks
held them, bit for bit: w8 tiles keep float32 scales; a w4 table whose scales float16 rounds
(GGUF Q4_K's d * sc) keeps its float32 scales beside the tiles (an eighth of the codes' bytes at
32 columns a group).
"""

from __future__ import annotations

import torch

from armserve import kernels
from armserve.kernels.reference import gguf_embedding_ref, qembedding_ref
from armserve.quantization.formats import QuantizedTensor, kernel_scales
from armserve.quantization.gguf import GGUF_ROW_TYPES, GGUFRows
from armserve.quantization.linear import QuantizedLinear


class QuantizedEmbedding:
    """Rows of a [n, k] table (a tensor-parallel rank's vocabulary share) as `dtype` vectors.

    `head`: the QuantizedLinear tied to the table (same rows, loaded from the same tensor and
    already finalized), whose packed weight the lookups then read instead of a copy of their own.
    """

    def __init__(self, qt: QuantizedTensor, dtype: torch.dtype, head: QuantizedLinear | None = None) -> None:
        self.fmt, self.group, self.dtype = qt.fmt, qt.group, dtype
        self.n, self.k = qt.shape
        self.exact: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.ref: QuantizedTensor | None = None  # the PyTorch path's table (no kernels)
        self.shared = False  # the packed tiles are the tied head's
        if not kernels.use_kernel("qgemm_pack", qt.codes):
            self.ref = qt
            return
        rounded = kernel_scales(qt)
        if qt.fmt == "w4" and not (torch.equal(rounded.scales, qt.scales) and torch.equal(rounded.szp, qt.szp)):
            self.exact = torch.stack([qt.scales, qt.szp], dim=-1).float().contiguous()
        parts = head.parts if head is not None else []
        if len(parts) == 1 and parts[0].packed is not None and (parts[0].fmt, parts[0].group, parts[0].n) == (
                qt.fmt, qt.group, self.n):
            self.packed = parts[0].packed  # the tied head's tiles: one copy for both
            self.shared = True
        else:
            self.packed = kernels.pack_q(rounded)

    @property
    def nbytes(self) -> int:
        """Bytes this table holds beyond a tied head's weight (the head's tiles are counted there)."""
        exact = 0 if self.exact is None else self.exact.numel() * 4
        if self.ref is not None:
            return exact + sum(t.numel() * t.element_size() for t in (self.ref.codes, self.ref.scales, self.ref.szp)
                               if t is not None)
        return exact + (0 if self.shared else self.packed.numel())

    def __call__(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rows ids - start ([m] int64 -> [m, k]), zeros for ids outside [start, start + n)."""
        if self.packed is None:
            return qembedding_ref(ids.reshape(-1), self.ref, self.dtype, start).view(*ids.shape, self.k)
        if not kernels.use_kernel("embedding", self.dtype):
            raise RuntimeError("the quantized embedding table was packed for kernels that are now unavailable")
        out = kernels.qembedding(ids.reshape(-1), self.packed, self.fmt, self.n, self.k, self.group, self.dtype,
                                 start, self.exact)
        return out.view(*ids.shape, self.k)


class MappedEmbedding:
    """Rows of a GGUF token table read where the file's memory map has it (the `gguf_embedding`
    kernel dequantizes the rows a step looks up, as llama.cpp does): the table is never copied, only
    the pages of rows looked up become resident, and they are page cache that every process mapping
    the file shares (data-parallel replicas, tensor-parallel ranks). For a model whose head is its
    own tensor; a tied table is the head's packed weight instead (QuantizedEmbedding)."""

    nbytes = 0  # nothing held beside the file's pages

    def __init__(self, table: GGUFRows, dtype: torch.dtype) -> None:
        self.table, self.dtype = table, dtype
        self.n, self.k = table.shape
        self.type_code = GGUF_ROW_TYPES[table.type_name]
        self.address = table.rows.ctypes.data

    def __call__(self, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rows ids - start ([m] int64 -> [m, k]), zeros for ids outside [start, start + n)."""
        flat = ids.reshape(-1)
        if kernels.use_kernel("embedding", self.dtype):
            out = kernels.gguf_embedding(flat, self.address, self.type_code, self.table.rows.shape[1], self.n, self.k,
                                         self.dtype, start)
        else:
            out = gguf_embedding_ref(flat, self.table, self.dtype, start)
        return out.view(*ids.shape, self.k)
