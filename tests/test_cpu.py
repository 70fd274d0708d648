"""CPU layout, thread pinning and `armserve info`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from armserve.cpu import allowed_cpus, parse_cpu_list, physical_cores


def run(args: list[str], **env) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("OMP_NUM_THREADS", None)
    e.update(env)
    return subprocess.run([sys.executable, "-m", "armserve.cli", *args], capture_output=True, text=True, env=e,
                          timeout=120)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    with pytest.raises(ValueError, match="bad core"):
        parse_cpu_list("3-1")
    with pytest.raises(ValueError, match="bad core"):
        parse_cpu_list("a")


def test_info_reports_the_forced_variant_and_one_openmp_runtime():
    r = run(["info", "--json"], ARMSERVE_ISA="scalar")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert set(info["kernels"].values()) == {"scalar"}
    assert "scalar" in info["kernel_variants_supported"]
    assert info["openmp_runtime"] in info["openmp_runtimes_loaded"] and "torch" in info["openmp_runtime"]
    assert info["physical_cores"] == len(physical_cores())
    # Default: one thread per physical core.
    assert info["torch_threads"] == len(physical_cores())


def test_threads_bind_pins_each_thread():
    core = allowed_cpus()[-1]
    r = run(["info", "--json"], ARMSERVE_THREADS_BIND=str(core))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["torch_threads"] == 1 and info["thread_cores"] == [core]


def test_threads_bind_rejects_cores_outside_the_cpu_set():
    r = run(["info"], ARMSERVE_THREADS_BIND="4096")
    assert r.returncode == 2 and "ARMSERVE_THREADS_BIND" in r.stderr


def test_vllm_cpu_environment_names(monkeypatch):
    """vLLM's CPU variables work where armserve's are unset: the thread binding (its `|` between
    tensor-parallel ranks refused by name) and the KV cache size."""
    core = allowed_cpus()[-1]
    r = run(["info", "--json"], VLLM_CPU_OMP_THREADS_BIND=str(core))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["thread_cores"] == [core]
    r = run(["info"], VLLM_CPU_OMP_THREADS_BIND=f"{core}|{core}")
    assert r.returncode == 2 and "VLLM_CPU_OMP_THREADS_BIND" in r.stderr and "rank" in r.stderr
    from armserve.config import EngineConfig

    monkeypatch.delenv("ARMSERVE_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    assert EngineConfig(model="x").kv_cache_space == 1.5
    monkeypatch.setenv("ARMSERVE_KVCACHE_SPACE", "0.5")  # armserve's own wins
    assert EngineConfig(model="x").kv_cache_space == 0.5


def test_unknown_isa_is_a_clear_error():
    r = run(["info"], ARMSERVE_ISA="avx9000")
    assert r.returncode == 2 and "unknown ISA" in r.stderr
