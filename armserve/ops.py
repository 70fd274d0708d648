"""Python face of the C++ kernels (csrc/): loading, ISA selection and one wrapper per kernel.

The library is reached through ctypes with raw data pointers, so it needs no torch at build
time. Each wrapper's PyTorch reference lives beside the layer that uses it (layers/*.py);
tests compare the two for every ISA variant this CPU can run.

`ARMSERVE_ISA=scalar|avx2|avx512|neon|sve` forces a variant; `ARMSERVE_ISA=torch` turns the
kernels off (the PyTorch path).
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import warnings

import torch
import torch.nn.functional as F

logger = logging.getLogger("armserve")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_loaded = False


class KernelError(ValueError):
    """The kernel library cannot do what was asked (unknown or unsupported ISA)."""


class AttnBatch(ctypes.Structure):
    _fields_ = [
        ("num_seqs", ctypes.c_int32),
        ("q_start", ctypes.c_void_p),
        ("q_len", ctypes.c_void_p),
        ("context_len", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("max_blocks", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
    ]


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (should be exactly one)."""
    found = set()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.rstrip().count(" ") >= 5 else ""
                name = os.path.basename(path)
                if name.startswith(("libgomp", "libiomp", "libomp")) and ".so" in name:
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return sorted(found)


def _load_openmp_globally() -> None:
    """Make the OpenMP runtime torch uses visible to the kernel library's GOMP_* imports.

    NOTE: the library is linked without -lgomp on purpose. Loading a second libgomp next to
    torch's (the wheels bundle their own, renamed on aarch64) gives two thread pools that
    oversubscribe the cores, a known cause of single-core runs on ARM.
    """
    runtimes = openmp_runtimes()
    # Other packages bundle their own copy too (sentencepiece does): take PyTorch's.
    torch_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    ours = [r for r in runtimes if os.path.basename(os.path.dirname(r)) in ("lib", "torch.libs")
            and r.startswith(torch_dir) and ("/torch/" in r or "/torch.libs/" in r)]
    runtimes = ours or runtimes
    if not runtimes:
        from ctypes.util import find_library

        name = find_library("gomp")
        if name is None:
            raise OSError("no OpenMP runtime (libgomp) found")
        runtimes = [name]
    ctypes.CDLL(runtimes[0], mode=ctypes.RTLD_GLOBAL)


def _library_path() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    paths = sorted(glob.glob(os.path.join(here, "_C*.so")))
    return paths[0] if paths else None


# Letters of `armserve_signature` (csrc/api.cpp) -> ctypes types.
_CTYPES = {"v": None, "i": ctypes.c_int32, "l": ctypes.c_int64, "f": ctypes.c_float, "d": ctypes.c_double,
           "s": ctypes.c_char_p, "P": ctypes.c_void_p}


def _setup(lib: ctypes.CDLL) -> None:
    """Bind every exported function with the argument types the library itself reports: the
    signatures are declared once, in csrc/api.h."""
    lib.armserve_exports.argtypes, lib.armserve_exports.restype = [], ctypes.c_char_p
    lib.armserve_signature.argtypes, lib.armserve_signature.restype = [ctypes.c_char_p], ctypes.c_char_p
    for name in lib.armserve_exports().decode().strip(",").split(","):
        res, args = lib.armserve_signature(name.encode()).decode().split(":")
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[c] for c in args]
        fn.restype = _CTYPES[res]


def _load() -> ctypes.CDLL | None:
    global _lib, _load_error, _loaded
    if _loaded:
        return _lib
    _loaded = True
    want = os.environ.get("ARMSERVE_ISA", "").strip().lower()
    if want == "torch":
        _load_error = "disabled by ARMSERVE_ISA=torch"
        return None
    path = _library_path()
    if path is None:
        _load_error = "armserve/_C*.so is not built (no C++ compiler at install time?)"
    else:
        try:
            _load_openmp_globally()
            lib = ctypes.CDLL(path)
            _setup(lib)
            _lib = lib
        except OSError as e:
            _load_error = f"cannot load {path}: {e}"
    if _lib is None:
        if want:
            raise KernelError(f"ARMSERVE_ISA={want} asks for a kernel variant, but {_load_error}")
        warnings.warn(f"armserve: C++ kernels unavailable ({_load_error}); using the slower PyTorch path")
        return None
    if want:
        select_isa(want)
    if os.environ.get("ARMSERVE_BF16_DOT", "").strip() == "0":
        _lib.armserve_set_bf16_dot(0)
    if os.environ.get("ARMSERVE_AMX", "").strip() == "0":
        _lib.armserve_set_amx(0)
    return _lib


def select_isa(name: str) -> str:
    """Switch every kernel to variant `name` (or `auto`); returns the variant now in use."""
    lib = _load()
    if lib is None:
        raise KernelError(f"C++ kernels unavailable: {_load_error}")
    global kernel_generation
    rc = lib.armserve_select_isa(name.encode())
    _gemv_limit.clear()
    kernel_generation += 1
    if rc == 1:
        raise KernelError(f"unknown ISA {name!r} on {os.uname().machine}; choose from {', '.join(isas_for_arch())}")
    if rc == 2:
        raise KernelError(f"this CPU cannot run the {name!r} kernels (features: {' '.join(cpu_features())})")
    return isa()


def isas_for_arch() -> list[str]:
    m = os.uname().machine
    if m in ("x86_64", "AMD64"):
        return ["scalar", "avx2", "avx512"]
    if m in ("aarch64", "arm64"):
        return ["scalar", "neon", "sve"]
    return ["scalar"]


def available() -> bool:
    return _load() is not None


def load_error() -> str | None:
    _load()
    return _load_error


def isa() -> str:
    """The variant in use, or "torch" when the kernels are off."""
    lib = _load()
    return lib.armserve_isa().decode() if lib is not None else "torch"


def qgemm_isa() -> str:
    """The quantized-GEMM variant that goes with the current kernel variant."""
    lib = _load()
    return lib.armserve_qgemm_isa().decode() if lib is not None else "torch"


def supported_isas() -> list[str]:
    """Variants this CPU can run (probing leaves the current choice as it was)."""
    lib = _load()
    if lib is None:
        return []
    current = isa()
    ok = [n for n in isas_for_arch() if lib.armserve_select_isa(n.encode()) == 0]
    lib.armserve_select_isa(current.encode())
    return ok


def bf16_dot() -> bool:
    """True when the skinny matmul feeds bf16 rows to the CPU's bf16 dot instruction
    (AVX512-BF16 / ARM BFDOT) rather than widening them to fp32: the CPU and the selected variant
    have one, and `ARMSERVE_BF16_DOT=0` / `set_bf16_dot(False)` did not turn it off."""
    lib = _load()
    return lib is not None and bool(ctypes.c_int.in_dll(lib, "armserve_bf16_dot").value)


def native_bf16() -> bool | None:
    """Whether the selected kernel variant computes bfloat16 natively on this CPU (None when the
    kernels are off). A forced variant stands for the CPUs it is built for: `avx2` or `scalar` on an
    AVX512-BF16 machine answer False, as an AVX2-only CPU would."""
    lib = _load()
    return None if lib is None else bool(lib.armserve_native_bf16())


def set_bf16_dot(on: bool) -> bool:
    """Allow (on) or forbid the bf16 dot instructions (tests, comparisons); returns the previous
    setting, to restore. They are used only while the CPU and the selected variant have them, so
    `bf16_dot()` may stay False after `set_bf16_dot(True)`."""
    lib = _load()
    if lib is None:
        raise KernelError(f"C++ kernels unavailable: {_load_error}")
    global kernel_generation
    before = bool(lib.armserve_bf16_dot_wanted())
    _gemv_limit.clear()
    kernel_generation += 1
    if lib.armserve_set_bf16_dot(int(on)) == 2:
        raise KernelError(f"this CPU has no bf16 dot instruction (features: {' '.join(cpu_features())})")
    return before


def amx_available() -> bool:
    """True when the dense bf16 GEMM can run on Intel AMX tiles here: the CPU has AMX-BF16 and
    Linux granted this process the tile data (the library asks once)."""
    lib = _load()
    if lib is None:
        return False
    before = bool(lib.armserve_amx_wanted())
    ok = lib.armserve_set_amx(1) == 0
    lib.armserve_set_amx(int(before))
    return ok


def set_amx(on: bool) -> bool:
    """Allow (on, the default) or forbid AMX tiles in the dense bf16 GEMM (tests, comparisons;
    `ARMSERVE_AMX=0` at start-up); returns the previous setting, to restore. AMX is used only with
    the avx512 variant and the bf16 dot instruction allowed, from 3 rows (see `dense_isa()`)."""
    lib = _load()
    if lib is None:
        raise KernelError(f"C++ kernels unavailable: {_load_error}")
    global kernel_generation
    before = bool(lib.armserve_amx_wanted())
    kernel_generation += 1
    if lib.armserve_set_amx(int(on)) == 2:
        raise KernelError("AMX-BF16 is not available here (the CPU lacks it or Linux refused its tile data; "
                          f"features: {' '.join(cpu_features())})")
    return before


def cpu_features() -> list[str]:
    lib = _load()
    if lib is None:
        return []
    buf = ctypes.create_string_buffer(512)
    lib.armserve_cpu_features(buf, 512)
    return buf.value.decode().split()


def bind_threads(cores: list[int]) -> None:
    """Run one OpenMP thread (PyTorch's too: the runtime is shared) per listed core, pinned."""
    lib = _load()
    if lib is None:
        raise KernelError(f"thread binding needs the C++ library: {_load_error}")
    arr = (ctypes.c_int32 * len(cores))(*cores)
    rc = lib.armserve_bind_threads(arr, len(cores))
    if rc:
        raise KernelError(f"cannot pin threads to cores {cores} (code {rc})")


def openmp_library() -> str | None:
    """The OpenMP runtime the kernels' threads come from (PyTorch's, so one thread pool)."""
    lib = _load()
    if lib is None:
        return None
    buf = ctypes.create_string_buffer(4096)
    # realpath: the loader reports the path as it was opened (e.g. torch/lib/../../torch.libs/...)
    return os.path.realpath(buf.value.decode()) if lib.armserve_openmp_library(buf, 4096) == 0 else None


def thread_cores() -> list[int]:
    """The core each OpenMP thread is running on right now."""
    lib = _load()
    if lib is None:
        return []
    arr = (ctypes.c_int32 * 1024)()
    n = lib.armserve_thread_cores(arr, 1024)
    return list(arr[:n])


# ---- step graphs: recording kernel calls ----------------------------------------------------


class GraphOp(ctypes.Structure):
    """One recorded kernel call (csrc/graph.cpp): the function's kind and its arguments in order,
    integers and pointers in `i`, floats in `f`."""

    _fields_ = [("kind", ctypes.c_int32), ("pad", ctypes.c_int32), ("i", ctypes.c_int64 * 16),
                ("f", ctypes.c_double * 4)]


class NotCapturable(RuntimeError):
    """A step did work the graph cannot replay (a PyTorch op that computes, not a kernel call)."""


class Recording:
    """Kernel calls of one step, in order, with every tensor allocated meanwhile kept alive (the
    recorded pointers point into them). `errors` names the PyTorch ops that computed something:
    a replay would skip them, so a recording with errors must not be replayed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[int], list[float]]] = []
        self.keep: list[torch.Tensor] = []
        self.errors: list[str] = []
        self._ops: ctypes.Array | None = None

    def record(self, name: str, args: tuple) -> None:
        kind = _graph_kinds.get(name)
        if kind is None:
            kind = _graph_kinds[name] = _lib.armserve_graph_kind(name.encode())
        if kind < 0:
            self.errors.append(f"kernel {name} is not recordable")
            return
        ints: list[int] = []
        floats: list[float] = []
        for t, a in zip(getattr(_lib, name).argtypes, args):
            if t in (ctypes.c_float, ctypes.c_double):
                floats.append(float(a))
            else:
                ints.append(0 if a is None else int(a))
        self.calls.append((kind, ints, floats))

    def ops(self) -> ctypes.Array:
        """The calls as the C array `armserve_graph_run` walks (built once)."""
        if self._ops is None:
            if ctypes.sizeof(GraphOp) != _lib.armserve_graph_op_size():
                raise NotCapturable("GraphOp's layout differs from csrc/graph.cpp's (rebuild the library)")
            arr = (GraphOp * len(self.calls))()
            for o, (kind, ints, floats) in zip(arr, self.calls):
                o.kind = kind
                o.i[:len(ints)] = ints
                o.f[:len(floats)] = floats
            self._ops = arr
        return self._ops


_graph_kinds: dict[str, int] = {}
_recording: Recording | None = None
# Bumped whenever a kernel choice changes (ISA, bf16 dot): recordings made before are stale.
kernel_generation = 0


def _call(name: str, *args) -> None:
    """Call kernel `name`; while a step is being recorded, also append the call to the recording."""
    lib = _lib if _lib is not None else _load()
    if lib is None:
        raise KernelError(f"C++ kernels unavailable: {_load_error}")
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


def capture():
    """Context manager recording this thread's kernel calls into a `Recording` (see step_graph.py).

    The calls still run, so the step being recorded computes as usual. Every tensor allocated
    inside is kept (the recording's pointers refer to them); a PyTorch op that computes is noted
    in `errors`, since a replay would not run it.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Guard(TorchDispatchMode):
        def __init__(self, rec: Recording) -> None:
            super().__init__()
            self.rec = rec

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in _GRAPH_ALLOC_OPS:
                self.rec.keep.append(out)
            elif name in _GRAPH_SAFE_IF_VIEW:
                if out.data_ptr() != args[0].data_ptr():
                    self.rec.keep.append(out)
                    self.rec.errors.append(f"aten::{name} copied")
            elif name not in _GRAPH_SAFE_OPS:
                self.rec.errors.append(f"aten::{name}")
            return out

    class _Capture:
        def __enter__(self) -> Recording:
            global _recording
            if _load() is None:
                raise NotCapturable(f"C++ kernels unavailable: {_load_error}")
            if _recording is not None:
                raise NotCapturable("a step is already being recorded")
            self.rec = Recording()
            self.guard = _Guard(self.rec)
            self.guard.__enter__()
            _recording = self.rec
            return self.rec

        def __exit__(self, *exc) -> None:
            global _recording
            _recording = None
            self.guard.__exit__(*exc)

    return _Capture()


def run_graph(rec: Recording) -> None:
    """Replay a recording's kernel calls (one C call)."""
    if rec.errors:
        raise NotCapturable(f"the recorded step ran work a replay would skip: {', '.join(rec.errors[:5])}")
    ops_ = rec.ops()
    bad = _lib.armserve_graph_run(ops_, len(ops_))
    if bad >= 0:
        raise NotCapturable(f"recorded call {bad} has an unknown kind")


def graph_team_replays() -> int:
    """How many replays so far ran as one parallel region of several threads (csrc/graph.cpp)."""
    return int(_load().armserve_graph_team_replays())


# ---- wrappers -------------------------------------------------------------------------------


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: float = 0.0) -> torch.Tensor:
    """norm(x (+ residual)) * (weight + offset); with `residual`, it is updated in place to x + residual."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _call("armserve_rms_norm", _DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), _ptr(residual),
                           weight.data_ptr(), x.numel() // dim, dim, eps, offset, 1, dim)
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """In place: each head of x [T, heads, head_dim] normalised, times (weight + offset) [head_dim]
    (Qwen3's and Gemma 3's q/k norms). x may be a view into a fused qkv output: heads contiguous
    within a row, rows any stride apart."""
    assert x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be contiguous within a row"
    t, heads, dim = x.shape
    _call("armserve_rms_norm", _DTYPE_CODES[x.dtype], x.data_ptr(), x.data_ptr(), None, weight.data_ptr(),
          t * heads, dim, eps, offset, heads, x.stride(0))
    return x


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_dim: int,
           rot_dim: int, neox: bool) -> None:
    """RoPE in place on q [T, nq*hd] and k [T, nk*hd] (row-strided views are fine)."""
    T = positions.shape[0]
    _call("armserve_rotary", _DTYPE_CODES[q.dtype], positions.data_ptr(), q.data_ptr(), k.data_ptr(),
                         cos_sin.data_ptr(), T, q.shape[1] // head_dim, k.shape[1] // head_dim, head_dim, rot_dim,
                         int(neox), q.stride(0), k.stride(0))


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """[..., 2d] = [gate | up] -> act(gate) * up."""
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    _call("armserve_act_and_mul", _DTYPE_CODES[x.dtype], _ACT_CODES[act], out.data_ptr(), x.data_ptr(),
                              x.numel() // (2 * d), d)
    return out


# The KV cache layout the attention kernels index (drawn in layers/attention.py's docstring).
KEY_TILE = 16  # keys per transposed K tile; block sizes are multiples of it


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype = torch.float32) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's K cache, V cache and int8 scales for a cache of `dtype` (see
    layers/attention.py's docstring; bfloat16 pairs neighbours for the bf16 dot instructions)."""
    if block_size % KEY_TILE:
        raise ValueError(f"block_size must be a multiple of {KEY_TILE}, got {block_size}")
    nb, hk, bs, hd, t = num_blocks, num_kv_heads, block_size, head_dim, KEY_TILE
    scales = (nb, hk, bs)
    if dtype == torch.bfloat16:
        if hd % 2:
            raise ValueError(f"a bfloat16 cache needs an even head_dim, got {hd}")
        return (nb, hk, bs // t, hd // 2, t, 2), (nb, hk, bs // 2, hd, 2), scales
    return (nb, hk, bs // t, hd, t), (nb, hk, bs, hd), scales


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(kv heads, head_dim, block size) of caches in the kernels' block layout (layers/attention.py);
    the kernels index raw memory, so anything else is refused."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"caches must be contiguous K and V in the block layout of kv_cache_shapes() for "
                         f"their dtype, got non-contiguous K {tuple(k_cache.shape)} / V {tuple(v_cache.shape)}")
    return _cache_geometry(tuple(k_cache.shape), tuple(v_cache.shape), v_cache.dtype)


@functools.lru_cache(maxsize=64)
def _cache_geometry(k_shape: tuple[int, ...], v_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int, int]:
    """`_check_cache` for one pair of shapes, worked out once (it runs for every layer of every step)."""
    ok = len(v_shape) in (4, 5)
    if ok:
        nb, hk = v_shape[:2]
        bs, hd = (v_shape[2] * 2, v_shape[3]) if len(v_shape) == 5 else v_shape[2:]
        ok = bs % 16 == 0 and (k_shape, v_shape) == kv_cache_shapes(nb, bs, hk, hd, dtype)[:2]
    if not ok:
        raise ValueError(f"caches must be contiguous K and V in the block layout of kv_cache_shapes() for "
                         f"their dtype, got K {k_shape} / V {v_shape} {dtype}")
    return hk, hd, bs


def _check_head_dim(hd: int) -> None:
    if hd % 16:
        raise ValueError(f"the attention kernels need head_dim to be a multiple of 16, got {hd}")


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write rows of k/v ([T, hk*hd], row-strided views are fine) into cache slots."""
    hk, hd, bs = _check_cache(k_cache, v_cache)
    assert k.stride(0) == v.stride(0) and k.stride(1) == 1 and k.shape[1] == hk * hd
    _call("armserve_reshape_and_cache", _DTYPE_CODES[k.dtype], k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
          v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], hk, hd, k.stride(0), bs)


def make_attn_batch(q_start: torch.Tensor, q_len: torch.Tensor, context_len: torch.Tensor,
                    block_tables: torch.Tensor, block_size: int) -> AttnBatch:
    """The step layout for `paged_attention`; the int32 tensors must outlive it."""
    return AttnBatch(q_start.shape[0], q_start.data_ptr(), q_len.data_ptr(), context_len.data_ptr(),
                     block_tables.data_ptr(), block_tables.shape[1], block_size)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of q rows ([T, hq*hd], row-strided views are fine) over their cached context."""
    assert q.stride(1) == 1
    hk, hd, bs = _check_cache(k_cache, v_cache)
    _check_head_dim(hd)
    if (hk, hd, bs) != (num_kv_heads, head_dim, batch.block_size):
        raise ValueError(f"caches hold ({hk} heads, head_dim {hd}, block size {bs}), the call says "
                         f"({num_kv_heads}, {head_dim}, {batch.block_size})")
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    _call("armserve_paged_attention", _DTYPE_CODES[q.dtype], out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                                  v_cache.data_ptr(), ctypes.addressof(batch), num_heads, num_kv_heads, head_dim,
                                  scale, sliding_window or 0, softcap or 0.0, q.stride(0))
    return out


def _check_i8_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                    v_scale: torch.Tensor) -> tuple[int, int, int]:
    """The int8 kernels index raw memory: refuse anything but the layout they assume."""
    hk, hd, bs = _check_cache(k_cache, v_cache)
    for name, c, s in (("k", k_cache, k_scale), ("v", v_cache, v_scale)):
        if c.dtype != torch.int8:
            raise ValueError(f"{name}_cache must be int8, got {c.dtype}")
        if s.dtype != torch.float32 or tuple(s.shape) != tuple(v_cache.shape[:3]) or not s.is_contiguous():
            raise ValueError(f"{name}_scale must be a contiguous float32 [blocks, kv_heads, block_size] = "
                             f"{tuple(v_cache.shape[:3])} tensor, got {s.dtype} of shape {tuple(s.shape)}")
    return hk, hd, bs


def reshape_and_cache_i8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize rows of k/v ([T, hk*hd], row-strided views are fine) into int8 cache slots and their
    per-(slot, kv head) scales (see quantize_kv_ref in layers/attention.py)."""
    hk, hd, bs = _check_i8_cache(k_cache, v_cache, k_scale, v_scale)
    if k.stride(0) != v.stride(0) or k.stride(1) != 1 or k.shape[1] != hk * hd or v.shape != k.shape:
        raise ValueError(f"k and v must be [T, {hk * hd}] with unit column stride and equal row strides, "
                         f"got {tuple(k.shape)} / {tuple(v.shape)}")
    if k.dtype not in _DTYPE_CODES or v.dtype != k.dtype:
        raise ValueError(f"k/v dtype must be one of float32, bfloat16, float16, got {k.dtype} / {v.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    _call("armserve_reshape_and_cache_i8", _DTYPE_CODES[k.dtype], k.data_ptr(), v.data_ptr(), k_cache.data_ptr(),
                                       v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
                                       slot_mapping.data_ptr(), k.shape[0], hk, hd, k.stride(0), bs)


def paged_attention_i8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor, batch: AttnBatch, num_heads: int, num_kv_heads: int, head_dim: int,
                       scale: float, sliding_window: int | None = None,
                       softcap: float | None = None) -> torch.Tensor:
    """`paged_attention` over int8 caches (scores (q . k8) * k_scale, values weighted by p * v_scale)."""
    hk, hd, _ = _check_i8_cache(k_cache, v_cache, k_scale, v_scale)
    _check_head_dim(hd)
    if q.stride(1) != 1 or q.dtype not in _DTYPE_CODES:
        raise ValueError(f"q must be float32/bfloat16/float16 with unit column stride, got {q.dtype} "
                         f"strides {q.stride()}")
    if (hk, hd) != (num_kv_heads, head_dim):
        raise ValueError(f"cache rows are ({hk}, {hd}), expected ({num_kv_heads}, {head_dim})")
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    _call("armserve_paged_attention_i8", _DTYPE_CODES[q.dtype], out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                                     v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
                                     ctypes.addressof(batch), num_heads, num_kv_heads, head_dim, scale,
                                     sliding_window or 0, softcap or 0.0, q.stride(0))
    return out


def quantize_act(x: torch.Tensor, group: int,
                 out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 activations per token and group: (codes [m, k], scales [m, k // group], group sums),
    written into `out` when given (buffers of exactly those shapes, reused across calls)."""
    x = x.contiguous()
    m, k = x.shape
    if out is None:
        out = (torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // group, dtype=torch.float32),
               torch.empty(m, k // group, dtype=torch.int32))
    q, scale, gsum = out
    _call("armserve_quantize_act", _DTYPE_CODES[x.dtype], x.data_ptr(), m, k, group, q.data_ptr(), scale.data_ptr(),
                               gsum.data_ptr())
    return out


def qgemm(fmt: str, out: torch.Tensor, col: int, acts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
          packed: torch.Tensor, n: int, group: int) -> None:
    """out[:, col:col + n] = acts x W^T for a packed "w4" or "w8" weight (csrc/qgemm.h)."""
    q, scale, gsum = acts
    _call("armserve_gemm_w4" if fmt == "w4" else "armserve_gemm_w8", _DTYPE_CODES[out.dtype],
          out.data_ptr() + col * out.element_size(), q.data_ptr(), scale.data_ptr(), gsum.data_ptr(),
          packed.data_ptr(), q.shape[0], n, q.shape[1], group, out.stride(0))


def qgemm_dense(fmt: str, out: torch.Tensor, col: int, x: torch.Tensor, packed: torch.Tensor, n: int,
                group: int) -> None:
    """out[:, col:col + n] = x (bf16 [m, k]) @ W^T for a packed "w4" or "w8" weight, dequantized to
    bf16 panel by panel for the dense GEMM's tiles (prefill-sized m; csrc/dense_gemm_impl.h)."""
    x = x.contiguous()
    _call("armserve_gemm_q_bf16", 0 if fmt == "w4" else 1, _DTYPE_CODES[out.dtype],
          out.data_ptr() + col * out.element_size(), x.data_ptr(), packed.data_ptr(), x.shape[0], n, x.shape[1],
          group, out.stride(0))


_MOE_FORMATS = {"w4": 0, "w8": 1, "bf16": 2}


def fused_moe(fmt: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor,
              up: torch.Tensor, down: torch.Tensor, inter: int, group_gu: int = 0, group_dn: int = 0) -> torch.Tensor:
    """One MoE layer's experts in one call (csrc/moe_impl.h): float32 [T, hidden] =
    sum_j weights[t, j] * down(silu(gate(x[t])) * up(x[t])) of expert ids[t, j].

    `gate`, `up`, `down`: int64 [E] tensors of each expert's weight addresses ("w4"/"w8" tiles of
    the quantized GEMM with groups `group_gu` / `group_dn`, or "bf16" blocks of `pack_bf16`); the
    caller keeps the weights alive. ids int64 [T, top_k] in [0, E), weights float32 [T, top_k]."""
    x = x.contiguous()
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    ids = ids.contiguous().to(torch.int64)
    weights = weights.contiguous().to(torch.float32)
    out = torch.empty(tokens, hidden, dtype=torch.float32)
    _call("armserve_fused_moe", _MOE_FORMATS[fmt], _DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), tokens, hidden,
          inter, top_k, ids.data_ptr(), weights.data_ptr(), gate.shape[0], gate.data_ptr(), up.data_ptr(),
          down.data_ptr(), group_gu, group_dn)
    return out


# From this many rows the int8-weight (w8: GGUF Q8_0 / Q6_K / Q5_K) parts of a bf16 quantized layer
# dequantize their weight panel by panel for the dense bf16 GEMM instead of quantizing the
# activations for the w8a8 GEMM: the dequantization is then shared by enough rows, and the bf16
# tiles run near the bf16 dot instruction's peak (1.2-1.5x the w8a8 GEMM's 300 GFLOP/s from 256
# rows, Zen 5). int4 parts keep the w4a8 GEMM, which runs as fast as the bf16 tiles there
# (benchmarks/bench_kernels.py --only qdense), except on AMX tiles (Xeon: ~900 GFLOP/s against the
# w4a8 GEMM's ~200). Only with a bf16 dot instruction: widened to fp32 (AVX2, NEON without BF16) the
# dense tiles lose to the int8 dot products.
QDENSE_MIN_ROWS = 128


# Largest token count for which `gemv` beats PyTorch's GEMM (benchmarks/bench_kernels.py): 4 where
# the weight rows stay cheap per token (AVX-512, or a bf16 dot instruction for bf16); with 8-wide
# widening re-reading a row for each token is compute-bound and loses to oneDNN beyond one token
# (AVX2 measured: 3.0x at 1 token, 0.77x at 4; NEON without BF16 widens alike and is treated so).
GEMV_MAX_TOKENS = 4
_gemv_limit: dict[torch.dtype, int] = {}


# ---- kernel or PyTorch: the one place that decides ---------------------------------------------
# Every layer asks `use_kernel` and runs its PyTorch reference otherwise (what ARMSERVE_ISA=torch,
# a missing library or an unsupported input get); no layer applies a rule of its own.
KERNEL_OPS = ("rms_norm", "rms_norm_heads", "rotary", "act_and_mul", "embedding", "attention", "qgemm", "qgemm_pack", "qgemm_dense",
              "dense_pack", "dense", "gemv", "small", "argmax", "moe")


def use_kernel(op: str, x: torch.Tensor | torch.dtype, head_dim: int | None = None, fmt: str | None = None) -> bool:
    """Whether `op` runs its C++ kernel on `x` (a tensor, or for "attention" the model dtype).

    - "rms_norm", "rotary", "act_and_mul", "embedding", "qgemm" (x: the activations): any kernel
      dtype (float32, bfloat16, float16).
    - "rms_norm_heads": x [T, heads, head_dim] in a kernel dtype with the heads contiguous within
      a row (rows any stride apart: the q or k part of a fused qkv output).
    - "attention": a kernel dtype and `head_dim` a multiple of 16 (the kernel walks head_dim in
      16-lane vectors).
    - "qgemm_dense": bf16 activations x of a quantized layer's part of format `fmt` take the
      dequantizing dense GEMM (`qgemm_dense`) rather than the int8 one: from QDENSE_MIN_ROWS rows,
      with a bf16 dot instruction; int4 ("w4") parts only on AMX tiles, where the bf16 GEMM is
      several times the w4a8 GEMM (elsewhere they run as fast as each other).
    - "dense_pack": x is a weight to prepack at load for the dense GEMM, which then serves every
      row count on every variant: bfloat16 and float32 matrices (`pack_bf16` / `pack_f32`).
      "dense": activations x for a prepacked weight: rows of the weight's dtype (else, or with
      the kernels switched off after loading, the weight is unpacked for PyTorch).
    - "qgemm_pack": x holds quantized weight codes, packed at load for the w4a8 / w8a8 GEMM (the
      layer then keeps no PyTorch copy): whenever the kernels are on.
    - "gemv": a few rows of x against an unpacked 16/32-bit weight: the skinny matmul up to the
      variant's row limit (beyond it PyTorch's GEMM is faster).
    - "small": an elementwise op (add_bias, mul_cols, cast) on the few rows of a decode step, so
      that the step stays kernel calls only (step_graph.py); PyTorch's threaded ops beyond.
    - "argmax": float32 rows with unit column stride.
    - "moe": activations x [T, hidden] for the fused expert pass (`fused_moe`) of experts whose
      weights it reads (layers/fused_moe.py decides that): any kernel dtype; bf16 for packed bf16
      experts.
    """
    lib = _lib if _loaded else _load()
    if lib is None:
        return False
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    if op in ("rms_norm", "rotary", "act_and_mul", "embedding", "qgemm"):
        return dtype in _DTYPE_CODES
    if op == "rms_norm_heads":
        return dtype in _DTYPE_CODES and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if op == "attention":
        return dtype in _DTYPE_CODES and head_dim is not None and head_dim % 16 == 0
    if op in ("dense_pack", "dense"):
        return x.dim() == 2 and dtype in (torch.bfloat16, torch.float32)
    if op == "qgemm_pack":
        return True
    if op == "qgemm_dense":
        if fmt not in ("w4", "w8"):
            raise ValueError(f"use_kernel('qgemm_dense') needs the part's fmt ('w4' or 'w8'), got {fmt!r}")
        if fmt == "w4" and dense_isa() != "amx_bf16":
            return False
        return dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] >= QDENSE_MIN_ROWS and bf16_dot()
    if op == "gemv":
        return x.dim() == 2 and dtype in _DTYPE_CODES and x.shape[0] <= gemv_limit(dtype)
    if op == "small":
        return x.dim() == 2 and x.shape[0] <= SMALL_OP_ROWS and dtype in _DTYPE_CODES
    if op == "argmax":
        return dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    if op == "moe":
        return x.dim() == 2 and dtype in _DTYPE_CODES and (fmt != "bf16" or dtype == torch.bfloat16)
    raise ValueError(f"unknown kernel op {op!r}; one of {', '.join(KERNEL_OPS)}")


def gemv_limit(dtype: torch.dtype) -> int:
    """The most rows the skinny matmul takes for weights of `dtype` on the selected variant."""
    limit = _gemv_limit.get(dtype)
    if limit is None:
        variant = isa()
        if dtype == torch.float32:
            # No widening: on x86 the kernel beat PyTorch's sgemv up to 4 tokens (AVX2 and
            # AVX-512, 1 and 2 threads; PyTorch's did not use the second thread). The scalar
            # reference variant never does.
            limit = 0 if variant == "scalar" else (GEMV_MAX_TOKENS if variant in ("avx2", "avx512") else 1)
        else:
            wide = variant == "avx512" or (dtype == torch.bfloat16 and bf16_dot())
            limit = GEMV_MAX_TOKENS if wide else 1
        _gemv_limit[dtype] = limit
    return limit


def dense(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [m, k] @ W^T for a weight W [n, k] prepacked by `pack_bf16` or `pack_f32` (out in the
    weight's dtype, or `out_dtype`).

    The kernels can be switched off after loading (tests force the PyTorch path): the packed
    weight is then unpacked for PyTorch's GEMM, slowly but with the same values."""
    f32 = packed.dtype == torch.float32
    if use_kernel("dense", x) and x.dtype == packed.dtype:
        gemm = gemm_f32 if f32 else gemm_bf16
        return gemm(x, packed, n, k, out_dtype=out_dtype or packed.dtype)
    w = unpack_f32_ref(packed, n, k) if f32 else unpack_bf16_ref(packed, n, k)
    out = F.linear(x, w.to(x.dtype))
    return out if out_dtype is None else out.to(out_dtype)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ w [n, k]^T for a few tokens (x and w of one dtype), streaming w once at memory speed."""
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    _call("armserve_gemv", _DTYPE_CODES[x.dtype], out.data_ptr(), x.data_ptr(), w.data_ptr(), m, n, k)
    return out


# ---- small elementwise ops (csrc/graph.cpp) ---------------------------------------------------
# So that a decode step is kernel calls only (a recorded step replays nothing else); single
# threaded, for the few rows of a decode step: beyond `SMALL_OP_ROWS` rows PyTorch's threaded ops
# are the better choice.
SMALL_OP_ROWS = 64


def add_bias(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """out += bias in place (out [m, n] with unit column stride; bias [n], any supported dtype)."""
    assert out.stride(-1) == 1 and bias.is_contiguous() and bias.shape[-1] == out.shape[-1]
    _call("armserve_add_bias", _DTYPE_CODES[out.dtype], out.data_ptr(), _DTYPE_CODES[bias.dtype], bias.data_ptr(),
          out.numel() // out.shape[-1], out.shape[-1], out.stride(0) if out.dim() > 1 else out.shape[-1])
    return out


def mul_cols(x: torch.Tensor, mul: torch.Tensor) -> torch.Tensor:
    """x *= mul in place, column-wise (x [m, n] with unit column stride, mul float32 [n])."""
    assert x.dim() == 2 and x.stride(1) == 1 and mul.dtype == torch.float32 and mul.shape == (x.shape[1],)
    _call("armserve_mul_cols", _DTYPE_CODES[x.dtype], x.data_ptr(), mul.data_ptr(), x.shape[0], x.shape[1],
          x.stride(0))
    return x


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids] for int64 ids [m] (no bounds check: the engine validates token ids)."""
    assert ids.dtype == torch.int64 and ids.dim() == 1 and table.dim() == 2 and table.is_contiguous()
    ids = ids.contiguous()
    out = torch.empty(ids.shape[0], table.shape[1], dtype=table.dtype)
    _call("armserve_embedding", out.data_ptr(), table.data_ptr(), ids.data_ptr(), ids.shape[0],
          table.shape[1] * table.element_size())
    return out


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) for the float types (round to nearest even), into a new contiguous tensor."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    _call("armserve_cast", _DTYPE_CODES[x.dtype], x.data_ptr(), _DTYPE_CODES[dtype], out.data_ptr(), x.numel())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for float32 [B, V] rows with unit column stride (ties and NaNs as PyTorch)."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _call("armserve_argmax", x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


# ---- dense bf16 GEMM on prepacked weights (csrc/dense_gemm.h) ----------------------------------


def dense_isa() -> str:
    """The dense bf16 GEMM variant in use (follows the kernel variant and the bf16-dot switch)."""
    lib = _load()
    return lib.armserve_dense_isa().decode() if lib is not None else "torch"


def packed_bf16_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """Shape of `pack_bf16`'s result for a weight [n, k]: (ceil(n / 16), ceil(k / 2), 16, 2)."""
    return (-(-n // 16), -(-k // 2), 16, 2)


def pack_bf16(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prepack a bf16 weight [n, k] (done once at load) for `gemm_bf16`.

    Returns a bfloat16 tensor of shape (ceil(n / 16), ceil(k / 2), 16, 2): for column block b,
    k-pair p, column c, the pair (w[16b + c, 2p], w[16b + c, 2p + 1]), zero-padded in n and k (the
    operand layout of AVX512-BF16 vdpbf16ps / ARM BFDOT; see csrc/dense_gemm.h)."""
    assert w.dim() == 2 and w.dtype == torch.bfloat16
    w = w.contiguous()
    n, k = w.shape
    if out is None:
        out = torch.empty(packed_bf16_shape(n, k), dtype=torch.bfloat16)
    nb, kp = packed_bf16_shape(n, k)[:2]
    assert out.is_contiguous() and out.numel() * out.element_size() == nb * kp * 64
    _call("armserve_pack_bf16", w.data_ptr(), n, k, out.data_ptr())
    return out


_GEMM_OUT_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _gemm(kernel: str, x_dtype: torch.dtype, x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
          out: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`gemm_bf16` / `gemm_f32`: the checks, the output and the call, for activations of `x_dtype`."""
    assert x.dtype == x_dtype and x.dim() == 2 and x.shape[1] == k
    x = x.contiguous()
    m = x.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype)
    assert out.dim() == 2 and out.shape == (m, n) and (out.stride(1) == 1 or m == 0) and out.dtype in _GEMM_OUT_CODES
    _call(kernel, _GEMM_OUT_CODES[out.dtype], out.data_ptr(), x.data_ptr(), packed.data_ptr(), m, n, k, out.stride(0))
    return out


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [m, k] bf16 @ W^T for a weight W [n, k] packed by `pack_bf16`, any m (decode and prefill).

    `out` (bfloat16 or float32 [m, n], unit column stride) may be a column range of a wider tensor,
    e.g. `fused[:, a:a + n]`: only those columns are written. float32 output keeps the fp32 sums
    unrounded (LM-head logits)."""
    return _gemm("armserve_gemm_bf16", torch.bfloat16, x, packed, n, k, out, out_dtype)


def unpack_bf16_ref(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """PyTorch reference inverting `pack_bf16`: the bf16 weight [n, k]."""
    nb, kp = packed_bf16_shape(n, k)[:2]
    p = packed.view(torch.bfloat16).reshape(nb, kp, 16, 2)
    return p.permute(0, 2, 1, 3).reshape(nb * 16, kp * 2)[:n, :k].contiguous()


# ---- dense float32 GEMM: the same driver and tiles on float32 weights --------------------------


def dense_f32_isa() -> str:
    """The dense float32 GEMM variant in use (follows the kernel variant)."""
    lib = _load()
    return lib.armserve_dense_f32_isa().decode() if lib is not None else "torch"


def packed_f32_shape(n: int, k: int) -> tuple[int, int, int, int]:
    """Shape of `pack_f32`'s result for a weight [n, k]: (ceil(n / 16), ceil(k / 2), 2, 16)."""
    return (-(-n // 16), -(-k // 2), 2, 16)


def pack_f32(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prepack a float32 weight [n, k] (done once at load) for `gemm_f32`.

    Returns a float32 tensor of shape (ceil(n / 16), ceil(k / 2), 2, 16): for column block b,
    k-pair p, the 16 columns' weights w[16b + c, 2p], then w[16b + c, 2p + 1], zero-padded in n
    and k (one 16-lane vector each; see csrc/dense_gemm.h)."""
    assert w.dim() == 2 and w.dtype == torch.float32
    w = w.contiguous()
    n, k = w.shape
    if out is None:
        out = torch.empty(packed_f32_shape(n, k), dtype=torch.float32)
    assert out.is_contiguous() and out.shape == packed_f32_shape(n, k) and out.dtype == torch.float32
    _call("armserve_pack_f32", w.data_ptr(), n, k, out.data_ptr())
    return out


def gemm_f32(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, out: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x [m, k] float32 @ W^T for a weight W [n, k] packed by `pack_f32`, any m (decode and
    prefill); `out` as in `gemm_bf16`."""
    return _gemm("armserve_gemm_f32", torch.float32, x, packed, n, k, out, out_dtype)


def unpack_f32_ref(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """PyTorch reference inverting `pack_f32`: the float32 weight [n, k]."""
    nb, kp = packed_f32_shape(n, k)[:2]
    p = packed.reshape(nb, kp, 2, 16)
    return p.permute(0, 3, 1, 2).reshape(nb * 16, kp * 2)[:n, :k].contiguous()


def gemm_f32_ref(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PyTorch reference of `gemm_f32`: the float64 product, rounded once."""
    return (x.double() @ unpack_f32_ref(packed, n, k).double().t()).to(out_dtype)


def gemm_bf16_ref(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """PyTorch reference of `gemm_bf16`: the float64 product of the bf16 values, rounded once."""
    w = unpack_bf16_ref(packed, n, k)
    return (x.double() @ w.double().t()).to(out_dtype)
