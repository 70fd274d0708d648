"""The machine's memory as a server sees it: total per NUMA node and available now, each within the
process's cgroup limit (a container's memory.max); and what a process hands back to the system: a
freed heap (now, or when an engine is idle: IdleTrim) and the pages of library code
that ran only at start (page_out_library_code). Plain Python (no torch): the engine's memory plan
(engine/memory_plan.py), the engine core and the front end use it."""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable

_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_limit() -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup, or None when it has no limit."""
    for limit_path, usage_path in _CGROUP_FILES:
        limit = _read_int(limit_path)
        if limit is not None and limit < 1 << 60:  # (v1 writes "no limit" as a huge number)
            return limit, _read_int(usage_path) or 0
    return None


def numa_node_count() -> int:
    try:
        return max(1, sum(1 for d in os.listdir("/sys/devices/system/node")
                          if d.startswith("node") and d[4:].isdigit()))
    except OSError:
        return 1


def total_memory() -> int:
    """Bytes of memory this process may use at most: MemTotal, or the cgroup limit if lower."""
    total = _meminfo()["MemTotal"]
    cg = cgroup_limit()
    return min(total, cg[0]) if cg else total


def available_memory() -> int:
    """Bytes that can be allocated now without swapping: MemAvailable, or what the cgroup limit
    leaves if less."""
    avail = _meminfo().get("MemAvailable", 0)
    cg = cgroup_limit()
    return min(avail, max(0, cg[0] - cg[1])) if cg else avail


def release_free_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): after a large transient
    parse, e.g. unpickling a tokenizer, the freed arenas otherwise stay in the process's RSS."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


# How far an idle engine's RSS may have grown since its last trim before it trims at once
# (IdleTrim): a burst of long prompts leaves ~100+ MiB of freed activations in malloc's arenas.
IDLE_TRIM_GROWTH = 64 << 20
# How long an engine stays idle before it hands back what its last steps freed whatever the amount
# (IdleTrim; ~15 MiB after a short chat request): an allocator's decay time (jemalloc's is 10 s),
# so that requests arriving back to back reuse the pages instead of faulting them in again.
IDLE_TRIM_SECONDS = 2.0


def resident_bytes() -> int:
    """This process's RSS (/proc/self/statm), 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class IdleTrim:
    """Hands the free heap back (release_free_heap) while an engine has no work: at once when its
    RSS has grown by `growth` bytes since the last trim, so that what a burst of long prompts or a
    structured-output request freed does not stay with the process; and once it has been idle for
    `delay` seconds after a step, with what `release` frees first (the engine's step scratch:
    EngineBackend.release_idle_memory), so that a server between bursts holds no step's working
    set, while one serving bursts back to back does not fault it in anew for each. Call it
    whenever the engine is idle, and `worked()` after each step."""

    def __init__(self, growth: int = IDLE_TRIM_GROWTH, delay: float = IDLE_TRIM_SECONDS,
                 release: Callable[[], None] | None = None) -> None:
        self.growth = growth
        self.release = release
        self.delay = delay
        self.base = resident_bytes()
        self.trims = 0
        self._idle_since: float | None = None
        self._trimmed = True  # nothing ran since the last trim (or the start)

    def worked(self) -> None:
        """A step ran: the next idle period may trim again."""
        self._idle_since = None
        self._trimmed = False

    def __call__(self) -> float | None:
        """Trim if it is due; returns the seconds until the idle trim is due, None when none is
        pending (the engine may sleep until its next command)."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        due = not self._trimmed and now - self._idle_since >= self.delay
        if due or resident_bytes() >= self.base + self.growth:
            self.trim(scratch=due)
            self._trimmed = self._trimmed or due
        return None if self._trimmed else self._idle_since + self.delay - now

    def trim(self, scratch: bool = True) -> None:
        """Trim now: what `release` frees first (with `scratch`), then the heap; the growth mark
        counts from here."""
        if scratch and self.release is not None:
            self.release()
        release_free_heap()
        self.base = resident_bytes()
        self.trims += 1


# madvise(2) advice (asm-generic/mman-common.h, the same on x86_64 and aarch64)
MADV_DONTNEED, MADV_HUGEPAGE, MADV_PAGEOUT = 4, 14, 21  # (MADV_PAGEOUT: Linux 5.4)


def madvise(address: int, length: int, advice: int) -> bool:
    """madvise(2) over [address, address + length); whether it took. Advice only: where libc or
    the kernel lacks it, nothing changes."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn(address, length, advice) == 0


def page_out_library_code() -> int:
    """Hand back the resident pages of the process's shared libraries that nothing touches any more
    (madvise MADV_PAGEOUT over every read-only mapping of a .so file): `import torch` leaves ~60
    MiB of libtorch resident that ran once, for its static initialisers and the imports, against
    ~15 MiB a step uses. Pages a step needs fault back in at its next use. Only clean file pages
    are reclaimed, and only those no other process maps; a kernel without MADV_PAGEOUT ignores it.
    Returns the bytes of the mappings advised."""
    advised = 0
    try:
        with open("/proc/self/maps") as f:
            maps = f.readlines()
    except OSError:
        return 0  # (no /proc: not Linux)
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or "w" in fields[1] or not fields[5].startswith("/"):
            continue
        name = os.path.basename(fields[5].rstrip("\n"))
        if not (name.endswith(".so") or ".so." in name):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, MADV_PAGEOUT):
            advised += end - start
    return advised


# glibc's mallopt parameters (malloc.h) and the values keep_freed_memory sets: blocks up to 32 MiB
# (glibc's largest mmap threshold on 64-bit) come from the heap, and up to 1 GiB of free heap
# stays with the process.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES, _TRIM_THRESHOLD_BYTES = 32 << 20, 1 << 30


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back to
    the system (mallopt). An encoder step's activations are freed and allocated again at every
    layer (all-MiniLM-L6-v2, 2048-token steps: 12 MiB per FFN output), and glibc's defaults return
    them (munmap, or a trim once two are free at the heap's top), so that each was faulted in again
    page by page: 12,000 page faults and 15% of the time of a pass over 512-token inputs, in a VM.
    Left alone when the environment tunes malloc (MALLOC_*_, GLIBC_TUNABLES) and without glibc.
    Returns whether it was set."""
    if any(k.startswith("MALLOC_") for k in os.environ) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False  # not glibc
