"""Loading the C++ kernel library (armserve/_C*.so, built from csrc/) and what it tells about
this CPU: the kernel variant (ISA) in use, CPU features, the OpenMP runtime and thread binding.

The library is reached through ctypes with raw data pointers, so it needs no torch at build
time. `ARMSERVE_ISA=scalar|avx2|avx512|neon|sve` forces a variant; `ARMSERVE_ISA=torch` turns the
kernels off (every op then runs its PyTorch reference, kernels/reference.py).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os

import torch

# Element types of activations, weights and KV cache (csrc/api.h: ArmDType).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

logger = logging.getLogger("armserve")

_lib: ctypes.CDLL | None = None
_load_error: str | None = None
_loaded = False
# Bumped whenever a kernel choice changes (ISA, bf16 dot, AMX): step-graph recordings and cached
# choices (the gemv row limit, dispatch.py) made before are stale.
kernel_generation = 0


class KernelError(ValueError):
    """The kernel library cannot do what was asked (unknown or unsupported ISA)."""


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
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # armserve/, beside the sources
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


def load() -> ctypes.CDLL | None:
    """The library, loaded on first use; None when it is off or cannot load (`load_error()` says why)."""
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
        # A warning in the log of `armserve serve` and of any LLM(...) script (cpu.init_threads loads
        # the library at engine start), not a one-line Python warning that is easy to miss or filter.
        logger.warning("%s\n%s\n%s", "*" * 100, fallback_notice(), "*" * 100)
        return None
    if want:
        select_isa(want)
    if os.environ.get("ARMSERVE_BF16_DOT", "").strip() == "0":
        _lib.armserve_set_bf16_dot(0)
    if os.environ.get("ARMSERVE_AMX", "").strip() == "0":
        _lib.armserve_set_amx(0)
    return _lib


def fallback_notice() -> str | None:
    """What to tell the user while every op runs on the PyTorch path: the reason and the fix (None
    when the kernels are loaded)."""
    if load() is not None:
        return None
    if _load_error and "ARMSERVE_ISA=torch" in _load_error:
        fix = "unset ARMSERVE_ISA"
    else:
        from importlib.metadata import PackageNotFoundError, version

        try:
            pin = f"armserve=={version('armserve')}"
        except PackageNotFoundError:
            pin = "armserve"
        fix = (f"install the prebuilt wheel, which has every kernel variant for {os.uname().machine} and needs no "
               f"compiler: pip install --force-reinstall --no-deps --only-binary=armserve '{pin}' (or a wheel file "
               "made by scripts/build_wheels.sh); or install g++ and reinstall from source")
    return (f"armserve: C++ kernels unavailable ({_load_error}); every op runs on the PyTorch path, several times "
            f"slower. Fix: {fix}. `armserve info` shows the kernels in use.")


def required() -> ctypes.CDLL:
    """The library, or KernelError saying why it is unavailable."""
    lib = load()
    if lib is None:
        raise KernelError(f"C++ kernels unavailable: {_load_error}")
    return lib


def select_isa(name: str) -> str:
    """Switch every kernel to variant `name` (or `auto`); returns the variant now in use."""
    lib = required()
    global kernel_generation
    rc = lib.armserve_select_isa(name.encode())
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
    return load() is not None


def load_error() -> str | None:
    load()
    return _load_error


def _variant(query: str) -> str:
    lib = load()
    return getattr(lib, query)().decode() if lib is not None else "torch"


def isa() -> str:
    """The variant in use, or "torch" when the kernels are off."""
    return _variant("armserve_isa")


def qgemm_isa() -> str:
    """The quantized-GEMM variant that goes with the current kernel variant."""
    return _variant("armserve_qgemm_isa")


def dense_isa() -> str:
    """The dense bf16 GEMM variant in use (follows the kernel variant and the bf16-dot switch)."""
    return _variant("armserve_dense_isa")


def dense_f32_isa() -> str:
    """The dense float32 GEMM variant in use (follows the kernel variant)."""
    return _variant("armserve_dense_f32_isa")


def compiled_variants() -> list[str]:
    """Variants built into the loaded library (whether or not this CPU runs them): every one of its
    architecture in a prebuilt wheel; empty when the kernels are off."""
    lib = load()
    return lib.armserve_compiled_variants().decode().split() if lib is not None else []


def status() -> dict[str, str]:
    """The kernel library as /metrics reports it (`armserve:kernels_info`): the variant in use
    (`torch` on the PyTorch path), whether it loaded, the variants built in, and why not."""
    return {"isa": isa(), "available": str(available()).lower(), "variants": " ".join(compiled_variants()),
            "reason": load_error() or ""}


def library_path() -> str | None:
    """The kernel library file that is (or would be) loaded."""
    return _library_path()


def supported_isas() -> list[str]:
    """Variants this CPU can run (probing leaves the current choice as it was)."""
    lib = load()
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
    lib = load()
    return lib is not None and bool(ctypes.c_int.in_dll(lib, "armserve_bf16_dot").value)


def native_bf16() -> bool | None:
    """Whether the selected kernel variant computes bfloat16 natively on this CPU (None when the
    kernels are off). A forced variant stands for the CPUs it is built for: `avx2` or `scalar` on an
    AVX512-BF16 machine answer False, as an AVX2-only CPU would."""
    lib = load()
    return None if lib is None else bool(lib.armserve_native_bf16())


def _switch(name: str, on: bool, missing: str) -> bool:
    """Set the library's `name` switch (bf16_dot, amx); the previous setting; KernelError `missing`
    when the CPU cannot turn it on."""
    lib = required()
    global kernel_generation
    before = bool(getattr(lib, f"armserve_{name}_wanted")())
    kernel_generation += 1
    if getattr(lib, f"armserve_set_{name}")(int(on)) == 2:
        raise KernelError(f"{missing} (features: {' '.join(cpu_features())})")
    return before


def set_bf16_dot(on: bool) -> bool:
    """Allow (on) or forbid the bf16 dot instructions (tests, comparisons); returns the previous
    setting, to restore. They are used only while the CPU and the selected variant have them, so
    `bf16_dot()` may stay False after `set_bf16_dot(True)`."""
    return _switch("bf16_dot", on, "this CPU has no bf16 dot instruction")


def amx_available() -> bool:
    """True when the dense bf16 GEMM can run on Intel AMX tiles here: the CPU has AMX-BF16 and
    Linux granted this process the tile data (the library asks once)."""
    lib = load()
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
    return _switch("amx", on, "AMX-BF16 is not available here: the CPU lacks it or Linux refused its tile data")


def cpu_features() -> list[str]:
    lib = load()
    if lib is None:
        return []
    buf = ctypes.create_string_buffer(512)
    lib.armserve_cpu_features(buf, 512)
    return buf.value.decode().split()


def bind_threads(cores: list[int]) -> None:
    """Run one OpenMP thread (PyTorch's too: the runtime is shared) per listed core, pinned."""
    lib = load()
    if lib is None:
        raise KernelError(f"thread binding needs the C++ library: {_load_error}")
    arr = (ctypes.c_int32 * len(cores))(*cores)
    rc = lib.armserve_bind_threads(arr, len(cores))
    if rc:
        raise KernelError(f"cannot pin threads to cores {cores} (code {rc})")


def openmp_library() -> str | None:
    """The OpenMP runtime the kernels' threads come from (PyTorch's, so one thread pool)."""
    lib = load()
    if lib is None:
        return None
    buf = ctypes.create_string_buffer(4096)
    # realpath: the loader reports the path as it was opened (e.g. torch/lib/../../torch.libs/...)
    return os.path.realpath(buf.value.decode()) if lib.armserve_openmp_library(buf, 4096) == 0 else None


def thread_cores() -> list[int]:
    """The core each OpenMP thread is running on right now."""
    lib = load()
    if lib is None:
        return []
    arr = (ctypes.c_int32 * 1024)()
    n = lib.armserve_thread_cores(arr, 1024)
    return list(arr[:n])
