"""The ISA-sensitive test files once more under every other kernel variant this CPU can run, forced
with `ARMSERVE_ISA` in a fresh process.

A forced variant stands for the CPUs it is built for in every decision (bf16 dot instructions,
native bfloat16 and so `dtype="auto"`, matmul token limits, which steps replay from step graphs),
so `ARMSERVE_ISA=avx2` on an AVX-512 machine runs what an AVX2-only CPU runs. The kernel tests
already cover every variant through the `isa` fixture; these files pick the variant once, at
import, like the engine does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import kernel_isas

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = ["test_step_graph.py", "test_engine.py", "test_models.py"]


def _auto_isa() -> str:
    from armserve import kernels

    return kernels.isa()


@pytest.mark.parametrize("variant", [v for v in kernel_isas() if v != _auto_isa()])
def test_isa_sensitive_files_pass_with_variant_forced(variant):
    env = {**os.environ, "ARMSERVE_ISA": variant}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *FILES]
    proc = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=1500)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, f"ARMSERVE_ISA={variant} pytest {' '.join(FILES)} failed:\n{tail}"
    # The forced variant was really the one used (kernels raises on an unknown or unsupported name).
    check = subprocess.run([sys.executable, "-c", "from armserve import kernels; print(kernels.isa())"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert check.stdout.strip() == variant, check.stderr
