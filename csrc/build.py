"""How the kernel library is compiled: one object per ISA variant, each with its own flags.

Used by setup.py (native build during `pip install`) and directly for cross builds:

    python csrc/build.py --cxx aarch64-linux-gnu-g++ --arch aarch64 --out /tmp/arm/_C.so
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

# -ffp-contract=off: no implicit FMA, so rounding matches the PyTorch references (ties in int8
# quantization would otherwise round differently); explicit FMA intrinsics are unaffected.
COMMON = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas",
          "-Wno-maybe-uninitialized"]
# The reference variant must stay scalar: it is what every SIMD variant is checked against.
SCALAR = ["-fno-tree-vectorize"]

VARIANTS = {
    "x86_64": {
        "kernels_scalar.cpp": SCALAR,
        "kernels_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
        "kernels_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
        "dispatch.cpp": [],
        "threads.cpp": [],
        "qgemm_scalar.cpp": SCALAR,
        "qgemm_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
        "qgemm_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"],
        "qdispatch.cpp": [],
        "graph.cpp": [],
        "dense_gemm_scalar.cpp": SCALAR,
        "dense_gemm_avx2.cpp": ["-mavx2", "-mfma"],
        # AVX512-BF16 only inside functions marked target("avx512bf16") (dense_gemm_avx512.cpp).
        "dense_gemm_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
        # AMX only inside functions marked target("amx-tile,amx-bf16") (dense_gemm_amx.cpp).
        "dense_gemm_amx.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
        "dense_dispatch.cpp": [],
        "api.cpp": [],
        "shm_comm.cpp": [],
    },
    "aarch64": {
        "kernels_scalar.cpp": ["-march=armv8-a"] + SCALAR,
        "kernels_neon.cpp": ["-march=armv8-a"],
        "kernels_sve.cpp": ["-march=armv8.2-a+sve"],
        "dispatch.cpp": ["-march=armv8-a"],
        "threads.cpp": ["-march=armv8-a"],
        "qgemm_scalar.cpp": ["-march=armv8-a"] + SCALAR,
        "qgemm_neon.cpp": ["-march=armv8.2-a+dotprod"],
        "qgemm_sve.cpp": ["-march=armv8.2-a+sve"],
        "qdispatch.cpp": ["-march=armv8-a"],
        "graph.cpp": ["-march=armv8-a"],
        "dense_gemm_scalar.cpp": ["-march=armv8-a"] + SCALAR,
        # BFDOT only inside functions marked target("arch=armv8.2-a+bf16") (dense_gemm_neon.h).
        "dense_gemm_neon.cpp": ["-march=armv8-a"],
        "dense_gemm_sve.cpp": ["-march=armv8.2-a+sve"],
        "dense_dispatch.cpp": ["-march=armv8-a"],
        "api.cpp": ["-march=armv8-a"],
        "shm_comm.cpp": ["-march=armv8-a"],
    },
}
# NOTE: no -lgomp at link time. The library's GOMP_* symbols bind at load time to the OpenMP
# runtime PyTorch already loaded (armserve/kernels/library.py loads it globally first), so the
# process has one OpenMP thread pool, not two fighting over the cores.
LINK = ["-shared"]
# After the objects: libgcc's float16 conversion helpers (__extendhfsf2, __truncsfhf2: the x86 scalar
# code's _Float16) are linked in, hidden, rather than imported from libgcc_s, where they first came
# with GCC 12: importing them would raise the glibc a prebuilt wheel needs to 2.35 (scripts/build_wheels.sh).
LIBS = ["-l:libgcc.a"]


def normalize_arch(machine: str) -> str:
    return {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64"}.get(
        machine.lower(), machine.lower()
    )


def sources(arch: str) -> list[tuple[str, list[str]]]:
    """(source path, extra flags) for every translation unit of `arch`."""
    if arch not in VARIANTS:
        return [(os.path.join(HERE, f), flags) for f, flags in
                [("kernels_scalar.cpp", SCALAR), ("dispatch.cpp", []), ("threads.cpp", []),
                 ("qgemm_scalar.cpp", SCALAR), ("qdispatch.cpp", []), ("graph.cpp", []),
                 ("dense_gemm_scalar.cpp", SCALAR), ("dense_dispatch.cpp", []), ("api.cpp", []),
                 ("shm_comm.cpp", [])]]
    return [(os.path.join(HERE, src), flags) for src, flags in VARIANTS[arch].items()]


# ARMSERVE_BUILD_CACHE=DIR: keep each compiled object there, keyed by the compiler, its flags and
# the csrc/ files, and reuse it when they are unchanged. CI compiles the same objects several times
# (scripts/setup.sh's x86 build, ci_arm64.sh's cross build, then build_wheels.sh for both), and
# .ci/run sets it. Unset: every object is compiled.
CACHE_ENV = "ARMSERVE_BUILD_CACHE"


def _cache_paths(cxx: str, arch: str, sources_flags: list[tuple[str, list[str]]]) -> dict[str, str]:
    """source path -> its cached object's path, for the csrc/ sources (whose includes are all in
    csrc/); {} without a cache."""
    cache = os.environ.get(CACHE_ENV)
    if not cache:
        return {}
    base = hashlib.sha256()
    # The compiler: where it is and what it says it is (a changed toolchain changes the key).
    version = subprocess.run([cxx, "--version"], capture_output=True, check=True).stdout
    base.update(f"{shutil.which(cxx)}\0{arch}\0".encode() + version)
    for name in sorted(os.listdir(HERE)):
        if name.endswith(".h"):
            with open(os.path.join(HERE, name), "rb") as f:
                base.update(name.encode() + b"\0" + f.read())
    folder = os.path.join(cache, os.path.basename(cxx))
    paths = {}
    for src, flags in sources_flags:
        h = base.copy()
        with open(src, "rb") as f:
            h.update("\0".join([*COMMON, *flags, os.path.basename(src)]).encode() + b"\0" + f.read())
        paths[src] = os.path.join(folder, f"{os.path.basename(src)}.{h.hexdigest()[:32]}.o")
    return paths


def _store(obj: str, cached: str) -> None:
    """Put a fresh object in the cache, dropping that source's older objects (atomic for readers)."""
    folder = os.path.dirname(cached)
    os.makedirs(folder, exist_ok=True)
    prefix = os.path.basename(cached).rsplit(".", 2)[0] + "."
    for old in os.listdir(folder):
        if old.startswith(prefix) and old.endswith(".o"):
            os.remove(os.path.join(folder, old))
    tmp = f"{cached}.{os.getpid()}.tmp"
    shutil.copyfile(obj, tmp)
    os.replace(tmp, cached)


def build(cxx: str, arch: str, out: str, extra_sources: list[tuple[str, list[str]]] = (), jobs: int = 2,
          build_dir: str | None = None) -> None:
    """Compile every variant (in parallel) into `build_dir` and link `out`."""
    build_dir = build_dir or os.path.join(os.path.dirname(os.path.abspath(out)), f".build-{arch}")
    os.makedirs(build_dir, exist_ok=True)
    # Only the library's own sources are cached: extra ones (module.cpp) include headers from elsewhere.
    cached = _cache_paths(cxx, arch, sources(arch))
    objs, procs = [], []
    for src, flags in list(sources(arch)) + list(extra_sources):
        obj = os.path.join(build_dir, os.path.basename(src) + ".o")
        objs.append(obj)
        hit = cached.get(src)
        if hit:
            try:
                shutil.copyfile(hit, obj)
                continue
            except FileNotFoundError:  # not cached yet (or replaced by a build of other sources)
                pass
        procs.append((subprocess.Popen([cxx, *COMMON, *flags, "-I", HERE, "-c", src, "-o", obj]), obj, hit))
        if len(procs) >= jobs:
            _wait(*procs.pop(0))
    for p in procs:
        _wait(*p)
    subprocess.check_call([cxx, *LINK, *objs, *LIBS, "-o", out])


def _wait(p: subprocess.Popen, obj: str, cached: str | None) -> None:
    if p.wait() != 0:
        raise subprocess.CalledProcessError(p.returncode, p.args)
    if cached:
        _store(obj, cached)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    ap.add_argument("--arch", default=normalize_arch(os.uname().machine))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    build(args.cxx, args.arch, args.out)
    print(args.out)
