"""pytest plugin for scripts/ci_arm64.sh (`-p isa_filter`): of the kernel tests parametrized by the
`isa` fixture (tests/conftest.py), keep only the variants named in ARMSERVE_ARM_ISAS ("neon sve", ...)
and deselect the others, so each variant runs at the emulated CPUs where it can behave differently
(the scalar variant nowhere depends on the CPU; NEON on bf16/i8mm, not on the SVE vector length).
Tests without the fixture run as they are. Unset or empty: every variant runs.
"""

from __future__ import annotations

import os


def pytest_collection_modifyitems(config, items):
    wanted = os.environ.get("ARMSERVE_ARM_ISAS", "").split()
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        isa = callspec.params.get("isa") if callspec else None
        (drop if isa is not None and isa not in wanted else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
