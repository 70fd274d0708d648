"""Recording and replaying kernel calls: the step graphs of engine/step_graph.py.

Every kernel call goes through `call`; inside `recording()` it is also appended to the
`Recording`, which `run_graph` replays with one C call (csrc/graph.cpp).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from armserve.kernels import library
from armserve.memory import MADV_DONTNEED, madvise


class GraphOp(ctypes.Structure):
    """One recorded kernel call (csrc/graph.cpp): the function's kind and its arguments in order,
    integers and pointers in `i`, floats in `f`."""

    _fields_ = [("kind", ctypes.c_int32), ("pad", ctypes.c_int32), ("i", ctypes.c_int64 * 16),
                ("f", ctypes.c_double * 4)]


class NotCapturable(RuntimeError):
    """A step did work the graph cannot replay (a PyTorch op that computes, not a kernel call)."""


_ALIGN = 64  # bytes: what PyTorch's CPU allocator aligns to
_PAGE = mmap.PAGESIZE


class Arena:
    """Memory the recordings of one model runner's step graphs share, as vLLM's CUDA graphs share a
    pool: a runner replays one graph at a time, and a replay recomputes every tensor it allocated
    from the graph's input buffers (allocated outside), so every recording's allocations can start
    at the same address. The graphs of all batch sizes then hold the largest one's bytes, not their
    sum; packed (Recording.pack), Qwen2.5-0.5B's 15 sizes up to 64 sequences use 56 MiB of it,
    where each graph with its own tensors held 633. A recording allocates end to end from its start
    (its pages faulted in as it touches them); one that outgrows it allocates the rest on its own."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.capacity = nbytes
        self.top = 0  # the recording's next byte
        self.spilled = 0  # bytes of the recording that did not fit

    def reset(self) -> None:
        self.top = self.spilled = 0

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A tensor with `like`'s dtype, shape and strides in the arena's next bytes (None when
        they do not fit)."""
        nbytes = like.untyped_storage().nbytes()
        start = -(-self.top // _ALIGN) * _ALIGN
        if start + nbytes > self.capacity:
            self.spilled += nbytes
            return None
        self.top = start + nbytes
        return self.at(start + like.storage_offset() * like.element_size(), like)

    def at(self, start: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor of `like`'s dtype, shape and strides whose first element is the arena's byte
        `start`."""
        span = 1 + sum((n - 1) * st for n, st in zip(like.shape, like.stride())) if like.numel() else 0
        flat = self.buffer[start:start + span * like.element_size()].view(like.dtype)
        # (as_strided's offset counts from the storage's start, the arena's: `flat`'s own offset)
        return flat.as_strided(like.shape, like.stride(), flat.storage_offset())

    def release_beyond(self, nbytes: int) -> None:
        """Hand the pages past the first `nbytes` back to the system (their contents are nobody's:
        a later recording that reaches them faults in zeroed pages)."""
        base = self.buffer.data_ptr()
        start = -(-(base + nbytes) // _PAGE) * _PAGE
        end = (base + self.capacity) // _PAGE * _PAGE
        if end > start:
            madvise(start, end - start, MADV_DONTNEED)  # (without it the pages stay)


class Recording:
    """Kernel calls of one step, in order, with every tensor allocated meanwhile kept alive (the
    recorded pointers point into them), in `arena` when given. `errors` names the PyTorch ops that
    computed something: a replay would skip them, so a recording with errors must not be replayed."""

    def __init__(self, arena: Arena | None = None) -> None:
        self.calls: list[tuple[int, list[int], list[float]]] = []
        self.pointers: list[list[int]] = []  # per call: which of its `ints` are addresses
        self.keep: list[torch.Tensor] = []
        self.regions: list[tuple[int, int]] = []  # per kept tensor: (address, bytes) of its allocation
        self.errors: list[str] = []
        self.arena = arena
        self._ops: ctypes.Array | None = None

    def pack(self, arena: Arena, held: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]] | None:
        """Lay this recording's tensors out in `arena` by lifetime and point its calls there: a
        tensor lives from the first call that names an address inside it to the last (those in
        `held`, which Python reads after a replay: the logits, to the end), and tensors whose lives
        do not overlap share bytes, as a step's layers reuse one layer's worth of activations in
        an eager step. Qwen2.5-0.5B at 64 sequences: 56 MiB, against 130 laid end to end. The
        bytes recorded at now stay valid until the next replay or recording (this step's logits).
        Only pointer arguments (`P` in csrc/api.h) are rewritten, so a kernel must name every
        tensor of the step it touches: an address inside one that reached a kernel another way (a
        struct built during the step) would not move. None does today: the attention batch struct
        points at the graph's input buffers, the MoE tables at weights, both made outside.
        Returns (the bytes used, `held` at their new places), or None, before changing anything,
        when a held tensor was not allocated while recording or the layout does not fit."""
        order = sorted(range(len(self.regions)), key=lambda r: self.regions[r][0])
        starts = [self.regions[r][0] for r in order]
        first: dict[int, int] = {}
        last: dict[int, int] = {}

        def region_of(address: int) -> int | None:
            i = bisect.bisect_right(starts, address) - 1
            if i >= 0:
                r = order[i]
                addr, nbytes = self.regions[r]
                if address < addr + nbytes:
                    return r
            return None

        for c, ((_, ints, _), ptrs) in enumerate(zip(self.calls, self.pointers)):
            for pos in ptrs:
                r = region_of(ints[pos])
                if r is not None:
                    first.setdefault(r, c)
                    last[r] = c
        end = len(self.calls)
        held_regions = []
        for t in held:
            r = region_of(t.data_ptr())
            if r is None:
                return None  # (not allocated while recording: nothing to move)
            held_regions.append(r)
            first.setdefault(r, end)
            last[r] = end
        # Largest first, each at the lowest offset clear of the placed ones whose lives overlap.
        placed: list[tuple[int, int, int, int]] = []  # (offset, end offset, first call, last call)
        offset_of: dict[int, int] = {}
        for r in sorted(first, key=lambda r: -self.regions[r][1]):
            nbytes, f, l = self.regions[r][1], first[r], last[r]
            clashes = sorted((o, e) for o, e, pf, pl in placed if pf <= l and f <= pl)
            at = 0
            for o, e in clashes:
                if at + nbytes <= o:
                    break
                at = max(at, -(-e // _ALIGN) * _ALIGN)
            if at + nbytes > arena.capacity:
                return None
            placed.append((at, at + nbytes, f, l))
            offset_of[r] = at
        base = arena.buffer.data_ptr()
        for (_, ints, _), ptrs in zip(self.calls, self.pointers):
            for pos in ptrs:
                r = region_of(ints[pos])
                if r is not None:
                    ints[pos] = base + offset_of[r] + ints[pos] - self.regions[r][0]
        moved = [arena.at(offset_of[r] + t.data_ptr() - self.regions[r][0], t) for t, r in zip(held, held_regions)]
        used = max((e for _, e, _, _ in placed), default=0)
        self.keep = [arena.buffer]  # (the tensors allocated while recording go with their references)
        self.regions = [(base, arena.capacity)]
        self._ops = None
        return used, moved

    def record(self, name: str, args: tuple) -> None:
        kind = _graph_kinds.get(name)
        if kind is None:
            kind = _graph_kinds[name] = library._lib.armserve_graph_kind(name.encode())
        if kind < 0:
            self.errors.append(f"kernel {name} is not recordable")
            return
        ints: list[int] = []
        floats: list[float] = []
        pointers: list[int] = []
        for t, a in zip(getattr(library._lib, name).argtypes, args):
            if t in (ctypes.c_float, ctypes.c_double):
                floats.append(float(a))
            else:
                if t is ctypes.c_void_p:
                    pointers.append(len(ints))
                ints.append(0 if a is None else int(a))
        self.calls.append((kind, ints, floats))
        self.pointers.append(pointers)

    def ops(self) -> ctypes.Array:
        """The calls as the C array `armserve_graph_run` walks (built once)."""
        if self._ops is None:
            if ctypes.sizeof(GraphOp) != library._lib.armserve_graph_op_size():
                raise NotCapturable("GraphOp's layout differs from csrc/graph.cpp's (rebuild the library)")
            arr = (GraphOp * len(self.calls))()
            for o, (kind, ints, floats) in zip(arr, self.calls):
                o.kind = kind
                o.i[:len(ints)] = ints
                o.f[:len(floats)] = floats
            self._ops = arr
        return self._ops


_graph_kinds: dict[str, int] = {}
_recording: Recording | None = None  # the one `recording()` open, if any
_persistent = False  # inside `persistent()`: allocations outlive the recording, not in its arena


def call(name: str, *args) -> None:
    """Call kernel `name`; while a step is being recorded, also append the call to the recording."""
    lib = library._lib if library._lib is not None else library.required()
    getattr(lib, name)(*args)
    if _recording is not None:
        _recording.record(name, args)


# aten ops that only allocate (their tensors are kept with the recording) or make views: a
# recorded step may run these and nothing else.
_GRAPH_ALLOC_OPS = {"empty", "empty_like", "empty_strided", "new_empty"}
_GRAPH_SAFE_OPS = _GRAPH_ALLOC_OPS | {
    "view", "_unsafe_view", "split_with_sizes", "split", "slice", "select", "unsqueeze",
    "squeeze", "t", "transpose", "as_strided", "alias", "detach", "_reshape_alias", "expand",
}
# ... and these when they return a view rather than a copy.
_GRAPH_SAFE_IF_VIEW = {"contiguous", "reshape", "flatten"}


class _Guard(TorchDispatchMode):
    """Sees every aten op while a step is recorded: keeps what allocates, notes what computes."""

    def __init__(self, rec: Recording) -> None:
        super().__init__()
        self.rec = rec

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # NOTE: True (torch's default) wraps __torch_dispatch__ in torch._disable_dynamo, whose
        # first call imports torch._dynamo and sympy: 68 MiB in every engine process, for a
        # recording that never runs under torch.compile.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _GRAPH_ALLOC_OPS:
            if not _persistent:  # (those its cache keeps: not the recording's to keep or move)
                nbytes = out.untyped_storage().nbytes()
                region = (out.untyped_storage().data_ptr(), nbytes)
                shared = self.rec.arena.take(out) if self.rec.arena is not None else None
                if shared is not None:  # (`out`'s own memory goes with it)
                    region = (shared.data_ptr() - out.storage_offset() * out.element_size(), nbytes)
                    out = shared
                self.rec.keep.append(out)
                self.rec.regions.append(region)
        elif name in _GRAPH_SAFE_IF_VIEW:
            if out.data_ptr() != args[0].data_ptr():
                self.rec.keep.append(out)
                self.rec.regions.append((out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()))
                self.rec.errors.append(f"aten::{name} copied")
        elif name not in _GRAPH_SAFE_OPS:
            self.rec.errors.append(f"aten::{name}")
        return out


@contextlib.contextmanager
def persistent() -> Iterator[None]:
    """Allocations inside outlive the step being recorded (a cache of buffers that later steps and
    other graphs reuse): made on their own, never in the recording's arena, where the next
    recording would write over them."""
    global _persistent
    before, _persistent = _persistent, True
    try:
        yield
    finally:
        _persistent = before


@contextlib.contextmanager
def recording(arena: Arena | None = None) -> Iterator[Recording]:
    """Context manager recording this thread's kernel calls into a `Recording` (engine/step_graph.py).

    The calls still run, so the step being recorded computes as usual. Every tensor allocated
    inside is kept (the recording's pointers refer to them), in `arena` from its start when given
    (an earlier recording's tensors there are then rewritten: replay only one graph at a time,
    and consume its logits before the next); a PyTorch op that computes is noted in `errors`,
    since a replay would not run it.
    """
    global _recording
    if library.load() is None:
        raise NotCapturable(f"C++ kernels unavailable: {library.load_error()}")
    if _recording is not None:
        raise NotCapturable("a step is already being recorded")
    if arena is not None:
        arena.reset()
    rec = Recording(arena)
    with _Guard(rec):
        _recording = rec
        try:
            yield rec
        finally:
            _recording = None


def run_graph(rec: Recording) -> None:
    """Replay a recording's kernel calls (one C call)."""
    if rec.errors:
        raise NotCapturable(f"the recorded step ran work a replay would skip: {', '.join(rec.errors[:5])}")
    ops = rec.ops()
    bad = library._lib.armserve_graph_run(ops, len(ops))
    if bad >= 0:
        raise NotCapturable(f"recorded call {bad} has an unknown kind")


def graph_team_replays() -> int:
    """How many replays so far ran as one parallel region of several threads (csrc/graph.cpp)."""
    return int(library.required().armserve_graph_team_replays())
