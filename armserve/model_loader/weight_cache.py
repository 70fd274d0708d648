"""Weights shared between engines on one machine: after a load, the model's large tensors (packed
quantized tiles, dense weights, token tables) are written once to a file under
`cache_dir("weights")` and every engine that loads the same checkpoint the same way maps that file
instead of holding its own copy. Data-parallel replicas and restarted engines then hold one copy in
the page cache, which the kernel counts once (each process's PSS carries its share), as llama.cpp
shares a mapped GGUF; the packed layouts are not the checkpoint's, so the file holds them as the
kernels read them.

Safety: the file is only ever replaced whole (written aside, then renamed), never changed in place,
and it is mapped copy-on-write: a process that writes into a weight gets a private page, and a
mapped file stays as it was for the engines that map it. Before mapping, every byte of the file is
compared with the tensors this load computed (a page-cache read, ~0.1 s per GiB), so a stale or
damaged file is rewritten, never used. Writers take a lock, so replicas that start together write
it once and map the same file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import mmap
import os
import types
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from armserve.config import cache_dir

log = logging.getLogger(__name__)

# Storages smaller than this stay private (norms, biases, small tables): each shared one takes
# whole pages of the file, and together they are a few MiB of a model.
MIN_BYTES = 1 << 20
_PAGE = mmap.PAGESIZE
_CHUNK = 16 << 20  # bytes the comparison with an existing file reads at a time
# Bumped when what the file holds changes meaning, so an older file gets another name.
FORMAT = 1


def cache_key(*parts: Any) -> str:
    """A file name from what identifies a load: the checkpoint files' identities, the dtype, the
    quantization, the tensor-parallel rank, the model class (the bytes are compared anyway)."""
    return hashlib.sha1(repr((FORMAT, *parts)).encode()).hexdigest()[:24]


def share_weights(model: nn.Module, key: str) -> int:
    """Move the model's large tensors onto a copy-on-write mapping of the weight file `key`
    (written first when missing or different). Returns the bytes now mapped, 0 when the file could
    not be written (a read-only or full disk: the weights stay private, with a log line)."""
    groups = _large_storages(model)
    if not groups:
        return 0
    offsets, total = [], 0
    for nbytes, _ in groups:
        offsets.append(total)
        total += -(-nbytes // _PAGE) * _PAGE
    folder = cache_dir("weights")
    path = os.path.join(folder, key + ".bin")
    try:
        os.makedirs(folder, exist_ok=True)
        with _locked(path + ".lock"):
            if not _matches(path, groups, offsets, total):
                _write(path, groups, offsets, total)
            fd = os.open(path, os.O_RDONLY)
            try:
                mapped = mmap.mmap(fd, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
    except OSError as e:
        log.warning("weights not shared (cannot write or map %s: %s); this engine keeps its own copy", path, e)
        return 0
    with torch.no_grad():
        for (nbytes, tensors), off in zip(groups, offsets):
            # (the storage keeps the mapping alive: torch.frombuffer holds a reference to it)
            storage = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=off).untyped_storage()
            for t in tensors:
                t.set_(storage, t.storage_offset(), t.size(), t.stride())
    log.info("weights: %.1f MiB mapped from %s, shared with every engine that maps it", total / 2**20, path)
    return total


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds `t`'s data (from /proc/self/maps), or None."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5].strip() if len(fields) > 5 else None
    return None


def _large_storages(model: nn.Module) -> list[tuple[int, list[torch.Tensor]]]:
    """(storage bytes, the tensors on it) for every storage of MIN_BYTES or more that the model's
    modules hold: parameters, persistent buffers and tensors in plain attributes (a quantized
    layer's packed parts, a packed dense weight), in the modules' order (the same for every engine
    loading the same model)."""
    found: dict[int, tuple[int, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    # (non-persistent buffers are runtime tables, e.g. the rotary cos/sin kept by address: wherever held)
    skip = {id(m._buffers[b]) for m in model.modules() for b in m._non_persistent_buffers_set
            if m._buffers.get(b) is not None}
    for m in model.modules():
        for name, value in vars(m).items():
            if name == "_modules":
                continue
            for t in _tensors_in(value, seen, depth=3):
                if id(t) in skip or t.device.type != "cpu":
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() < MIN_BYTES:
                    continue
                entry = found.setdefault(storage.data_ptr(), (storage.nbytes(), []))
                entry[1].append(t)
    return list(found.values())


def _tensors_in(obj: Any, seen: set[int], depth: int) -> Iterator[torch.Tensor]:
    """Tensors held by `obj` (a tensor, a dict, list or tuple of them, an object of a layer or
    quantization class with tensor attributes: `_holds_weights`), not looking into modules (walked
    on their own) or further than `depth`."""
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType,
                          types.BuiltinFunctionType)):
        return
    elif not isinstance(obj, (dict, list, tuple)) and not _holds_weights(type(obj)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, seen, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, seen, depth - 1)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, f.name, None), seen, depth - 1)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors_in(v, seen, depth - 1)


# Objects of these packages hold a layer's weights (a quantized layer's packed parts, a quantized
# embedding's table); nothing else is looked into. Not the tensor-parallel context either: its
# all-reduce buffer is shared memory the ranks exchange through, at an address the group keeps.
_WEIGHT_HOLDERS = ("armserve.quantization.", "armserve.layers.", "armserve.models.")


def _holds_weights(cls: type) -> bool:
    from armserve.layers.linear import ParallelContext

    return cls.__module__.startswith(_WEIGHT_HOLDERS) and not issubclass(cls, ParallelContext)


def _bytes(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The whole storage of `t` as uint8 [nbytes]."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), 0, (nbytes,), (1,))


def _matches(path: str, groups: list, offsets: list[int], total: int) -> bool:
    """Whether the file at `path` holds exactly these storages at these offsets. Read in pieces
    into one buffer, not mapped: the comparison adds no resident pages to this process."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        return False
    with f:
        if os.fstat(f.fileno()).st_size != total:
            return False
        buf = np.empty(_CHUNK, dtype=np.uint8)
        for (nbytes, tensors), off in zip(groups, offsets):
            mine = _bytes(tensors[0], nbytes).numpy()
            for start in range(0, nbytes, _CHUNK):
                n = min(_CHUNK, nbytes - start)
                if os.preadv(f.fileno(), [memoryview(buf)[:n]], off + start) != n or \
                        not np.array_equal(buf[:n], mine[start:start + n]):
                    return False
        return True


def _write(path: str, groups: list, offsets: list[int], total: int) -> None:
    """Write the storages to a new file and rename it over `path` (engines mapping the old one keep it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.truncate(total)
            for (nbytes, tensors), off in zip(groups, offsets):
                f.seek(off)
                f.write(memoryview(_bytes(tensors[0], nbytes).numpy()))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(lock_path: str) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
