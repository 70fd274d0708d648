"""Every C++ kernel against its PyTorch reference, for every ISA variant this CPU can run,
over random shapes and the float32 / bfloat16 / float16 dtypes.

Also run under QEMU for aarch64 (scripts/ci_arm64.sh) with ARMSERVE_TEST_SMALL=1 (smaller shapes:
emulated SVE is ~1000x slower than native).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import kernel_isas, on_one_and_two_threads, random_batch

from armserve import kernels
from armserve.kernels.reference import (
    act_and_mul_ref, encoder_attention_ref, paged_attention_ref, quantize_kv_ref, rms_norm_ref, rotary_ref,
)
from armserve.layers.attention import cache_from_rows, cache_rows, kv_cache_shapes
from armserve.layers.rotary_embedding import RotaryEmbedding

SMALL = os.environ.get("ARMSERVE_TEST_SMALL") == "1"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tolerances per dtype: the kernels round exactly where PyTorch rounds, so differences are
# float32 reassociation (sums in another order) propagated through one final rounding.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def test_isa_selection_and_features():
    names = kernel_isas()
    assert "scalar" in names
    assert kernels.isa() in names
    with pytest.raises(kernels.KernelError, match="unknown ISA"):
        kernels.select_isa("mmx")
    feats = kernels.cpu_features()
    if os.uname().machine == "x86_64":
        assert ("avx512" in names) == ("avx512" in feats)
        assert ("avx2" in names) == ("avx2" in feats and "fma" in feats)
    # One thread pool: the kernels' OpenMP calls bind to the runtime PyTorch loaded (another
    # package may map its own private copy, e.g. sentencepiece; it is never used for our threads).
    bound = kernels.openmp_library()
    assert bound in kernels.openmp_runtimes(), (bound, kernels.openmp_runtimes())
    torch_dir = os.path.dirname(os.path.dirname(torch.__file__))
    assert bound.startswith(torch_dir) and ("/torch/" in bound or "/torch.libs/" in bound), bound


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 576, 1000] if not SMALL else [64, 100])
def test_rms_norm(isa, dtype, dim):
    torch.manual_seed(dim)
    rows = 7
    x = torch.randn(rows, dim).to(dtype)
    w = (torch.rand(dim) + 0.5).to(dtype)
    res = torch.randn(rows, dim).to(dtype)
    for offset in (0.0, 1.0):
        want = rms_norm_ref(x, w, 1e-6, None, offset)[0]
        close(kernels.rms_norm(x, w, 1e-6, None, offset), want, dtype)
        want_out, want_res = rms_norm_ref(x, w, 1e-6, res, offset)
        r = res.clone()
        got, _ = kernels.rms_norm(x, w, 1e-6, r, offset)
        close(got, want_out, dtype)
        torch.testing.assert_close(r, want_res)  # the residual sum is rounded exactly like PyTorch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rms_norm_heads_in_place(isa, dtype, head_dim):
    """Per-head norms (Qwen3 / Gemma 3 q and k) in place on the heads inside a fused qkv output:
    each head normalised on its own, nothing else in the row touched."""
    torch.manual_seed(head_dim)
    T, heads, other = 5, 3, 24
    qkv = torch.randn(T, heads * head_dim + other).to(dtype)
    before = qkv.clone()
    w = (torch.rand(head_dim) + 0.5).to(dtype)
    for offset in (0.0, 1.0):
        x = qkv[:, :heads * head_dim].view(T, heads, head_dim)
        want = rms_norm_ref(before[:, :heads * head_dim].view(T, heads, head_dim), w, 1e-6, None, offset)[0]
        kernels.rms_norm_heads_(x, w, 1e-6, offset)
        close(x, want, dtype)
        assert torch.equal(qkv[:, heads * head_dim:], before[:, heads * head_dim:])
        qkv.copy_(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul(isa, dtype, act):
    torch.manual_seed(1)
    for d in ([64, 1536, 77] if not SMALL else [64, 21]):
        x = (torch.randn(5, 2 * d) * 3).to(dtype)
        close(kernels.act_and_mul(x, act), act_and_mul_ref(x, act), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_rotary(isa, dtype, neox):
    torch.manual_seed(2)
    head_dim = 64
    for rot_dim, params in [
        (64, {"rope_type": "default", "rope_theta": 10000.0}),
        (32, {"rope_type": "default", "rope_theta": 10000.0}),  # partial rotary
        (64, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ]:
        rope = RotaryEmbedding(head_dim, 512, params, rotary_dim=rot_dim, is_neox_style=neox)
        T, nq, nk = 9, 4, 2
        qkv = torch.randn(T, (nq + 2 * nk) * head_dim).to(dtype)
        pos = torch.tensor(random.Random(3).sample(range(512), T), dtype=torch.long)
        q, k, _ = qkv.split([nq * head_dim, nk * head_dim, nk * head_dim], dim=-1)
        want_q, want_k = rotary_ref(pos, q, k, rope.cos_sin, head_dim, rot_dim, neox)
        kernels.rotary(pos, q, k, rope.cos_sin, head_dim, rot_dim, neox)  # in place on the qkv views
        close(q, want_q, dtype)
        close(k, want_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(isa, dtype):
    torch.manual_seed(4)
    T, hk, hd, bs = 6, 2, 24, 32  # head_dim not a multiple of 16: the cache write takes any
    kv = torch.randn(T, 3 * hk * hd).to(dtype)  # k and v as strided views of a wider row
    k, v = kv[:, hk * hd: 2 * hk * hd], kv[:, 2 * hk * hd:]
    k_shape, v_shape, _ = kv_cache_shapes(2, bs, hk, hd, dtype)
    kc = torch.zeros(k_shape, dtype=dtype)
    vc = torch.zeros(v_shape, dtype=dtype)
    slots = torch.tensor([3, 17, 0, 63, 40, 41])
    kernels.reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(cache_rows(kc, slots, key=True).reshape(T, -1), k)
    assert torch.equal(cache_rows(vc, slots, key=False).reshape(T, -1), v)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    rest = torch.arange(64)[untouched]
    assert cache_rows(kc, rest, key=True).abs().sum() == 0 and cache_rows(vc, rest, key=False).abs().sum() == 0


ATTN_CASES = [
    # (head_dim, num_heads, num_kv_heads, [(q_len, context_len), ...], sliding_window, softcap)
    (64, 4, 4, [(1, 1), (1, 37), (1, 300)], None, None),  # decode, MHA, split over the KV length
    (64, 9, 3, [(5, 5), (1, 20), (7, 40)], None, None),  # mixed prefill chunks with cached prefix, GQA
    (128, 8, 1, [(16, 16), (3, 70), (1, 513)], None, None),  # MQA
    (256, 4, 2, [(9, 9), (1, 33)], None, None),
    (64, 4, 2, [(12, 12), (1, 50), (6, 30)], 8, None),  # sliding window
    (64, 4, 2, [(4, 10), (1, 18)], None, 30.0),  # Gemma-2 soft-capping
    (64, 6, 2, [(40, 300), (17, 17)], None, None),  # prefill tiles over partitions (AMX where there is AMX)
    (64, 6, 2, [(67, 601), (33, 33)], None, None),  # 32-query AMX tiles, odd last keys
    (64, 4, 2, [(50, 400)], 100, None),  # a window starting mid-tile under AMX prefill tiles
]
if SMALL:
    ATTN_CASES = [
        (64, 4, 2, [(1, 9), (3, 20)], None, None),
        (128, 4, 1, [(1, 40)], None, None),
        (64, 2, 2, [(5, 12)], 4, 20.0),
    ]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_paged_attention(isa, dtype, case, block_size):
    """Against the PyTorch reference. Blocks of 32 let AMX read 32-key value tiles in place (where
    the random block table puts two neighbours' tiles together), blocks of 16 never."""
    hd, hq, hk, specs, window, softcap = ATTN_CASES[case]
    rng = random.Random(case)
    torch.manual_seed(case)
    num_blocks = 80 * 16 // block_size
    q_start, q_len, ctx, tables, T = random_batch(rng, block_size, num_blocks, specs)
    k_cache = torch.randn(num_blocks * block_size, hk, hd).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, hk, hd).to(dtype)
    # Slots past each context hold garbage (the cache is torch.empty): NaN must not leak in.
    for t, c in zip(tables, ctx):
        tail = t[-1] * block_size + torch.arange(c % block_size or block_size, block_size)
        k_cache[tail] = float("nan")
        v_cache[tail] = float("nan")
    kc, vc = cache_from_rows(k_cache, block_size, key=True), cache_from_rows(v_cache, block_size, key=False)
    qkv = torch.randn(T, (hq + 2 * hk) * hd).to(dtype)
    q = qkv[:, : hq * hd]  # a strided view, as in the model
    scale = hd**-0.5
    want = paged_attention_ref(q, k_cache, v_cache, q_start, q_len, ctx, tables, block_size, hq, hk, hd, scale,
                               window, softcap)
    batch, keep = _attn_batch(q_start, q_len, ctx, tables, block_size)
    got = kernels.paged_attention(q, kc, vc, batch, hq, hk, hd, scale, window, softcap)
    close(got, want, dtype)
    if dtype == torch.bfloat16 and kernels.bf16_dot():  # bf16 pairs also without the dot instruction
        before = kernels.set_bf16_dot(False)
        try:
            close(kernels.paged_attention(q, kc, vc, batch, hq, hk, hd, scale, window, softcap), want, dtype)
        finally:
            kernels.set_bf16_dot(before)
        if kernels.amx_available():  # prefill rows on the dot instruction rather than AMX tiles
            before = kernels.set_amx(False)
            try:
                close(kernels.paged_attention(q, kc, vc, batch, hq, hk, hd, scale, window, softcap), want, dtype)
            finally:
                kernels.set_amx(before)


def _attn_batch(q_start, q_len, ctx, tables, block_size: int):
    """The kernel's batch description of a random_batch step, and the int32 tensors it points
    into (keep them alive while the batch is used)."""
    bt = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    keep = (i32(q_start), i32(q_len), i32(ctx), bt)
    return kernels.make_attn_batch(*keep, block_size), keep


VERIFY_CASES = [(4, 4, [2, 5]), (9, 3, [3, 5, 13]), (14, 2, [2, 5, 13])]  # (hq, hk, query rows)
if SMALL:
    VERIFY_CASES = [(9, 3, [5]), (14, 2, [3])]


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("case", range(len(VERIFY_CASES)))
def test_paged_attention_verify_rows_equal_decode_rows(isa, cache, case):
    """A speculative verify step's query rows (one sequence, several positions at once) give the
    same bits as each position decoded alone, as greedy decoding with and without speculation
    must: a row's sums may not depend on which rows share its block, or on how many keys the
    step's later rows add to its last tiles."""
    hq, hk, row_counts = VERIFY_CASES[case]
    hd, bs = 64, 16
    torch.manual_seed(case)
    dtype = torch.float32 if cache in ("float32", "int8") else getattr(torch, cache)
    contexts = [40, 137, 300] if not SMALL else [37]
    for ctx in contexts:
        nb = (ctx + bs - 1) // bs + 1
        table = torch.randperm(nb).tolist()
        k_rows, v_rows = torch.randn(nb * bs, hk, hd) * 3, torch.randn(nb * bs, hk, hd)
        if cache == "int8":
            (kq, ks), (vq, vs) = quantize_kv_ref(k_rows), quantize_kv_ref(v_rows)
            layout = [cache_from_rows(x, bs, key=key) for x, key in ((kq, True), (vq, False), (ks, None), (vs, None))]
        else:
            layout = [cache_from_rows(k_rows.to(dtype), bs, key=True), cache_from_rows(v_rows.to(dtype), bs, key=False)]

        def attend(q, q_len, context):
            batch, keep = _attn_batch([0], [q_len], [context], [table], bs)
            if cache == "int8":
                return kernels.paged_attention_i8(q, *layout, batch, hq, hk, hd, hd**-0.5)
            return kernels.paged_attention(q, *layout, batch, hq, hk, hd, hd**-0.5)

        for rows in row_counts:
            q = (torch.randn(rows, (hq + 2 * hk) * hd) * 2).to(dtype)[:, : hq * hd]
            verify = attend(q, rows, ctx)
            decode = torch.cat([attend(q[i:i + 1], 1, ctx - rows + 1 + i) for i in range(rows)])
            assert torch.equal(verify, decode), (ctx, rows, (verify.float() - decode.float()).abs().max().item())


@pytest.mark.parametrize("boost", [3.0, 40.0])
def test_paged_attention_prefill_later_keys_dominate(isa, boost):
    """A prefill row's later partitions hold far larger scores than its first: the exponentials
    past the first partition are taken against the earlier max (AMX), so they exceed 1, by up
    to 2^100 (boost 3) or overflow (boost 40: the row is redone against its own max)."""
    torch.manual_seed(11)
    hd, hq, hk, block_size = 64, 6, 2, 32
    rng = random.Random(11)
    specs = [(64, 600)] if not SMALL else [(20, 300)]
    q_start, q_len, ctx, tables, T = random_batch(rng, block_size, 40, specs)
    k_cache = torch.randn(40 * block_size, hk, hd)
    v_cache = torch.randn(40 * block_size, hk, hd)
    later = torch.tensor([t for blk in tables[0] for t in range(blk * block_size, (blk + 1) * block_size)])
    later = later[300:]  # positions 300+ of the sequence: partitions past the first
    k_cache[later] *= boost
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    kc, vc = cache_from_rows(k_cache, block_size, key=True), cache_from_rows(v_cache, block_size, key=False)
    q = torch.randn(T, hq * hd).bfloat16()
    batch, keep = _attn_batch(q_start, q_len, ctx, tables, block_size)
    want = paged_attention_ref(q, k_cache, v_cache, q_start, q_len, ctx, tables, block_size, hq, hk, hd, hd**-0.5)
    one, two = on_one_and_two_threads(lambda: kernels.paged_attention(q, kc, vc, batch, hq, hk, hd, hd**-0.5))
    assert torch.isfinite(one.float()).all()
    close(one, want, torch.bfloat16)
    close(two, want, torch.bfloat16)


def test_paged_attention_prefill_same_on_two_threads(isa):
    """A prefill chunk over several partitions (AMX tiles where the CPU has them: each thread loads
    its own tile configuration) gives the same bits on two threads as on one, and the reference's
    result."""
    torch.manual_seed(10)
    hd, hq, hk, block_size = 64, 6, 2, 16
    rng = random.Random(10)
    specs = [(48, 300), (20, 20)] if not SMALL else [(20, 40)]  # (emulated aarch64: a smaller chunk)
    q_start, q_len, ctx, tables, T = random_batch(rng, block_size, 60, specs)
    k_cache = torch.randn(60 * block_size, hk, hd).bfloat16()
    v_cache = torch.randn(60 * block_size, hk, hd).bfloat16()
    kc, vc = cache_from_rows(k_cache, block_size, key=True), cache_from_rows(v_cache, block_size, key=False)
    q = torch.randn(T, hq * hd).bfloat16()
    batch, keep = _attn_batch(q_start, q_len, ctx, tables, block_size)
    one, two = on_one_and_two_threads(lambda: kernels.paged_attention(q, kc, vc, batch, hq, hk, hd, hd**-0.5))
    assert torch.equal(one, two)
    want = paged_attention_ref(q, k_cache, v_cache, q_start, q_len, ctx, tables, block_size, hq, hk, hd, hd**-0.5)
    close(one, want, torch.bfloat16)


def test_paged_attention_threads_split_long_decode(isa):
    """One long sequence on every thread (KV split) gives the same result as one thread."""
    torch.manual_seed(9)
    hd, hq, hk, block_size = 64, 4, 2, 16
    ctx = 700 if not SMALL else 100
    tables = [list(range(-(-ctx // block_size)))]
    k_cache = torch.randn(len(tables[0]) * block_size, hk, hd)
    v_cache = torch.randn(len(tables[0]) * block_size, hk, hd)
    q = torch.randn(1, hq * hd)
    kc, vc = cache_from_rows(k_cache, block_size, key=True), cache_from_rows(v_cache, block_size, key=False)
    keep = (torch.tensor([0], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([ctx], dtype=torch.int32), torch.tensor(tables, dtype=torch.int32))
    batch = kernels.make_attn_batch(*keep, block_size)
    one, two = on_one_and_two_threads(lambda: kernels.paged_attention(q, kc, vc, batch, hq, hk, hd, hd**-0.5))
    want = paged_attention_ref(q, k_cache, v_cache, [0], [1], [ctx], tables, block_size, hq, hk, hd, hd**-0.5)
    close(two, want, torch.float32)
    close(one, want, torch.float32)
    assert torch.equal(one, two)  # the KV split changes the schedule, never the arithmetic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("n", [384, 100])
def test_bias_gelu(isa, dtype, approximate, n):
    """gelu(x + bias) in place on rows of a wider tensor, against PyTorch's add then F.gelu, over
    both tails (large negative inputs: values near 0, no cancellation)."""
    torch.manual_seed(n)
    wide = (torch.randn(9, n + 5) * 4).to(dtype)
    x, bias = wide[:, :n], (torch.randn(n) * 0.5).to(dtype)
    want = F.gelu(x + bias, approximate=approximate)
    got = kernels.bias_gelu_(x, bias, approximate)
    assert got.data_ptr() == wide.data_ptr()
    close(got, want, dtype)
    small = want.float().abs() < 1e-3  # the far negative side, relative to its own size
    rtol = 0.02 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(got.float()[small], want.float()[small], atol=1e-6, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", ["x", "residual", "bias_and_residual"])
@pytest.mark.parametrize("n", [384, 100])
def test_layer_norm(isa, dtype, parts, n):
    """LayerNorm(x + x_bias + residual) * w + b against F.layer_norm over PyTorch's adds."""
    torch.manual_seed(n)
    x = (torch.randn(7, n) * 2 + 1).to(dtype)
    w, b = (torch.rand(n) + 0.5).to(dtype), (torch.randn(n) * 0.1).to(dtype)
    res = torch.randn(7, n).to(dtype) if parts != "x" else None
    xb = torch.randn(n).to(dtype) if parts == "bias_and_residual" else None
    want = x if xb is None else x + xb
    want = want if res is None else want + res
    want = F.layer_norm(want, (n,), w, b, 1e-12)
    close(kernels.layer_norm(x, w, b, 1e-12, residual=res, x_bias=xb), want, dtype)


def _encoder_qkv(seq_lens: list[int], heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A random qkv step as a row-strided view (the model's fused projection may be wider)."""
    wide = torch.randn(sum(seq_lens), 3 * heads * head_dim + 8)
    return wide.to(dtype)[:, 4 : 4 + 3 * heads * head_dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 48])  # 48: the value step's one-chunk path
@pytest.mark.parametrize("with_bias", [False, True])
def test_encoder_attention(isa, dtype, head_dim, with_bias):
    """Bidirectional attention of sequences of every edge length (one key, a whole tile, one past
    it, several key blocks), with or without the projection's bias added as the rows are read,
    against one torch SDPA per sequence; each sequence gives the same bits alone as in the batch."""
    torch.manual_seed(head_dim)
    lens = [1, 16, 17, 40, 300] if not SMALL else [1, 17, 40]
    H = 3
    qkv = _encoder_qkv(lens, H, head_dim, dtype)
    bias = torch.randn(3 * H * head_dim).to(dtype) if with_bias else None
    sl = torch.tensor(lens, dtype=torch.int32)
    got = kernels.encoder_attention(qkv, sl, H, head_dim, head_dim**-0.5, bias)
    close(got, encoder_attention_ref(qkv, lens, H, head_dim, head_dim**-0.5, bias), dtype)
    rows = slice(lens[0], lens[0] + lens[1])  # the second sequence
    alone = kernels.encoder_attention(qkv[rows], torch.tensor(lens[1:2], dtype=torch.int32), H, head_dim,
                                      head_dim**-0.5, bias)
    assert torch.equal(alone, got[rows])


def test_encoder_attention_later_keys_dominate_and_threads(isa):
    """Keys of a later key block with far larger scores (the online softmax rescales what came
    before, no overflow), on one thread and on two: the same bits, the reference's result."""
    torch.manual_seed(5)
    lens = [600, 20] if not SMALL else [80]
    H, D = 2, 32
    qkv = torch.randn(sum(lens), 3 * H * D)
    qkv[lens[0] - 30 : lens[0], H * D : 2 * H * D] *= 8  # keys near the end of the first sequence
    sl = torch.tensor(lens, dtype=torch.int32)
    one, two = on_one_and_two_threads(lambda: kernels.encoder_attention(qkv, sl, H, D, D**-0.5))
    assert torch.isfinite(one).all()
    assert torch.equal(one, two)
    # (scores of up to ~50: their last bits depend on the summation order, and exp amplifies them)
    torch.testing.assert_close(one, encoder_attention_ref(qkv, lens, H, D, D**-0.5), atol=1e-4, rtol=1e-4)


def test_encoder_attention_refuses_bad_input():
    qkv = torch.randn(10, 3 * 2 * 32)
    att = kernels.encoder_attention
    with pytest.raises(ValueError, match="add up"):
        att(qkv, torch.tensor([4, 5], dtype=torch.int32), 2, 32, 0.1)
    with pytest.raises(ValueError, match="positive"):
        att(qkv, torch.tensor([10, 0], dtype=torch.int32), 2, 32, 0.1)
    with pytest.raises(ValueError, match="int32"):
        att(qkv, torch.tensor([10]), 2, 32, 0.1)
    with pytest.raises(ValueError, match="qkv must be"):
        att(qkv, torch.tensor([10], dtype=torch.int32), 3, 32, 0.1)
    with pytest.raises(ValueError, match="multiple of 16"):
        att(torch.randn(10, 3 * 2 * 24), torch.tensor([10], dtype=torch.int32), 2, 24, 0.1)
    with pytest.raises(ValueError, match="positive"):
        att(qkv, torch.tensor([10], dtype=torch.int32), 2, 32, 0.0)
    with pytest.raises(ValueError, match="bias must be"):
        att(qkv, torch.tensor([10], dtype=torch.int32), 2, 32, 0.1, torch.zeros(3 * 2 * 32 - 1))


def test_engine_greedy_equal_on_every_isa(tiny_llama):
    """Whole-model check: every variant (and the PyTorch path) yields transformers' tokens."""
    from armserve import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="float32", kv_cache_space=0.02)
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["the cat sat on", "a b c d e f g h i j k l m n o p q r s t u v"]
    results = {}
    before = kernels.isa()
    runner = llm.llm_engine.runner
    try:
        for name in kernel_isas():
            kernels.select_isa(name)
            results[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        runner.use_kernels = False
        kernels.library._lib, saved = None, kernels.library._lib  # the PyTorch path everywhere
        try:
            results["torch"] = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
        finally:
            kernels.library._lib = saved
            runner.use_kernels = True
    finally:
        kernels.select_isa(before)
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()), results


def gemv_modes() -> list[tuple[torch.dtype, bool]]:
    """(dtype, bf16 dot instruction on): every dtype widened to fp32, plus bfloat16 through the
    CPU's bf16 dot instruction where it has one."""
    from armserve import kernels

    has_dot = "avx512_bf16" in kernels.cpu_features() or "bf16" in kernels.cpu_features()
    return [(d, False) for d in DTYPES] + ([(torch.bfloat16, True)] if has_dot else [])


@pytest.mark.parametrize("dtype,bf16_dot", gemv_modes())
def test_gemv(isa, dtype, bf16_dot):
    """Skinny matmul for decode vs PyTorch's float64 matmul: odd sizes (SIMD tails), several
    16-row blocks with a partial one, 1-9 tokens (more than one 8-token chunk)."""
    torch.manual_seed(11)
    shapes = ([(1, 10, 37), (3, 64, 576), (4, 130, 1000), (2, 7, 16), (9, 35, 200), (1, 40, 2048 + 24)]
              if not SMALL else [(1, 10, 37), (4, 9, 40), (9, 35, 200)])
    before = kernels.set_bf16_dot(bf16_dot)
    try:
        for m, n, k in shapes:
            x = torch.randn(m, k).to(dtype)
            w = torch.randn(n, k).to(dtype)
            want = (x.double() @ w.double().T).to(dtype)
            if dtype == torch.float32:  # a k-long float32 sum: error grows with k, so scale the tolerance
                torch.testing.assert_close(kernels.gemv(x, w), want, atol=2e-6 * k ** 0.5 * want.abs().max().item(),
                                           rtol=1e-5)
            else:
                close(kernels.gemv(x, w), want, dtype)
    finally:
        kernels.set_bf16_dot(before)


def test_gemv_token_limit_follows_the_variant():
    """The decode matmul takes up to 4 tokens where rows are cheap to re-read (AVX-512, or a bf16
    dot instruction for bf16), 1 where it widens with 8-lane SIMD; float32 up to 4 on x86 SIMD (it
    beat PyTorch's sgemv there), 1 on ARM SIMD, never on the scalar reference."""
    before = kernels.isa()
    try:
        for name in kernels.supported_isas():
            kernels.select_isa(name)
            for dtype in (torch.bfloat16, torch.float16):
                wide = name == "avx512" or (dtype == torch.bfloat16 and kernels.bf16_dot())
                limit = 4 if wide else 1
                assert kernels.use_kernel("gemv", torch.zeros(limit, 8, dtype=dtype))
                assert not kernels.use_kernel("gemv", torch.zeros(limit + 1, 8, dtype=dtype))
            f32 = 0 if name == "scalar" else (4 if name in ("avx2", "avx512") else 1)
            assert kernels.use_kernel("gemv", torch.zeros(max(f32, 1), 8)) == (f32 > 0)
            assert not kernels.use_kernel("gemv", torch.zeros(f32 + 1, 8))
    finally:
        kernels.select_isa(before)


def test_bf16_dot_follows_the_variant_and_the_wish():
    """The bf16 dot instructions run only while the CPU and the selected variant have them; a wish
    saved and restored under a variant without them is kept (not the variant's False)."""
    has_dot = "avx512_bf16" in kernels.cpu_features() or "bf16" in kernels.cpu_features()
    before = kernels.isa()
    try:
        kernels.select_isa("scalar")
        assert not kernels.bf16_dot() and not kernels.native_bf16()
        wish = kernels.set_bf16_dot(False)
        kernels.set_bf16_dot(wish)
        kernels.select_isa("auto")
        assert kernels.bf16_dot() == has_dot == kernels.native_bf16() or kernels.isa() not in ("avx512", "neon", "sve")
    finally:
        kernels.select_isa(before)


def test_use_kernel_is_the_one_decision(monkeypatch):
    """Each op's rule, an unknown op named in the error, and no library (ARMSERVE_ISA=torch, or
    none built) switching every op to PyTorch."""
    bf, f32 = torch.zeros(3, 64, dtype=torch.bfloat16), torch.zeros(3, 64)
    for op in ("rms_norm", "rotary", "act_and_mul", "embedding", "qgemm"):
        assert kernels.use_kernel(op, bf) and kernels.use_kernel(op, f32)
        assert not kernels.use_kernel(op, bf.to(torch.float64))
    assert kernels.use_kernel("attention", torch.bfloat16, head_dim=64)
    assert not kernels.use_kernel("attention", torch.bfloat16, head_dim=72)  # not a multiple of 16
    assert kernels.use_kernel("dense_pack", bf) and kernels.use_kernel("dense_pack", f32)
    assert not kernels.use_kernel("dense_pack", bf.half())  # float16 keeps the skinny kernel and PyTorch
    assert kernels.use_kernel("small", torch.zeros(kernels.SMALL_OP_ROWS, 8))
    assert not kernels.use_kernel("small", torch.zeros(kernels.SMALL_OP_ROWS + 1, 8))
    assert kernels.use_kernel("argmax", f32) and not kernels.use_kernel("argmax", f32.t())
    qkv = torch.zeros(3, 4 * 32 + 16, dtype=torch.bfloat16)
    assert kernels.use_kernel("rms_norm_heads", qkv[:, :128].view(3, 4, 32))  # heads inside a wider row
    assert not kernels.use_kernel("rms_norm_heads", qkv[:, :128].view(3, 4, 32).transpose(0, 1))
    with pytest.raises(ValueError, match="unknown kernel op 'softmax'"):
        kernels.use_kernel("softmax", f32)
    # what _load leaves for ARMSERVE_ISA=torch: no library
    monkeypatch.setattr(kernels.library, "_lib", None)
    monkeypatch.setattr(kernels.library, "_loaded", True)
    big = torch.zeros(kernels.QDENSE_MIN_ROWS, 64, dtype=torch.bfloat16)
    assert not any(kernels.use_kernel(op, torch.bfloat16 if op == "attention" else big, head_dim=64)
                   for op in kernels.KERNEL_OPS)
