"""The dense bf16 GEMM on prepacked weights (csrc/dense_gemm.h) against PyTorch, for every ISA
variant this CPU runs, with and without the CPU's bf16 dot instruction, and on AMX tiles where
the CPU has AMX-BF16: all row counts the register tiles split differently, odd N and K (padding
tails), column-range output, float32 output, and the packing itself.
"""

from __future__ import annotations

import os

import pytest
import torch

from armserve import kernels
from armserve.kernels.reference import gemm_bf16_ref, gemm_f32_ref, unpack_bf16_ref, unpack_f32_ref
from conftest import on_one_and_two_threads

SMALL = os.environ.get("ARMSERVE_TEST_SMALL") == "1"
ROWS = [1, 2, 3, 5, 8, 17, 33, 64, 130] if not SMALL else [1, 3, 8, 17]
# (n, k): odd and even, partial 16-column blocks, an odd K (half a k-pair of padding), K not a
# multiple of 4 pairs (NEON BFDOT tail), several column panels.
SHAPES = [(37, 19), (100, 77), (129, 256), (16, 2)] if not SMALL else [(37, 19), (100, 77)]


def has_dot() -> bool:
    f = kernels.cpu_features()
    return "avx512_bf16" in f or "bf16" in f


def dot_modes() -> list[str]:
    """widen: no bf16 dot instruction; dot: with it (AMX off); amx: AMX tiles from 3 rows, the
    dot instruction below (only where the CPU has AMX-BF16: elsewhere there is nothing to run)."""
    return ["widen"] + (["dot"] if has_dot() else []) + (["amx"] if kernels.amx_available() else [])


def expected_variant(isa: str, dot: bool, amx: bool = False) -> str:
    if isa == "avx512" and dot and amx:
        return "amx_bf16"
    if isa in ("avx512", "neon", "sve") and dot:
        return {"avx512": "avx512_bf16", "neon": "neon_bf16", "sve": "sve_bf16"}[isa]
    return isa


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Error allowed for an fp32 sum of k bf16 products in any order (and ARM BFDOT's own rounding
    of each pair): a few fp32 ulps per term, relative to the sum of the terms' magnitudes."""
    k = x.shape[1]
    return 2.0 ** -21 * k ** 0.5 * (x.double().abs() @ w.double().abs().t()) + 1e-30


@pytest.fixture(params=dot_modes())
def dot(request):
    """Sets up the mode ("widen", "dot", "amx") and yields it: the bf16-dot switch on in "dot" and
    "amx", AMX on in "amx" only."""
    before = kernels.set_bf16_dot(request.param != "widen")
    amx_before = kernels.set_amx(False) if kernels.amx_available() else None
    if request.param == "amx":
        kernels.set_amx(True)
    yield request.param
    kernels.set_bf16_dot(before)
    if amx_before is not None:
        kernels.set_amx(amx_before)



def test_pack_round_trip():
    torch.manual_seed(0)
    for n, k in SHAPES + [(1, 1), (17, 33)]:
        w = torch.randn(n, k).bfloat16()
        p = kernels.pack_bf16(w)
        assert p.shape == kernels.packed_bf16_shape(n, k) == (-(-n // 16), -(-k // 2), 16, 2)
        assert torch.equal(unpack_bf16_ref(p, n, k), w)
        # the padding is zeros
        full = p.permute(0, 2, 1, 3).reshape(p.shape[0] * 16, p.shape[1] * 2)
        assert not full[n:].any() and not full[:, k:].any()


def test_gemm_matches_reference(isa, dot):
    dot_on = kernels.bf16_dot()
    assert kernels.dense_isa() == expected_variant(isa, dot != "widen" and dot_on, dot == "amx" and dot_on)
    torch.manual_seed(1)
    for n, k in SHAPES:
        w = torch.randn(n, k).bfloat16()
        p = kernels.pack_bf16(w)
        for m in ROWS:
            x = torch.randn(m, k).bfloat16()
            exact = x.double() @ w.double().t()
            tol = bound(x, w)
            y32 = kernels.gemm_bf16(x, p, n, k, out_dtype=torch.float32)
            assert y32.dtype == torch.float32
            err = (y32.double() - exact).abs()
            assert (err <= tol).all(), (m, n, k, (err / tol).max().item())
            y16 = kernels.gemm_bf16(x, p, n, k)
            assert y16.dtype == torch.bfloat16
            # one bf16 rounding of (nearly) the exact sum
            err = (y16.double() - exact).abs()
            assert (err <= 2.0 ** -8 * exact.abs() + tol).all(), (m, n, k)
            # and it is the bf16 rounding of the float32 result wherever that is not a tie
            same = y16 == y32.bfloat16()
            assert same.float().mean() > 0.99 or m * n < 100, (m, n, k)
    # the PyTorch reference wrapper agrees too
    x = torch.randn(5, 77).bfloat16()
    w = torch.randn(100, 77).bfloat16()
    p = kernels.pack_bf16(w)
    torch.testing.assert_close(kernels.gemm_bf16(x, p, 100, 77).float(), gemm_bf16_ref(x, p, 100, 77).float(),
                               atol=2e-2, rtol=1e-2)


def test_column_range_output(isa, dot):
    """out may be a column range of a wider tensor (fused projections): only it is written."""
    torch.manual_seed(2)
    n, k, wide, col = 37, 77, 100, 21
    w = torch.randn(n, k).bfloat16()
    p = kernels.pack_bf16(w)
    for m in (1, 7, 33):
        x = torch.randn(m, k).bfloat16()
        for dtype in (torch.bfloat16, torch.float32):
            fused = torch.full((m, wide), 7.0, dtype=dtype)
            kernels.gemm_bf16(x, p, n, k, out=fused[:, col:col + n])
            assert torch.equal(fused[:, col:col + n], kernels.gemm_bf16(x, p, n, k, out_dtype=dtype))
            assert (fused[:, :col] == 7).all() and (fused[:, col + n:] == 7).all()


def test_weights_over_several_groups(isa, dot):
    """Prefill-sized calls whose weights are wider than one ~1 MiB group of panels (AMX past
    kBlocksMinRows = 512 rows: every row across a group before the next; else panel by panel): a
    partial last group, a partial 16-column block, rows that end inside a tile, into a column range
    of a wider output, on one thread and two."""
    torch.manual_seed(7)
    n, k, col = (2100, 512, 3) if not SMALL else (1100, 512, 3)
    for m in [70 if not SMALL else 40] + ([530] if kernels.dense_isa() == "amx_bf16" else []):
        check_over_groups(n, k, m, col)


def check_over_groups(n: int, k: int, m: int, col: int) -> None:
    w = torch.randn(n, k).bfloat16()
    p = kernels.pack_bf16(w)
    x = torch.randn(m, k).bfloat16()
    exact = x.double() @ w.double().t()

    def run(dtype):
        out = torch.full((m, n + 2 * col), 7.0, dtype=dtype)
        kernels.gemm_bf16(x, p, n, k, out=out[:, col:col + n])
        return out

    for dtype in (torch.float32, torch.bfloat16):
        one, two = on_one_and_two_threads(lambda: run(dtype))
        assert torch.equal(one, two), dtype
        assert (one[:, :col] == 7).all() and (one[:, col + n:] == 7).all(), "wrote outside its columns"
        err = (one[:, col:col + n].double() - exact).abs()
        rounding = 0 if dtype == torch.float32 else 2.0 ** -8 * exact.abs()
        assert (err <= rounding + bound(x, w)).all(), dtype


def test_special_values(isa, dot):
    """NaN propagates (rounded to bf16 as PyTorch: 0x7fc0), large values round, zeros stay zero."""
    n, k = 20, 6
    w = torch.ones(n, k).bfloat16()
    p = kernels.pack_bf16(w)
    x = torch.zeros(3, k).bfloat16()
    x[1, 2] = float("nan")
    x[2] = 3.0e38
    y = kernels.gemm_bf16(x, p, n, k)
    assert (y[0] == 0).all()
    assert torch.isnan(y[1]).all() and (y[1].view(torch.int16) == 0x7FC0).all()
    assert torch.isinf(y[2]).all()  # 6 x 3e38 overflows float32


def assert_replays(call, out: torch.Tensor) -> None:
    """call(out) recorded (csrc/graph.cpp) without errors, and its replay rewrites the same out."""
    with kernels.capture.recording() as rec:
        call(out)
    assert not rec.errors
    want = out.clone()
    out.zero_()
    kernels.capture.run_graph(rec)
    assert torch.equal(out, want)


def test_gemm_is_recordable():
    """A recorded step replays the GEMM (csrc/graph.cpp)."""
    torch.manual_seed(3)
    n, k, m = 50, 64, 3
    w = torch.randn(n, k).bfloat16()
    p = kernels.pack_bf16(w)
    x = torch.randn(m, k).bfloat16()
    assert_replays(lambda out: kernels.gemm_bf16(x, p, n, k, out=out), torch.empty(m, n, dtype=torch.float32))


def test_amx_switch(isa):
    """AMX tiles serve the avx512 variant with the bf16 dot instruction where the CPU has AMX-BF16;
    asking for them elsewhere is a clear error, and switching them off falls back to the dot tiles."""
    before = kernels.set_amx(False) if kernels.amx_available() else None
    try:
        if before is None:
            with pytest.raises(kernels.KernelError, match="AMX-BF16 is not available"):
                kernels.set_amx(True)
            assert kernels.dense_isa() != "amx_bf16"
            return
        assert kernels.dense_isa() == expected_variant(isa, kernels.bf16_dot())
        kernels.set_amx(True)
        assert kernels.dense_isa() == expected_variant(isa, kernels.bf16_dot(), True)
        dot = kernels.set_bf16_dot(False)
        assert kernels.dense_isa() == expected_variant(isa, False, True)  # AMX only with the dot tiles' activations
        kernels.set_bf16_dot(dot)
    finally:
        if before is not None:
            kernels.set_amx(before)


def test_gemm_same_on_two_threads(isa, dot):
    """Threads split the columns, so each output is the same sum on one thread or two (AMX: each
    thread loads its own tile configuration)."""
    torch.manual_seed(5)
    n, k = 200, 96
    w = torch.randn(n, k).bfloat16()
    p = kernels.pack_bf16(w)
    for m in ((3, 40, 130) if not SMALL else (3, 17)):
        x = torch.randn(m, k).bfloat16()
        one, two = on_one_and_two_threads(lambda: kernels.gemm_bf16(x, p, n, k, out_dtype=torch.float32))
        assert torch.equal(one, two), m
        exact = x.double() @ w.double().t()
        assert ((one.double() - exact).abs() <= bound(x, w)).all(), m


# ---- float32 weights: the same driver and tiles on the float32 layout ---------------------------


def bound_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Error allowed for a float32 sum of k float32 products by fused multiply-adds in any order:
    k roundings of at most an ulp of the running sum (gamma_k), against the terms' magnitudes."""
    k = x.shape[1]
    return 2.0 ** -23 * k * (x.double().abs() @ w.double().abs().t()) + 1e-30


def test_pack_f32_round_trip():
    torch.manual_seed(0)
    for n, k in SHAPES + [(1, 1), (17, 33)]:
        w = torch.randn(n, k)
        p = kernels.pack_f32(w)
        assert p.shape == kernels.packed_f32_shape(n, k) == (-(-n // 16), -(-k // 2), 2, 16)
        assert torch.equal(unpack_f32_ref(p, n, k), w)
        # layout: block b, pair p, then k parity, then the 16 columns; the padding is zeros
        assert p[0, 0, 1, 0] == w[0, 1] if k > 1 else p[0, 0, 1, 0] == 0
        full = p.permute(0, 3, 1, 2).reshape(p.shape[0] * 16, p.shape[1] * 2)
        assert not full[n:].any() and not full[:, k:].any()


def test_gemm_f32_matches_reference(isa):
    """Every row count the tiles split differently (1-row streams, full and partial tiles, several
    row tiles per panel), odd N and K, float32 and bf16 output, the PyTorch reference wrapper."""
    assert kernels.dense_f32_isa() == isa
    torch.manual_seed(1)
    for n, k in SHAPES:
        w = torch.randn(n, k)
        p = kernels.pack_f32(w)
        for m in ROWS:
            x = torch.randn(m, k)
            exact = x.double() @ w.double().t()
            tol = bound_f32(x, w)
            y = kernels.gemm_f32(x, p, n, k)
            assert y.dtype == torch.float32
            err = (y.double() - exact).abs()
            assert (err <= tol).all(), (m, n, k, (err / tol).max().item())
            y16 = kernels.gemm_f32(x, p, n, k, out_dtype=torch.bfloat16)
            assert ((y16.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + tol).all(), (m, n, k)
    x, w = torch.randn(5, 77), torch.randn(100, 77)
    p = kernels.pack_f32(w)
    torch.testing.assert_close(kernels.gemm_f32(x, p, 100, 77), gemm_f32_ref(x, p, 100, 77), atol=1e-4, rtol=1e-5)


def test_gemm_f32_column_range_threads_and_recording(isa):
    """Into a column range of a wider tensor (only it written), the same sums on one thread or two,
    and replayed from a recording (a float32 decode step stays kernel calls)."""
    torch.manual_seed(2)
    n, k, wide, col = 200, 96, 230, 21
    w = torch.randn(n, k)
    p = kernels.pack_f32(w)
    for m in ((1, 7, 40, 130) if not SMALL else (1, 17)):
        x = torch.randn(m, k)

        def run():
            fused = torch.full((m, wide), 7.0)
            kernels.gemm_f32(x, p, n, k, out=fused[:, col:col + n])
            return fused

        one, two = on_one_and_two_threads(run)
        assert torch.equal(one, two), m
        assert (one[:, :col] == 7).all() and (one[:, col + n:] == 7).all(), "wrote outside its columns"
        exact = x.double() @ w.double().t()
        assert ((one[:, col:col + n].double() - exact).abs() <= bound_f32(x, w)).all(), m
    x = torch.randn(3, k)
    assert_replays(lambda out: kernels.gemm_f32(x, p, n, k, out=out), torch.empty(3, n))


def test_rows_over_several_chunks(isa):
    """More rows than a 256 KiB chunk of activations holds (K = 1536: a few tens of rows a chunk,
    dense_gemm_impl.h row_chunk), each chunk across every panel before the next, a partial last
    chunk, into a column range of a wider output; float32 and bf16 weights, one thread and two."""
    torch.manual_seed(8)
    n, k, m, col = 100, 1536, 130, 5
    for f32 in (True, False):
        dtype = torch.float32 if f32 else torch.bfloat16
        w, x = torch.randn(n, k).to(dtype), torch.randn(m, k).to(dtype)
        pack, gemm = (kernels.pack_f32, kernels.gemm_f32) if f32 else (kernels.pack_bf16, kernels.gemm_bf16)
        p = pack(w)

        def run():
            out = torch.full((m, n + 2 * col), 7.0)
            gemm(x, p, n, k, out=out[:, col:col + n])
            return out

        one, two = on_one_and_two_threads(run)
        assert torch.equal(one, two), dtype
        assert (one[:, :col] == 7).all() and (one[:, col + n:] == 7).all(), "wrote outside its columns"
        exact = x.double() @ w.double().t()
        tol = bound_f32(x, w) if f32 else bound(x, w)
        assert ((one[:, col:col + n].double() - exact).abs() <= tol).all(), dtype


@pytest.mark.parametrize("dtype,mode", [(torch.float32, "widen"), (torch.bfloat16, "widen")]
                         + ([(torch.bfloat16, "dot")] if has_dot() else []))
def test_a_row_gets_the_same_bits_whatever_rows_share_the_call(isa, dtype, mode):
    """Row i of an m-row product equals that row computed alone, bit for bit, for every row count
    the tiles split differently: a speculative verify step (several rows of one sequence) must
    give each position the logits a decode step gives it, or greedy decoding with speculation
    parts from greedy decoding without it at the first near-tie. (AMX tiles, for prefill rows
    on CPUs with AMX-BF16, are not held to this.)"""
    before = kernels.set_bf16_dot(mode == "dot")
    amx_before = kernels.set_amx(False) if kernels.amx_available() else None
    try:
        torch.manual_seed(3)
        pack = kernels.pack_f32 if dtype == torch.float32 else kernels.pack_bf16
        for n, k in SHAPES:
            w = torch.randn(n, k).to(dtype)
            p = pack(w)
            x = torch.randn(max(ROWS), k).to(dtype)
            alone = torch.cat([kernels.dense(x[i:i + 1], p, n, k) for i in range(max(ROWS))])
            for m in ROWS:
                together = kernels.dense(x[:m], p, n, k)
                assert torch.equal(together, alone[:m]), (m, n, k)
    finally:
        kernels.set_bf16_dot(before)
        if amx_before is not None:
            kernels.set_amx(amx_before)
