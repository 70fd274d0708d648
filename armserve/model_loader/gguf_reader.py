"""gguf's GGUFReader with array metadata read on demand: the same fields, parts and data indices, but an
array's items (a vocabulary's 151k tokens, token types and merges) become numpy views only when read.

GGUFReader makes one or two small arrays for every item of every array field, with a list each for
its parts and data indices: ~200 MiB of Python objects for Qwen2.5's vocabulary and ~10 s. Freed
after the load, they left ~40 MiB of pymalloc arenas in the engine, held by the few objects
allocated among them (docs/benchmarks.md, "Where the GGUF row's memory goes"). Here Qwen2.5's
header parses in 0.1 s, and its config and tokenizer are read in 7.6 s of CPU instead of 11.4.
"""

from __future__ import annotations

import struct
from array import array
from typing import Any, Iterator, Sequence

import numpy as np
from gguf.constants import GGUFEndian, GGUFValueType
from gguf.gguf_reader import GGUFReader, ReaderField


class _ArrayParts(Sequence):
    """The parts of an array field as GGUFReader lists them: `head` (the key's length and bytes, the
    value type, the item type, the item count), then each item's parts (a number: a one-element
    array; a string: its length, then its bytes), each view made when it is read.

    NOTE: transformers reads every item of a vocabulary twice (for the config, then the tokenizer),
    so an item is one slice (and a view for its dtype) of the file's bytes, not GGUFReader._get."""

    def __init__(self, reader: GGUFReader, head: list[np.ndarray], start: int, item: GGUFValueType, count: int,
                 starts: array | None) -> None:
        self._data, self._head, self._start, self._starts = reader.data, head, start, starts
        order = reader.byte_order
        self._u64 = np.dtype(np.uint64).newbyteorder(order)
        if item == GGUFValueType.STRING:
            self._dtype, self._size, self._per_item = None, 0, 2
        else:
            self._dtype = np.dtype(GGUFReader.gguf_scalar_to_np[item]).newbyteorder(order)
            self._size, self._per_item = self._dtype.itemsize, 1
        self._len = len(head) + count * self._per_item

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("field part index out of range")
        k = i - len(self._head)
        if k < 0:
            return self._head[i]
        if self._dtype is not None:
            offset = self._start + k * self._size
            return self._data[offset:offset + self._size].view(self._dtype)
        offset = self._starts[k >> 1]
        if k & 1:  # a string's bytes: from after its length to the next string
            end = self._starts[(k >> 1) + 1]
            return self._data[offset + 8:end]
        return self._data[offset:offset + 8].view(self._u64)

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(self._len))


class LazyGGUFReader(GGUFReader):
    """GGUFReader whose array fields of numbers or strings read their items on demand (`_ArrayParts`);
    nested arrays are read as GGUFReader does. Its `data` is a plain ndarray view of the file's memory
    map: slicing a np.memmap runs its Python __array_finalize__ for every view."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "data" and isinstance(value, np.memmap):
            value = value.view(np.ndarray)
        super().__setattr__(name, value)

    def _build_fields(self, offs: int, count: int) -> int:
        for _ in range(count):
            orig_offs = offs
            klen, kdata = self._get_str(offs)
            offs += int(klen.nbytes + kdata.nbytes)
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            field = None
            if raw_type[0] == GGUFValueType.ARRAY:
                field, size = self._array_field(orig_offs, str(bytes(kdata), encoding="utf-8"), [klen, kdata, raw_type],
                                                offs)
            if field is None:  # (GGUFReader's own reading of this field)
                size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
                field = ReaderField(orig_offs, str(bytes(kdata), encoding="utf-8"), [klen, kdata, raw_type, *parts],
                                    [i + 3 for i in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _array_field(self, orig_offs: int, name: str, head: list[np.ndarray],
                     offs: int) -> tuple[ReaderField | None, int]:
        """(The field of an array of numbers or strings starting at `offs`, its size in bytes), or
        (None, 0) for another kind of array."""
        raw_item = self._get(offs, np.uint32)
        count_arr = self._get(offs + 4, np.uint64)
        item, count, start = GGUFValueType(raw_item[0]), int(count_arr[0]), offs + 12
        head = [*head, raw_item, count_arr]
        if item == GGUFValueType.STRING:
            # Each string is its 8-byte length, then its bytes: where each one starts is a scan.
            order = "<" if self.endianess == GGUFEndian.LITTLE else ">"
            unpack, buf = struct.Struct(order + "Q").unpack_from, memoryview(self.data)
            starts, pos = array("q", bytes(8 * (count + 1))), start
            for k in range(count):
                starts[k] = pos
                pos += 8 + unpack(buf, pos)[0]
            starts[count] = pos  # (where the next string would start: each one ends there)
            end, step = pos, 2
        elif item in self.gguf_scalar_to_np:
            starts, step = None, 1
            end = start + count * np.dtype(self.gguf_scalar_to_np[item]).itemsize
        else:
            return None, 0
        parts = _ArrayParts(self, head, start, item, count, starts)
        # the data indices: each item's value (a string's bytes: the second of its two parts)
        data = range(len(head) + step - 1, len(head) + step * count, step)
        types = [GGUFValueType.ARRAY, item] if count else [GGUFValueType.ARRAY]  # (as GGUFReader types them)
        return ReaderField(orig_offs, name, parts, data, types), end - offs  # type: ignore[arg-type]
