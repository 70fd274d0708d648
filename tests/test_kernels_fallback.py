"""The kernel library's report of itself: the variants built in (`armserve info`, /metrics), and a
loud notice with the reason and the fix when it is missing (a source install without a compiler)."""

from __future__ import annotations

import logging
import os
import re

from armserve import kernels
from armserve.cpu import describe
from armserve.entrypoints.metrics import PrometheusMetrics

BUILT_IN = {"x86_64": ["scalar", "avx2", "avx512", "amx_bf16"], "aarch64": ["scalar", "neon", "sve"]}


def kernels_info(metrics: PrometheusMetrics) -> dict:
    """The labels of the one `armserve:kernels_info` series, whose value must be 1, once the
    engine's kernels.status() is set (a server sets it from its engine's "ready" report)."""
    metrics.set_kernels(kernels.status())
    lines = [ln for ln in metrics.render().decode().splitlines() if ln.startswith("armserve:kernels_info{")]
    assert len(lines) == 1 and lines[0].endswith(" 1.0"), lines
    return dict(re.findall(r'(\w+)="([^"]*)"', lines[0]))


def test_built_in_variants_reported():
    info = describe()
    # the library names its own variants: every one of the architecture (what a wheel must carry)
    assert info["kernel_variants_compiled"] == BUILT_IN[os.uname().machine]
    assert set(info["kernel_variants_supported"]) <= set(info["kernel_variants_compiled"])
    assert info["kernel_library"] == kernels.library_path() and info["kernels_fix"] is None
    labels = kernels_info(PrometheusMetrics("m"))
    assert labels == {"isa": kernels.isa(), "available": "true", "variants": " ".join(BUILT_IN[os.uname().machine]),
                      "reason": ""}


def test_missing_library_is_loud(monkeypatch, caplog):
    # what load() meets in a source install made without a compiler: no armserve/_C*.so
    monkeypatch.delenv("ARMSERVE_ISA", raising=False)
    for name, value in (("_lib", None), ("_loaded", False), ("_load_error", None), ("_library_path", lambda: None)):
        monkeypatch.setattr(kernels.library, name, value)
    with caplog.at_level(logging.WARNING, logger="armserve"):
        assert not kernels.available()
    notice = kernels.fallback_notice()
    assert "is not built" in notice and "PyTorch path" in notice
    assert "pip install --force-reinstall --no-deps --only-binary=armserve" in notice
    assert [r.levelno for r in caplog.records] == [logging.WARNING] and notice in caplog.records[0].getMessage()
    assert kernels.isa() == "torch" and kernels.compiled_variants() == []
    labels = kernels_info(PrometheusMetrics("m"))
    assert labels == {"isa": "torch", "available": "false", "variants": "", "reason": kernels.load_error()}

    # ARMSERVE_ISA=torch turns them off on purpose: the fix is to unset it
    monkeypatch.setenv("ARMSERVE_ISA", "torch")
    monkeypatch.setattr(kernels.library, "_loaded", False)
    assert not kernels.available() and kernels.fallback_notice().endswith(
        "Fix: unset ARMSERVE_ISA. `armserve info` shows the kernels in use.")
