"""Under qemu-aarch64 (scripts/ci_arm64.sh): the kernel library sees the emulated CPU and dispatches
on it. ARMSERVE_EXPECT_CPU is the QEMU -cpu string the test runs at; this folder is not part of the
normal `pytest tests` run (it only makes sense under emulation with the aarch64 build).
"""

from __future__ import annotations

import os
import re

import pytest

EXPECT_CPU = os.environ.get("ARMSERVE_EXPECT_CPU", "")
if os.uname().machine != "aarch64" or not EXPECT_CPU:
    raise RuntimeError("tests_arm/ runs only under qemu-aarch64 from scripts/ci_arm64.sh (ARMSERVE_EXPECT_CPU)")

import torch  # noqa: E402

from armserve import kernels  # noqa: E402


def expected(cpu: str) -> dict:
    """What QEMU 7.2's CPU models give: neoverse-n1 is ARMv8.2 with dotprod and no SVE/BF16/I8MM;
    `max` has everything, SVE at the vector length asked for (512 bits by default)."""
    name, *props = cpu.split(",")
    if name == "neoverse-n1":
        return dict(isas=["scalar", "neon"], best="neon", have={"neon", "dotprod"},
                    lack={"sve", "sve2", "bf16", "i8mm"}, sve_bits=0)
    if name == "max":
        on = [int(m.group(1)) for p in props if (m := re.fullmatch(r"sve(\d+)=on", p))]
        bits = max(on) if on else 512
        return dict(isas=["scalar", "neon", "sve"], best="sve", have={"neon", "dotprod", "bf16", "i8mm", "sve", "sve2"},
                    lack=set(), sve_bits=bits)
    raise AssertionError(f"no expectation for -cpu {cpu}")


def test_library_is_the_aarch64_build():
    assert kernels.available(), kernels.load_error()
    path = kernels.library._library_path()
    assert path, path
    with open(path, "rb") as f:  # the cross-build's armserve/_C.cpython-311-aarch64-linux-gnu.so or a wheel's _C.so
        head = f.read(20)
    assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, path  # e_machine EM_AARCH64
    assert len(kernels.openmp_runtimes()) == 1, kernels.openmp_runtimes()  # torch's own libgomp, no second pool
    assert kernels.openmp_library() == kernels.openmp_runtimes()[0]  # and the kernels' threads come from it


def test_features_and_variants_match_the_emulated_cpu():
    exp = expected(EXPECT_CPU)
    feats = kernels.cpu_features()
    words = {f for f in feats if "=" not in f}
    bits = [int(f.split("=")[1]) for f in feats if f.startswith("sve_bits=")]
    assert exp["have"] <= words, (EXPECT_CPU, feats)
    assert not (exp["lack"] & words), (EXPECT_CPU, feats)
    assert bits == ([exp["sve_bits"]] if exp["sve_bits"] else []), (EXPECT_CPU, feats)
    assert kernels.supported_isas() == exp["isas"]
    assert kernels.select_isa("auto") == exp["best"]
    if "sve" not in exp["isas"]:
        with pytest.raises(kernels.KernelError, match="cannot run"):
            kernels.select_isa("sve")
        assert kernels.isa() == "neon"
    print(f"-cpu {EXPECT_CPU}: features {' '.join(feats)}; variants {kernels.supported_isas()}; "
          f"torch capability {torch.backends.cpu.get_cpu_capability()}")


def test_quantized_gemm_variant_follows_the_cpu():
    """NEON's quantized GEMM takes i8mm's SMMLA where the CPU has it, SDOT otherwise (and so does
    128-bit SVE); the
    bf16 decode matmul uses BFDOT only on BF16 CPUs (tests/test_kernels.py checks both paths)."""
    exp = expected(EXPECT_CPU)
    before = kernels.isa()
    try:
        kernels.select_isa("neon")
        assert kernels.qgemm_isa() == ("neon_i8mm" if "i8mm" in exp["have"] else "neon_dotprod")
        if "sve" in exp["isas"]:  # 128-bit SVE with i8mm takes NEON's SMMLA tiles, wider SVE its own
            kernels.select_isa("sve")
            want = "neon_i8mm" if "i8mm" in exp["have"] and exp["sve_bits"] == 128 else "sve"
            assert kernels.qgemm_isa() == want
    finally:
        kernels.select_isa(before)
    assert kernels.bf16_dot() == ("bf16" in exp["have"])
