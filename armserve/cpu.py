"""This machine's CPU layout (cores, SMT siblings, NUMA nodes) and the engine's thread setup.

Threads: one per *physical* core of the process's CPU set by default (SMT siblings share the
FPUs and only add contention to GEMMs). `ARMSERVE_THREADS_BIND` pins them, like vLLM's
`VLLM_CPU_OMP_THREADS_BIND`: a core list such as `0-3,8`, or `auto` for one thread per physical
core of the first NUMA node. `OMP_NUM_THREADS`, when set, is respected as the thread count.
"""

from __future__ import annotations

import glob
import logging
import os
import platform

logger = logging.getLogger("armserve")


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            if not (a.isdigit() and b.isdigit()) or int(a) > int(b):
                raise ValueError(f"bad core range {part!r} in {text!r}")
            cores.extend(range(int(a), int(b) + 1))
        elif part.isdigit():
            cores.append(int(part))
        else:
            raise ValueError(f"bad core {part!r} in {text!r}")
    return cores


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _core_key(c: int) -> tuple[str, str]:
    """(package, core) of logical CPU `c`: equal for SMT siblings."""
    core = _read(f"/sys/devices/system/cpu/cpu{c}/topology/core_id")
    pkg = _read(f"/sys/devices/system/cpu/cpu{c}/topology/physical_package_id")
    return (pkg or "0", core or str(c))


def physical_cores(cpus: list[int] | None = None) -> list[int]:
    """One logical CPU per physical core (the lowest-numbered sibling), within `cpus`."""
    cpus = allowed_cpus() if cpus is None else cpus
    seen: set[tuple[str, str]] = set()
    out = []
    for c in cpus:
        key = _core_key(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def numa_nodes() -> dict[int, list[int]]:
    """NUMA node -> its logical CPUs (one node with every CPU when sysfs has no NUMA info)."""
    nodes = {}
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*")):
        cpulist = _read(os.path.join(path, "cpulist"))
        if cpulist:
            nodes[int(os.path.basename(path)[4:])] = parse_cpu_list(cpulist)
    return nodes or {0: allowed_cpus()}


def _first_node(cpus: list[int]) -> list[int]:
    """Those of `cpus` on the first NUMA node."""
    nodes, allowed = numa_nodes(), set(cpus)
    return [c for c in nodes[min(nodes)] if c in allowed]


def cpu_model() -> str:
    text = _read("/proc/cpuinfo") or ""
    for line in text.splitlines():
        if line.lower().startswith(("model name", "cpu model")):
            return line.split(":", 1)[1].strip()
    part = [line for line in text.splitlines() if line.startswith("CPU part")]
    if part:  # aarch64: no model name; the part number identifies the core
        parts = {"0xd0c": "Neoverse N1", "0xd40": "Neoverse V1", "0xd4f": "Neoverse V2", "0xd49": "Neoverse N2"}
        code = part[0].split(":", 1)[1].strip()
        return parts.get(code, f"ARM core {code}")
    return platform.processor() or platform.machine()


def _bind_setting() -> tuple[str, str]:
    """(variable, value) of the thread-binding setting: armserve's own name wins over vLLM's."""
    var = next((v for v in ("ARMSERVE_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND") if os.environ.get(v, "").strip()),
               "ARMSERVE_THREADS_BIND")
    return var, os.environ.get(var, "").strip()


def data_parallel_envs(data_parallel_size: int) -> list[dict[str, str]]:
    """The environment overrides of each data-parallel engine's process: its own cores.

    With a binding that lists one core group per engine, separated by `|` (vLLM's
    VLLM_CPU_OMP_THREADS_BIND convention, e.g. `0-31|32-63`), engine i gets group i. Otherwise
    the physical cores this process may use (those of the first NUMA node with `auto`) are split
    into equal consecutive groups, so the engines never compete for a core."""
    if data_parallel_size <= 1:
        return [{}]
    return [{"ARMSERVE_THREADS_BIND": g} for g in core_groups(data_parallel_size, "data_parallel_size", "engine")]


# A server whose engines run in their own processes leaves the HTTP front end (tokenizing,
# streaming, JSON) one physical core of its own when it has at least this many, as vLLM's CPU
# backend does: below it a core taken from the engine costs more than the front end gains.
FRONTEND_RESERVE_MIN_CORES = 4


def _split(cores: list[int], n: int) -> list[str]:
    """`cores` in n equal consecutive groups, as core lists (`0,1,2`); a remainder is left unused."""
    per = len(cores) // n
    return [",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(n)]


def serving_layout(data_parallel_size: int, tensor_parallel_size: int = 1,
                   allowed: list[int] | None = None) -> tuple[list[dict[str, str]], list[int] | None]:
    """Where a server's engine processes and its front end run: (each engine process's environment
    overrides, the CPUs the front end pins itself to, or None to leave it unpinned).

    With a binding in the environment the engines get it (split per engine as `data_parallel_envs`
    does) and the front end the allowed CPUs on no physical core of theirs, if any. Without one, on
    a machine of at least FRONTEND_RESERVE_MIN_CORES physical cores, the last physical core (with its
    SMT siblings) is the front end's and the engines are bound to the others, one group per engine
    and tensor-parallel rank; on a smaller machine nothing changes."""
    allowed = allowed_cpus() if allowed is None else allowed
    var, bind = _bind_setting()
    if bind:
        envs = data_parallel_envs(data_parallel_size)
        binds = [e.get("ARMSERVE_THREADS_BIND", bind) for e in envs]
        engine: set[int] = set()
        for b in binds:
            for group in b.split("|"):
                engine.update(bound_cores(var, group.strip()) if group.strip() else [])
        busy = {_core_key(c) for c in engine}
        front = [c for c in allowed if _core_key(c) not in busy]
        return envs, front or None
    cores = physical_cores(allowed)
    ranks = data_parallel_size * tensor_parallel_size
    if len(cores) < FRONTEND_RESERVE_MIN_CORES or len(cores) - 1 < ranks:
        return data_parallel_envs(data_parallel_size), None
    reserved = _core_key(cores[-1])
    front = [c for c in allowed if _core_key(c) == reserved]
    rest = cores[:-1]
    groups = _split(rest, ranks)
    envs = [{"ARMSERVE_THREADS_BIND": "|".join(groups[i * tensor_parallel_size:(i + 1) * tensor_parallel_size])}
            for i in range(data_parallel_size)]
    return envs, front


def core_groups(n: int, what: str = "tensor_parallel_size", unit: str = "rank") -> list[str]:
    """One core list per engine or tensor-parallel rank: the `|`-separated groups of the binding
    (vLLM's VLLM_CPU_OMP_THREADS_BIND convention), else the allowed physical cores split evenly."""
    var, bind = _bind_setting()
    if bind and bind != "auto":
        groups = [g.strip() for g in bind.split("|")]
        if len(groups) != n:
            raise ValueError(f"{var}: {bind!r} lists {len(groups)} core group(s) separated by '|'; "
                             f"{what} {n} needs one per {unit}")
        for g in groups:
            try:
                parse_cpu_list(g)
            except ValueError as e:
                raise ValueError(f"{var}: {e}") from None
    else:
        allowed = _first_node(allowed_cpus()) if bind == "auto" else allowed_cpus()
        cores = physical_cores(allowed)
        if len(cores) < n:  # SMT siblings rather than nothing
            cores = allowed
        if len(cores) < n:
            raise ValueError(f"{what} {n} needs at least one core per {unit}; "
                             f"this process may use {len(cores)} ({cores})")
        groups = _split(cores, n)
    return groups


def one_binding() -> tuple[str, str]:
    """(variable, value) of the environment's binding for one engine: a `|`-separated list of
    groups (one per rank or engine) is refused here, naming the variable."""
    var, bind = _bind_setting()
    if "|" in bind:
        raise ValueError(f"{var}: {bind!r} lists cores for several ranks or engines ('|'); give one core list, "
                         "or one group per rank with tensor_parallel_size / data_parallel_size")
    return var, bind


def bound_cores(var: str, bind: str) -> list[int]:
    """The cores a binding names: `auto` is the first NUMA node's physical cores (of those this
    process may use), else a core list, each core one this process may use (ValueError naming
    `var` otherwise)."""
    if bind == "auto":
        return physical_cores(_first_node(allowed_cpus()))
    try:
        cores = parse_cpu_list(bind)
    except ValueError as e:
        raise ValueError(f"{var}: {e}") from None
    bad = sorted(set(cores) - set(allowed_cpus()))
    if bad:
        raise ValueError(f"{var} lists cores {bad} that this process may not use (allowed: {allowed_cpus()})")
    return cores


_initialised = False


def init_threads(bind: str | None = None) -> dict:
    """Set the engine's thread count and pinning once per process; returns what was done.
    `bind` (a tensor-parallel rank's core group) overrides the environment's binding."""
    global _initialised
    import torch

    from armserve import kernels

    info: dict = {"bind": None}
    # vLLM's CPU name too (armserve's own wins); its `|` separates tensor-parallel ranks (or
    # data-parallel engines), each of which gets its group from core_groups()
    if bind is None:
        var, bind = one_binding()
    else:
        var = "the tensor-parallel rank's core group"
    if _initialised:
        info["threads"] = torch.get_num_threads()
        return info
    _initialised = True
    kernels.available()  # at engine start: a missing kernel library is reported now (reason and fix), not mid-run
    import armserve

    if armserve.OMP_WAIT_POLICY_DROPPED is not None:
        if armserve.OMP_LOADED_BEFORE_ARMSERVE:
            logger.warning("OMP_WAIT_POLICY=%s: torch was imported before armserve, so this process's OpenMP "
                           "threads sleep at every barrier (slower steps); import armserve first, or unset it",
                           armserve.OMP_WAIT_POLICY_DROPPED)
        else:
            logger.info("OMP_WAIT_POLICY=%s ignored: the engine's threads spin briefly before they sleep "
                        "(ARMSERVE_KEEP_OMP_WAIT_POLICY=1 keeps it)", armserve.OMP_WAIT_POLICY_DROPPED)
    if bind:
        cores = bound_cores(var, bind)
        torch.set_num_threads(len(cores))
        if kernels.available():
            kernels.bind_threads(cores)
            info["bind"] = cores
        else:
            logger.warning("%s ignored: %s", var, kernels.load_error())
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, len(physical_cores())))
    info["threads"] = torch.get_num_threads()
    return info


def describe() -> dict:
    """Everything `armserve info` prints, as a dict."""
    import torch

    from armserve import kernels
    from armserve.dtypes import cpu_has_native_bf16, resolve_dtype

    variant = kernels.isa()
    # The skinny (decode) matmul's bf16 rows go to the CPU's bf16 dot instruction where the
    # variant has one (AVX-512 with AVX512-BF16, NEON/SVE with BF16).
    skinny = variant + ("+bf16dot" if variant in ("avx512", "neon", "sve") and kernels.bf16_dot() else "")
    return {
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "logical_cpus": len(allowed_cpus()),
        "physical_cores": len(physical_cores()),
        "numa_nodes": {n: cpus for n, cpus in numa_nodes().items()},
        "cpu_features": kernels.cpu_features(),
        "native_bf16": cpu_has_native_bf16(),
        "auto_dtype": str(resolve_dtype("auto")).replace("torch.", ""),
        "auto_dtype_gguf": str(resolve_dtype("auto", quantized_gguf=True)).replace("torch.", ""),
        "kernel_library": kernels.library_path(),
        "kernel_variants_compiled": kernels.compiled_variants(),
        "kernel_variants_supported": kernels.supported_isas(),
        "kernels": {**{family: variant for family in
                       ("paged_attention", "reshape_and_cache", "rms_norm", "rotary", "act_and_mul")},
                    "skinny_matmul": skinny, "quantized_gemm": kernels.qgemm_isa(),
                    "dense_gemm_bf16": kernels.dense_isa(), "dense_gemm_f32": kernels.dense_f32_isa()},
        "kernels_unavailable_reason": kernels.load_error() if variant == "torch" else None,
        "kernels_fix": kernels.fallback_notice(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "threads_bind": os.environ.get("ARMSERVE_THREADS_BIND") or None,
        "thread_cores": kernels.thread_cores(),
        "openmp_runtime": kernels.openmp_library(),
        "openmp_runtimes_loaded": kernels.openmp_runtimes(),
    }
