"""The batched LoRA kernels (csrc/lora_impl.h, kernels/lora.py) against their PyTorch references, for
every ISA variant this CPU runs: mixed adapter slots in one batch (and -1, no adapter), zero-padded
ranks, strided views, odd sizes (vector tails), the K split of small batches, and step-graph replay.

Also run under QEMU for aarch64 (scripts/ci_arm64.sh) with ARMSERVE_TEST_SMALL=1 (smaller shapes).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import on_one_and_two_threads

from armserve import kernels
from armserve.kernels import lora
from armserve.kernels.lora import lora_expand_, lora_expand_ref, lora_shrink, lora_shrink_ref

SMALL = os.environ.get("ARMSERVE_TEST_SMALL") == "1"
DTYPES = [torch.float32, torch.bfloat16]
# shrink's output is float32 in both cases (bf16 products are exact in fp32; only the order of the
# sums, and ARM BFDOT's rounding, differ from the float64 reference); expand rounds once to y's dtype.
SHRINK_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
EXPAND_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}

# (tokens, K, R, slots): decode batches (K split into 512-column chunks when K > 512 and T <= 64),
# a prefill-sized one (no split, several 16-token blocks per slot), odd K for the vector tails.
SHRINK_CASES = [(1, 64, 8, 2), (5, 1031, 16, 3), (64, 1100, 8, 4), (70, 333, 24, 3)]
if SMALL:
    SHRINK_CASES = [(1, 64, 8, 2), (5, 531, 16, 3), (64, 600, 8, 4), (70, 33, 8, 3)]
# (tokens, N, R, slots): N over several 64-column blocks with a tail.
EXPAND_CASES = [(1, 100, 8, 2), (6, 333, 16, 3), (64, 130, 64, 4)]
if SMALL:
    EXPAND_CASES = [(1, 100, 8, 2), (6, 131, 16, 3), (64, 70, 16, 4)]


def mixed_indices(t: int, slots: int, seed: int) -> torch.Tensor:
    """Every slot and -1 present (from 2 tokens on), in shuffled order."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(t) % (slots + 1) - 1
    return idx[torch.randperm(t, generator=g)].to(torch.int64)


@pytest.fixture
def no_fallback(monkeypatch):
    """The kernel must run: lora.py's fallback to the reference fails the test."""
    def refuse(*args):
        raise AssertionError("fell back to the PyTorch reference")

    monkeypatch.setattr(lora, "lora_shrink_ref", refuse)
    monkeypatch.setattr(lora, "lora_expand_ref", refuse)


def padded(t: torch.Tensor, slot: int, rank: int, dim: int) -> torch.Tensor:
    """Zero slot `slot`'s entries past `rank` along `dim` (an adapter of a lower rank than R)."""
    t = t.clone()
    t[slot].narrow(dim - 1, rank, t.shape[dim] - rank).zero_()
    return t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHRINK_CASES, ids=lambda c: "x".join(map(str, c)))
def test_shrink(isa, dtype, case, no_fallback):
    t, k, r, slots = case
    torch.manual_seed(t * k)
    # x: rows of a wider tensor (row stride > K); a: rows r0.. of a fused layer's A stacked along R
    x = torch.randn(t, k + 5).to(dtype)[:, 2:2 + k]
    a = padded((torch.randn(slots, r + 8, k) / k ** 0.5).to(dtype), slots - 1, r // 2 + 3, 1)[:, 3:3 + r]
    idx = mixed_indices(t, slots, t)
    one, two = on_one_and_two_threads(lambda: lora_shrink(x, a, idx))
    # The K split adds its partial sums in a fixed order: the thread count changes no bit.
    torch.testing.assert_close(one, two, rtol=0, atol=0)
    ref = lora_shrink_ref(x, a, idx)
    tol = SHRINK_TOL[dtype]
    torch.testing.assert_close(one, ref, rtol=tol, atol=tol)
    assert (one[idx < 0] == 0).all()
    assert (one[idx == slots - 1][:, r // 2:] == 0).all()  # the padded rank stays zero


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXPAND_CASES, ids=lambda c: "x".join(map(str, c)))
def test_expand(isa, dtype, case, no_fallback):
    t, n, r, slots = case
    torch.manual_seed(t * n)
    # y: a column range of a fused output (rows any stride apart), buf: a column slice of a wider
    # shrink buffer (a fused layer's slices share one), scales per slot.
    fused = torch.randn(t, n + 40).to(dtype)
    y = fused[:, 17:17 + n]
    wide = torch.randn(t, r + 8)
    buf = wide[:, 3:3 + r]
    # b: columns 5.. of a fused layer's B (each slot's [n, r] rows contiguous, slots further apart)
    b = padded(torch.randn(slots, n + 9, r).to(dtype) * 0.5, 0, r // 2, 2)[:, 5:5 + n]
    scales = torch.rand(slots) + 0.5
    idx = mixed_indices(t, slots, n)
    before = fused.clone()

    def run():
        fused.copy_(before)
        lora_expand_(y, buf, b, idx, scales)
        return fused.clone()

    out, out2 = on_one_and_two_threads(run)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    ref = before.clone()
    lora_expand_ref(ref[:, 17:17 + n], buf, b, idx, scales)
    atol, rtol = EXPAND_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    # Only y's columns of rows with an adapter change; other columns and rows keep every bit.
    keep = torch.ones_like(before, dtype=torch.bool)
    keep[(idx >= 0).nonzero().squeeze(1), 17:17 + n] = False
    assert torch.equal(out[keep], before[keep])


def test_shrink_then_expand_is_the_lora_delta(isa, no_fallback):
    """Independent of the references: the two kernels give x @ A.T @ B.T * scale per token, with
    a slot past the stacked adapters (the kernels' guard) treated as no adapter."""
    torch.manual_seed(5)
    t, k, r, n, slots = 9, 96, 8, 72, 3
    x, a, b = torch.randn(t, k), torch.randn(slots, r, k) * 0.1, torch.randn(slots, n, r) * 0.1
    scales = torch.tensor([0.5, 2.0, 1.0])
    idx = torch.tensor([2, 0, -1, 1, 1, 0, 3, 2, -1])
    y = torch.zeros(t, n)
    lora_expand_(y, lora_shrink(x, a, idx), b, idx, scales)
    for i, s in enumerate(idx.tolist()):
        want = x[i].double() @ a[s].double().T @ b[s].double().T * float(scales[s]) if 0 <= s < slots \
            else torch.zeros(n, dtype=torch.float64)
        torch.testing.assert_close(y[i].double(), want, rtol=1e-5, atol=1e-5)


def test_fallback_to_the_reference_for_other_layouts():
    """int32 indices, A's or B's rows not contiguous: the reference runs (same values); bad shapes are
    named."""
    torch.manual_seed(6)
    x, a = torch.randn(3, 40), torch.randn(2, 40, 8).transpose(1, 2)  # a [2, 8, 40], columns 8 apart
    idx = torch.tensor([1, -1, 0], dtype=torch.int32)
    torch.testing.assert_close(lora_shrink(x, a, idx), lora_shrink_ref(x, a, idx))
    y, buf, b = torch.randn(3, 6), torch.randn(3, 8), torch.randn(2, 8, 6).transpose(1, 2)
    torch.testing.assert_close(lora_expand_(y.clone(), buf, b, idx.long(), torch.ones(2)),
                               lora_expand_ref(y.clone(), buf, b, idx.long(), torch.ones(2)))
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(x, a[:, :, :39], idx)
    with pytest.raises(ValueError, match="lora_expand_"):
        lora_expand_(torch.zeros(3, 5), torch.zeros(3, 8), torch.zeros(2, 6, 8), idx, torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_graph_replay(isa, dtype):
    """Recorded shrink + expand replay on the step's new inputs (indices rewritten in place), alone
    and as one team region on two threads (the K split's shared partial sums)."""
    t, k, r, n, slots = 4, 600 if SMALL else 1100, 8, 70, 3
    torch.manual_seed(7)
    x = torch.empty(t, k, dtype=dtype)
    a = (torch.randn(slots, r, k) / k ** 0.5).to(dtype)
    b = torch.randn(slots, n, r).to(dtype)
    scales = torch.tensor([1.0, 0.5, 2.0])
    idx = torch.empty(t, dtype=torch.int64)
    y = torch.empty(t, n, dtype=dtype)

    def step(seed: int, rec) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(t, k, generator=g))
        y.copy_(torch.randn(t, n, generator=g))
        idx.copy_(torch.randint(-1, slots, (t,), generator=g))
        want = lora_expand_ref(y.clone(), lora_shrink_ref(x, a, idx), b, idx, scales)
        kernels.capture.run_graph(rec)
        atol, rtol = EXPAND_TOL[dtype]
        torch.testing.assert_close(y.float(), want.float(), atol=atol, rtol=rtol)
        return y.clone()

    x.zero_()
    y.zero_()
    idx.fill_(0)
    with kernels.capture.recording() as rec:
        lora_expand_(y, lora_shrink(x, a, idx), b, idx, scales)
    assert not rec.errors and len(rec.calls) == 2
    teams = kernels.capture.graph_team_replays()
    one, two = on_one_and_two_threads(lambda: [step(s, rec) for s in (1, 2)])
    assert kernels.capture.graph_team_replays() - teams == 2  # the two-thread replays ran as one region
    for u, v in zip(one, two):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
