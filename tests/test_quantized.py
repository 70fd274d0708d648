"""int4/int8 weights: qgemm kernels (and embedding rows gathered from their tiles) vs the PyTorch
reference on every ISA, GGUF block conversion vs the `gguf` package's own dequantizer, `armserve
quantize` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from armserve import LLM, SamplingParams, kernels
from armserve.kernels.reference import gguf_embedding_ref, qembedding_ref, qgemm_dense_ref, qlinear_ref, quantize_act_ref
from armserve.quantization import QuantizedLinear, QuantizedTensor, kernel_scales, pack, quantize_weight
from armserve.quantization.embedding import MappedEmbedding, QuantizedEmbedding
from armserve.quantization.gguf import convert, gguf_rows
from conftest import assert_next_token_logprobs_close

SMALL = os.environ.get("ARMSERVE_TEST_SMALL") == "1"


def random_w8(n: int, k: int, group: int) -> QuantizedTensor:
    w = torch.randn(n, k)
    s = w.view(n, k // group, group).abs().amax(-1) / 127
    q = torch.round(w / s.repeat_interleave(group, 1)).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("w8", q, s, None, group)


def random_w5(n: int, k: int) -> QuantizedTensor:
    """GGUF Q5_0's meaning (w = d * (u - 16), u in 0..31, float16 d per 32 columns), random codes."""
    return QuantizedTensor("w5", torch.randint(0, 32, (n, k), dtype=torch.uint8),
                           (torch.rand(n, k // 32) * 0.05 + 1e-3).half().float(), None, 32)


def plane_as_w8(qt: QuantizedTensor) -> QuantizedTensor:
    """The w8 tensor armserve held for the same Q5_0 / Q6_K blocks before w5 / w6: codes u - 16 /
    u - 32 as int8, the same scales."""
    offset = {"w5": 16, "w6": 32}[qt.fmt]
    return QuantizedTensor("w8", (qt.codes.to(torch.int16) - offset).to(torch.int8), qt.scales, None, qt.group)


def random_w6(n: int, k: int) -> QuantizedTensor:
    """GGUF Q6_K's meaning (w = d * sc * (u - 32), u in 0..63, an int8 sc per 16 columns, a float16
    d per 256, of either sign), random codes, sub-scales over the whole int8 range."""
    d = ((torch.rand(n, k // 256) * 2e-3 + 1e-4) * (torch.randint(0, 2, (n, k // 256)) * 2 - 1)).half().float()
    sc = torch.randint(-128, 128, (n, k // 16)).float()
    return QuantizedTensor("w6", torch.randint(0, 64, (n, k), dtype=torch.uint8),
                           d.repeat_interleave(16, dim=1) * sc, d, 16)


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """Float rows [n, k] (k a multiple of 256) as GGUF Q6_K blocks (the gguf package cannot write
    K-quants): a plain rounding (per 16 columns a scale of amax / 31, rounded to an int8 multiple of
    the 256 columns' float16 d), laid out as llama.cpp's block_q6_K; its meaning is checked against
    the gguf package's dequantizer below."""
    rows, k = w.shape
    x = w.reshape(rows, k // 256, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(df == 0, 1, df)[..., None]), -128, 127).astype(np.int8)
    s = df[..., None] * sc.astype(np.float32)
    q = np.clip(np.rint(x / np.where(s == 0, 1, s)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(rows, k // 256, 2, 4, 32)  # per half of 128 values: 4 runs of 32
    ql = np.concatenate([(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4),
                         (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)], axis=-1)
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    return np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                           d.view(np.uint8).reshape(rows, -1, 2)], axis=-1).reshape(rows, -1)


def random_w8h(n: int, k: int, group: int) -> QuantizedTensor:
    """w8 with float16-valued scales (GGUF Q8_0's d), as w8h."""
    qt = random_w8(n, k, group)
    return QuantizedTensor("w8h", qt.codes, qt.scales.half().float(), None, group)


def random_q(fmt: str, n: int, k: int, g: int, symmetric: bool) -> QuantizedTensor:
    if fmt == "w4":
        return quantize_weight(torch.randn(n, k), g, symmetric=symmetric)
    if fmt == "w6":
        return random_w6(n, k)
    if fmt == "w8h":
        return random_w8h(n, k, g)
    return random_w8(n, k, g) if fmt == "w8" else random_w5(n, k)


def fits(fmt: str, g: int, k: int = 256) -> bool:
    """Whether the format takes groups of g columns and rows of k (w4: whole 8-column chunks; w5:
    Q5_0's 32; w6: Q6_K's 16, rows of whole 256-column blocks; w8h: an even number of groups)."""
    if fmt == "w6":
        return g == 16 and k % 256 == 0
    if fmt == "w8h":
        return k % (2 * g) == 0
    return g % 8 == 0 if fmt == "w4" else (g == 32 if fmt == "w5" else True)


# w6's shapes (k a multiple of 256): every token count a tile takes, more than one 256-column block
W6_SHAPES = [(1, 40, 256, 16), (5, 33, 512, 16), (3, 17, 256, 16), (9, 20, 768, 16), (2, 16, 256, 16),
             (8, 24, 256, 16)]


# (1, 16, 72, 24): an odd number of 8-column chunks per group at one token (the decode loops that take
# two chunks a step keep one for the end: qgemm_sve.cpp).
# 2, 3, 5 and 7 tokens: the 2- and 3-token tiles and AVX2's 5-8 token passes (a speculative verify step's rows).
SHAPES = [(1, 40, 64, 32), (5, 33, 128, 64), (4, 16, 96, 32), (9, 50, 256, 256), (3, 24, 128, 16), (1, 16, 72, 24),
          (2, 20, 96, 32), (7, 20, 96, 32)]
if SMALL:
    SHAPES = [(1, 20, 64, 32), (5, 17, 64, 16), (1, 16, 72, 24), (2, 17, 96, 32)]


@pytest.mark.parametrize("fmt", ["w4", "w8", "w5", "w6", "w8h"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qgemm_matches_reference(isa, fmt, dtype):
    torch.manual_seed(0)
    extra = {"w5": [(5, 33, 160, 32), (3, 17, 64, 32)], "w6": W6_SHAPES}.get(fmt, [])
    for m, n, k, g in SHAPES + extra:
        if not fits(fmt, g, k):
            continue
        qt = random_q(fmt, n, k, g, symmetric=(m % 2 == 0))
        x = torch.randn(m, k).to(dtype)
        acts = kernels.quantize_act(x, g)
        q_ref, s_ref, gs_ref = quantize_act_ref(x, g)
        assert torch.equal(acts[0], q_ref) and torch.equal(acts[1], s_ref) and torch.equal(acts[2], gs_ref)
        packed = pack(qt)
        out = torch.full((m, n + 7), 7.0, dtype=dtype)
        kernels.qgemm(fmt, out, 3, acts, packed, n, g)  # into a column slice of a wider output
        want = qlinear_ref(x.float(), qt)
        tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        torch.testing.assert_close(out[:, 3:3 + n].float(), want.float(), atol=tol * want.abs().max().item(), rtol=tol)
        assert torch.all(out[:, :3] == 7) and torch.all(out[:, 3 + n:] == 7), "wrote outside its columns"


@pytest.mark.parametrize("fmt", ["w4", "w8", "w5", "w6", "w8h"])
def test_qgemm_row_alone_equals_row_among_others(isa, fmt):
    """Each row of an m-row product is the same bits as that row alone, for every row count the
    tiles take differently (1-9 tokens and more): a speculative verify step's rows must equal
    decode steps' for greedy decoding to be the same with and without speculation."""
    torch.manual_seed(8)
    rows = 17 if not SMALL else 9
    for n, k, g in [(40, 96, 32), (33, 128, 32), (20, 256, 16)]:
        if not fits(fmt, g, k):
            continue
        qt = random_q(fmt, n, k, g, symmetric=False)
        packed = pack(qt)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, k).to(dtype)
            alone = torch.empty(rows, n, dtype=dtype)
            for i in range(rows):
                kernels.qgemm(fmt, alone[i:i + 1], 0, kernels.quantize_act(x[i:i + 1], g), packed, n, g)
            for m in range(2, rows + 1):
                out = torch.empty(m, n, dtype=dtype)
                kernels.qgemm(fmt, out, 0, kernels.quantize_act(x[:m], g), packed, n, g)
                assert torch.equal(out, alone[:m]), (fmt, m, n, k, dtype)


@pytest.mark.parametrize("fmt", ["w5", "w6", "w8h"])
def test_compact_format_gemm_equals_w8_of_the_same_blocks(isa, fmt):
    """w5 / w6 / w8h (GGUF Q5_0 / Q6_K / Q8_0 at 5.5 / 6.625 / 8.5 bits a weight) give bit for bit
    what the w8 tiles (float32 scales) of the same blocks gave (the int8 path they took before): 1
    to 9 tokens (each tile width: AVX2 takes 5-8 w5 tokens in one pass, 9 as 8 + 1), every dtype."""
    torch.manual_seed(6)
    g = {"w5": 32, "w6": 16, "w8h": 32}[fmt]
    for m, n, k in [(1, 40, 256), (2, 17, 512), (3, 33, 256), (4, 16, 256), (5, 20, 768), (6, 17, 256),
                    (8, 33, 256), (9, 20, 512)]:
        qt = {"w5": random_w5, "w6": random_w6}[fmt](n, k) if fmt != "w8h" else random_w8h(n, k, g)
        if fmt == "w8h":
            w8 = QuantizedTensor("w8", qt.codes, qt.scales, None, g)
        else:
            w8 = plane_as_w8(qt)
            mine = qt.as_w8()  # (what a tensor-parallel split inside a Q6_K block falls back to)
            assert mine.fmt == "w8" and torch.equal(mine.codes, w8.codes) and torch.equal(mine.scales, w8.scales)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.randn(m, k).to(dtype)
            acts = kernels.quantize_act(x, g)
            got, want = (torch.empty(m, n, dtype=dtype) for _ in range(2))
            kernels.qgemm(fmt, got, 0, acts, pack(qt), n, g)
            kernels.qgemm("w8", want, 0, acts, pack(w8), n, g)
            assert torch.equal(got, want), (m, n, k, dtype)


@pytest.mark.parametrize("fmt", ["w4", "w8", "w5", "w6", "w8h"])
def test_qgemm_dense_matches_reference(isa, fmt):
    """The prefill path of quantized layers: the weight dequantized to bf16 panel by panel for the
    dense GEMM's tiles (with the bf16 dot instruction where the variant has one, and without; on
    AMX tiles where the CPU has them) against bf16 activations."""
    torch.manual_seed(3)
    # (dot, amx): None for a switch this CPU / variant lacks; AMX tiles from 3 rows where it has them
    modes = [(None, None)] if not kernels.bf16_dot() else (
        [(True, True), (True, False), (False, False)] if kernels.amx_available() else [(True, None), (False, None)])
    for dot, amx in modes:
        before = None if dot is None else kernels.set_bf16_dot(dot)
        amx_before = None if amx is None else kernels.set_amx(amx)
        try:
            assert (kernels.dense_isa() == "amx_bf16") == bool(amx)
            # the last: weights wider than one ~1 MiB group of dequantized panels (AMX path)
            for m, n, k, g in SHAPES + [(130, 70, 192, 32), (40, 1100, 512, 64), (130, 40, 512, 16)]:
                if g % 8 or not fits(fmt, g, k):
                    continue
                qt = random_q(fmt, n, k, g, symmetric=(n % 2 == 0))
                x = torch.randn(m, k).to(torch.bfloat16)
                out = torch.full((m, n + 5), 7.0, dtype=torch.bfloat16)
                kernels.qgemm_dense(fmt, out, 2, x, pack(qt), n, g)  # into a column slice of a wider output
                want = qgemm_dense_ref(x, qt).float()
                # fp32 sums of exact bf16 products (order differs from float64), one bf16 rounding
                torch.testing.assert_close(out[:, 2:2 + n].float(), want, atol=1e-2 * want.abs().max().item(),
                                           rtol=1e-2)
                assert torch.all(out[:, :2] == 7) and torch.all(out[:, 2 + n:] == 7), "wrote outside its columns"
        finally:
            if before is not None:
                kernels.set_bf16_dot(before)
            if amx_before is not None:
                kernels.set_amx(amx_before)


def test_quantized_layer_takes_the_dense_path_for_prefill_rows():
    """From QDENSE_MIN_ROWS bf16 rows, a layer's int8-weight part goes through the dequantized bf16
    GEMM where the CPU has a bf16 dot instruction, and its int4 part too where the GEMM runs on AMX
    tiles (else the w4a8 / w8a8 GEMM): each part against the reference of the path it should take,
    with AMX on and off where the CPU has it."""
    torch.manual_seed(4)
    k = 128
    a = quantize_weight(torch.randn(32, k), 32, symmetric=False)
    b = random_w8(16, k, 32)
    layer = QuantizedLinear(k, 48, False, [("q", 32), ("k", 16)])
    layer.load_shard("q", a)
    layer.load_shard("k", b)
    layer.finalize()
    assert [p.fmt for p in layer.parts] == ["w4", "w8"]
    x = torch.randn(kernels.QDENSE_MIN_ROWS, k).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fmt"):
        kernels.use_kernel("qgemm_dense", x)
    for amx in ([True, False] if kernels.amx_available() else [None]):
        before = None if amx is None else kernels.set_amx(amx)
        try:
            dense = {f: kernels.use_kernel("qgemm_dense", x, fmt=f) for f in ("w4", "w8")}
            assert dense["w8"] == kernels.bf16_dot()
            assert dense["w4"] == (kernels.dense_isa() == "amx_bf16") == bool(amx and kernels.bf16_dot())
            assert not kernels.use_kernel("qgemm_dense", x[:-1], fmt="w8")
            assert not kernels.use_kernel("qgemm_dense", x.float(), fmt="w8")
            got = layer(x).float()
            for part, qt, cols in (("w4", a, slice(0, 32)), ("w8", b, slice(32, 48))):
                quantized_acts = qlinear_ref(x.float(), qt).float()
                want = qgemm_dense_ref(x, qt).float() if dense[part] else quantized_acts
                torch.testing.assert_close(got[:, cols], want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
                if dense[part]:  # the two paths differ (int8 activations or not), and the reference told them apart
                    assert (got[:, cols] - quantized_acts).abs().max() > (got[:, cols] - want).abs().max()
        finally:
            if before is not None:
                kernels.set_amx(before)


def formats_and_logprobs(path: str, tokenizer: str) -> tuple[dict[str, int], list]:
    """A bf16 model's packed bytes per quantized format, and its greedy tokens with their top-5
    log-probabilities for a short prompt and a prefill-sized one (140 rows)."""
    from test_engine import tiny

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 13], list(range(3, 3 + 140)))]
    llm = tiny(path, tokenizer=tokenizer, dtype="bfloat16")
    fmts: dict[str, int] = {}
    for m in llm.llm_engine.model.modules():
        if isinstance(m, QuantizedLinear):
            for p in m.parts:
                fmts[p.fmt] = fmts.get(p.fmt, 0) + p.packed.numel()
    outs = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]
    return fmts, outs


def test_q5_0_gguf_stays_w5_and_equals_the_int8_path(tiny_llama, tmp_path, monkeypatch):
    """A GGUF's Q5_0 tensors (here q, gate, up and the token table, which is also the LM head) load
    as w5 (5.5 bits a weight), its Q8_0 ones as w8h (8.5), and the model's log-probabilities are,
    bit for bit, those of the same file loaded the way they were before (int8 tiles with float32
    scales), prefill rows and decode steps alike."""
    from armserve.quantization import gguf
    from test_tp import write_llama_gguf

    path = str(tmp_path / "q5.gguf")
    write_llama_gguf(tiny_llama, path, q5_0=True)

    def run() -> tuple[dict[str, int], list]:
        return formats_and_logprobs(path, tiny_llama)

    fmts, w5 = run()
    assert set(fmts) == {"w5", "w8h", "w8"}  # (w8h: the Q8_0 tensors; w8: k, a float tensor beside q and v)
    monkeypatch.setitem(gguf._CONVERTERS, "Q5_0", lambda data: plane_as_w8(gguf._q5_0(data)))
    fmts8, w8 = run()
    assert set(fmts8) == {"w8h", "w8"}
    assert w5 == w8
    # the Q5_0 layers' bytes: 5.5 bits a weight where w8 took 9
    assert fmts["w5"] * 9 == (fmts8["w8"] - fmts["w8"]) * 5.5
    # and the Q8_0 ones (w8h: float16 scales, 8.5 bits a weight) as w8 with float32 scales: the same bits
    q8 = gguf._q8_0
    monkeypatch.setitem(gguf._CONVERTERS, "Q8_0",
                        lambda data: QuantizedTensor("w8", q8(data).codes, q8(data).scales, None, 32))
    fmts88, w88 = run()
    assert set(fmts88) == {"w8"}
    assert w88 == w5
    assert fmts["w8h"] * 9 == (fmts88["w8"] - fmts8["w8"]) * 8.5


def test_q6_k_gguf_stays_w6_and_equals_the_int8_path(tokenizer_dir, tmp_path, monkeypatch):
    """A GGUF's Q6_K tensors (v, the output projection, down and the token table, which is also the
    LM head, as Q4_K_M files store down and the head) load as w6 (6.625 bits a weight) and the
    model's log-probabilities are, bit for bit, those of the same file loaded the way Q6_K was
    before (int8 tiles with float32 scales per 16), prefill rows and decode steps alike."""
    from armserve.quantization import gguf
    from conftest import CACHE, make_tiny_checkpoint
    from test_tp import write_llama_gguf

    # rows of whole Q6_K blocks: hidden and intermediate sizes multiples of 256
    hf = make_tiny_checkpoint(os.path.join(CACHE, "tiny-llama-256"), "LlamaForCausalLM", tokenizer_dir,
                              hidden_size=256, intermediate_size=512)
    path = str(tmp_path / "q6.gguf")
    write_llama_gguf(hf, path, q6_k=True)

    def run() -> tuple[dict[str, int], list]:
        return formats_and_logprobs(path, hf)

    fmts, w6 = run()
    assert set(fmts) == {"w4", "w6", "w8"}  # (w8: k, a float tensor beside its quantized q and v)
    monkeypatch.setitem(gguf._CONVERTERS, "Q6_K", lambda data: plane_as_w8(gguf._q6_k(data)))
    fmts8, w8 = run()
    assert set(fmts8) == {"w4", "w8"}
    assert w6 == w8
    # the Q6_K layers' bytes: 6.625 bits a weight where w8 with float32 scales per 16 took 10
    assert fmts["w6"] * 10 == (fmts8["w8"] - fmts["w8"]) * 6.625


def test_w6_splits_by_rows_and_whole_blocks_and_else_falls_back_to_w8():
    """A tensor-parallel rank's part of a w6 weight: rows, or input columns on 256-column block
    boundaries, stay w6; columns inside a block (Qwen2.5's down projection, 4864 columns, at TP=2)
    become the w8 of the same blocks; each is the dequantized weight's slice exactly."""
    torch.manual_seed(9)
    qt = random_w6(40, 768)
    full = qt.dequantize()
    rows = qt.narrow(0, 16, 20)
    assert rows.fmt == "w6" and torch.equal(rows.dequantize(), full[16:36])
    cols = qt.narrow(1, 256, 512)
    assert cols.fmt == "w6" and cols.szp.shape == (40, 2) and torch.equal(cols.dequantize(), full[:, 256:])
    half = qt.narrow(1, 384, 384)
    assert half.fmt == "w8" and torch.equal(half.dequantize(), full[:, 384:])
    with pytest.raises(ValueError, match="groups of 16"):
        qt.narrow(1, 8, 256)


def test_quantized_linear_with_mixed_shards(isa):
    """A fused layer whose shards differ in format (GGUF Q4_K_M: Q4_K beside Q6_K) keeps both."""
    torch.manual_seed(1)
    k = 64
    a = quantize_weight(torch.randn(32, k), 32, symmetric=False)
    b = random_w8(16, k, 16)
    layer = QuantizedLinear(k, 48, True, [("q", 32), ("k", 16)])
    layer.bias.data.normal_()
    layer.load_shard("k", b)
    layer.load_shard("q", a)
    layer.finalize()
    assert [p.fmt for p in layer.parts] == ["w4", "w8"]
    x = torch.randn(6, k)
    want = torch.cat([qlinear_ref(x, a), qlinear_ref(x, b)], dim=1) + layer.bias
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["w8", "w4", "w5", "w6", "w8h"])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernels", "pytorch"])
def test_a_layer_keeps_some_row_tiles_bit_for_bit(isa, fmt, kernel, monkeypatch):
    """keep_row_tiles (a draft model's LM head over part of the vocabulary): the kept rows' outputs
    are the whole layer's, bit for bit, the partial last tile included, on the kernels' packed
    bytes and on the PyTorch path; tiles out of order or range are refused."""
    torch.manual_seed(12)
    if not kernel:
        monkeypatch.setattr(kernels, "use_kernel", lambda *a, **kw: False)
    n, k = 100, 256 if fmt == "w6" else 64  # 7 tiles, the last of 4 rows
    layer = QuantizedLinear(k, n, False, [("all", n)])
    layer.load_shard("all", random_q(fmt, n, k, 16 if fmt == "w6" else 32, symmetric=False))
    assert (layer.parts[0].packed is not None) == kernel
    for tiles in ([0, 2, 6], [1], [0, 1, 2, 3, 4, 5, 6]):
        sub, rows = layer.keep_row_tiles(tiles)
        assert rows.tolist() == [r for t in tiles for r in range(16 * t, min(16 * t + 16, n))]
        assert sub.out_features == len(rows)
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 4):
                x = torch.randn(m, k).to(dtype)
                assert torch.equal(sub(x), layer(x)[:, rows]), (tiles, dtype, m)
    for bad in ([], [2, 1], [1, 1], [7], [-1]):
        with pytest.raises(ValueError, match="row tiles"):
            layer.keep_row_tiles(bad)


def test_quantize_weight_round_trip():
    torch.manual_seed(2)
    w = torch.randn(64, 128)
    for symmetric in (True, False):
        plain = quantize_weight(w, 32, symmetric, search=False)
        assert plain.codes.dtype == torch.uint8 and int(plain.codes.max()) <= 15
        err = (plain.dequantize() - w).abs()
        # min/max rounding: at most half a step of each group's scale
        assert torch.all(err <= plain.scales.repeat_interleave(32, 1) * 0.5 + 1e-6)
        # the searched rounding starts from min/max and keeps only improvements, group by group
        best = quantize_weight(w, 32, symmetric)
        assert int(best.codes.max()) <= 15 and int(best.codes.min()) >= 0
        group_err = lambda qt: (qt.dequantize() - w).square().view(64, 4, 32).sum(-1)  # noqa: E731
        assert torch.all(group_err(best) <= group_err(plain) * (1 + 1e-6))
        assert group_err(best).sum() < 0.9 * group_err(plain).sum()
        if symmetric:
            torch.testing.assert_close(best.szp, 8 * best.scales)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quantize_weight(torch.randn(4, 40), 32, False)


def test_quantize_weight_flat_and_zero_groups():
    """Constant groups (zero range) dequantize exactly and produce no NaN scales."""
    w = torch.zeros(3, 64)
    w[1] = 0.25
    w[2, :32] = -1.5
    w[2, 32:] = torch.linspace(-1, 1, 32)
    for symmetric in (True, False):
        qt = quantize_weight(w, 32, symmetric)
        assert torch.isfinite(qt.scales).all() and torch.isfinite(qt.szp).all()
        got = qt.dequantize()
        torch.testing.assert_close(got[:2], w[:2])
        if not symmetric:
            torch.testing.assert_close(got[2, :32], w[2, :32])


# ---- GGUF blocks ------------------------------------------------------------------------


def _random_kquant_blocks(name: str, rows: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid super-blocks: random bytes, with the float16 fields set to sane values."""
    size = {"Q4_K": 144, "Q6_K": 210}[name]
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.05, size=(rows, blocks, 2)).astype(np.float16).view(np.uint8)
    if name == "Q4_K":
        raw[..., 0:4] = halves.reshape(rows, blocks, 4)  # d, dmin
    else:
        raw[..., 208:210] = halves.reshape(rows, blocks, 4)[..., :2]  # d
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_gguf_blocks_convert_exactly(name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(3)
    qtype = GGMLQuantizationType[name]
    if name in ("Q4_K", "Q6_K"):  # the gguf package cannot quantize K-quants: random blocks
        raw = _random_kquant_blocks(name, 6, 2, rng)
    else:
        raw = quantize(rng.standard_normal((6, 512)).astype(np.float32), qtype)
    qt = convert(name, raw)
    want = dequantize(raw, qtype)
    assert qt.fmt == {"Q5_0": "w5", "Q8_0": "w8h", "Q6_K": "w6"}.get(name, "w4")
    np.testing.assert_array_equal(qt.dequantize().numpy(), want)
    if name == "Q6_K":  # the test's own Q6_K writer (used below) against the gguf package's reading
        w = rng.standard_normal((6, 512)).astype(np.float32)
        blocks = q6_k_blocks(w)
        got = dequantize(blocks, qtype)
        assert np.abs(got - w).max() < 0.05 * np.abs(w).max()
        np.testing.assert_array_equal(convert(name, blocks).dequantize().numpy(), got)


@pytest.mark.parametrize("fmt", ["w4", "w8", "w5", "w6", "w8h"])
def test_pack_kernel_and_row_chunks_equal_one_pass(fmt):
    """The layers' C++ pack (kernels.pack_q) and the reference `pack`, which works in row chunks,
    both equal one pass of the reference over all rows; the qgemm tests above check that layout
    against the GEMMs' meaning."""
    from armserve.quantization.formats import _pack_rows, packed_bytes

    torch.manual_seed(0)
    for n, k, g in [(1045, 4096, 32), (21, 96, 96)]:  # 1024 rows a chunk: the last not whole tiles; one group a row
        if fmt == "w5" and g != 32:
            n, k, g = 21, 96, 32
        if fmt == "w6":
            n, k, g = (n, k, 16) if k % 256 == 0 else (21, 256, 16)
        if fmt == "w8h" and k // g % 2:
            n, k, g = 21, 192, 96
        qt = (quantize_weight(torch.randn(n, k), g, symmetric=False, search=False) if fmt == "w4"
              else random_q(fmt, n, k, g, False))
        one = torch.empty(packed_bytes(fmt, n, k, g), dtype=torch.uint8)
        _pack_rows(qt, one)
        assert torch.equal(pack(qt), one)
        assert torch.equal(kernels.pack_q(qt), one)


# ---- embedding rows of a quantized table ----------------------------------------------


@pytest.mark.parametrize("fmt,group,exact", [("w4", 32, False), ("w4", 32, True), ("w4", 64, True), ("w8", 32, False),
                                             ("w8", 16, False), ("w5", 32, False), ("w6", 16, False),
                                             ("w8h", 32, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qembedding_matches_reference(isa, fmt, group, exact, dtype):
    torch.manual_seed(0)
    # rows not a whole number of 16-row tiles; a vocabulary share from row 7
    n, k, start = 37, 256 if fmt == "w6" else 128, 7
    if fmt == "w4":
        qt = quantize_weight(torch.randn(n, k), group, symmetric=False, search=False)
        qt = qt if exact else kernel_scales(qt)  # float32 scales (as Q4_K's d * sc) or float16 ones (Q4_0)
    else:
        qt = random_q(fmt, n, k, group, False)
    emb = QuantizedEmbedding(qt, dtype)
    assert (emb.exact is not None) == exact and emb.packed is not None
    ids = torch.tensor([start, start + 36, 12, start + 16, start + 15, 0, start + n, 40, 40, start + 5])
    got = emb(ids, start)
    want = qembedding_ref(ids, qt, dtype, start)
    assert torch.equal(got, want)
    assert torch.equal(got[5], torch.zeros(k, dtype=dtype)) and torch.equal(got[6], got[5])  # other ranks' rows
    assert torch.equal(got[0], qt.dequantize()[0].to(dtype))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_gguf_embedding_rows_equal_the_dequantized_table(isa, name):
    """Rows looked up in a GGUF table kept quantized are the rows of the float table the loader
    held before (dequantized from the same blocks, then rounded to the model dtype), bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(5)
    if name in ("Q4_K", "Q6_K"):
        raw = _random_kquant_blocks(name, 40, 2, rng)
    else:
        raw = quantize(rng.standard_normal((40, 512)).astype(np.float32), GGMLQuantizationType[name])
    table = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]))
    ids = torch.tensor([3, 39, 0, 17, 17, 25])
    for dtype in (torch.float32, torch.bfloat16):
        emb = QuantizedEmbedding(convert(name, raw), dtype)
        assert torch.equal(emb(ids), table.to(dtype)[ids])


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_mapped_gguf_embedding_matches_reference(isa, name):
    """Rows read from a GGUF table as the file stores it (never converted) are, on every ISA, the
    reference's (the loader's conversion) and the rows of the `gguf` package's own dequantized
    table, bit for bit; ids outside a vocabulary share give zero rows."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(7)
    n, k, start = 40, 512, 5
    floats = rng.standard_normal((n, k)).astype(np.float32)
    if name in ("Q4_K", "Q6_K"):
        raw = _random_kquant_blocks(name, n, 2, rng)
    elif name in ("F32", "F16"):
        raw = floats.astype(np.float16 if name == "F16" else np.float32)
    elif name == "BF16":
        raw = (floats.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = quantize(floats, GGMLQuantizationType[name])
    table = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(n, k).astype(np.float32))
    share = gguf_rows(name, raw, n, k).narrow(0, start, 30)  # a rank's rows [5, 35)
    ids = torch.tensor([start, start + 29, 0, 17, 17, start + 30, 39, 6])
    inside = (ids >= start) & (ids < start + 30)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = MappedEmbedding(share, dtype)(ids, start)
        assert torch.equal(got, gguf_embedding_ref(ids, share, dtype, start))
        assert torch.equal(got[inside], table.to(dtype)[ids[inside]])
        assert not got[~inside].any()


def test_unsupported_gguf_type_is_not_converted():
    assert convert("Q5_K", np.zeros((1, 176), np.uint8)) is None


def test_bundled_gguf_runs_quantized(smollm2_gguf):
    llm = LLM(smollm2_gguf, dtype="bfloat16", kv_cache_space=0.1, max_model_len=512)
    model = llm.llm_engine.model
    qlayers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(qlayers) == 30 * 4 + 1  # qkv, o, gate_up, down per layer + the tied LM head (Q8_0)
    # The Q8_0 embedding table stays quantized, its lookups reading the tied head's tiles: one copy.
    emb = model.embed_tokens
    assert emb.weight is None and emb.table.shared and emb.table.packed is model.lm_head.parts[0].packed
    # Stored size, not bfloat16: Q4_1 linears are 4 bits per weight plus one scale pair per 32.
    n_linear = sum(m.in_features * m.out_features for m in qlayers)
    assert sum(m.weight_bytes for m in qlayers) < 0.9 * n_linear  # < 0.9 bytes per weight (bf16: 2)
    # The memory plan, made from the file's metadata before loading, counts what the model holds.
    from armserve.benchmarks.roofline import module_weight_bytes

    plan = llm.llm_engine.backend.memory_plan.weights
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan == {"head": model.lm_head.weight_bytes, "embedding": 0, "dense": dense,
                    "quantized": sum(m.weight_bytes for m in qlayers) - model.lm_head.weight_bytes}
    assert module_weight_bytes(model) == sum(plan.values())  # what a decode step reads
    # A completion with a wide margin (greedy chat answers of a 135M model flip on tiny changes).
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=1, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.token_ids) == " Paris" and out.logprobs[0][out.token_ids[0]].logprob > -1.0


# ---- armserve quantize ------------------------------------------------------------------


def test_quantize_cli_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "q"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "armserve.cli", "quantize", tiny_llama, str(out), "--group-size", "32"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "armserve" and cfg["group_size"] == 32 and cfg["lm_head"] == "int8"
    assert "lm_head" not in cfg["modules_not_converted"]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "model.layers.0.self_attn.q_proj.qweight" in keys and "model.layers.0.self_attn.q_proj.zeros" in keys
        assert "lm_head.weight" not in keys and f.get_tensor("lm_head.qweight").dtype == torch.int8
        assert f.get_tensor("model.layers.0.mlp.down_proj.qweight").dtype == torch.uint8

    # The quantized folder loads directly (the LM head as an int8 GEMM) and computes what its own
    # dequantized weights give.
    q = LLM(str(out), dtype="float32", kv_cache_space=0.02)
    head = q.llm_engine.model.lm_head
    assert isinstance(head, QuantizedLinear) and [p.fmt for p in head.parts] == ["w8"]
    deq = LLM(str(out), dtype="float32", kv_cache_space=0.02, quantization="none")
    assert_next_token_logprobs_close(q, deq, "the cat sat on the mat", 0.15)  # int8 activations only

    r = subprocess.run([sys.executable, "-m", "armserve.cli", "quantize", tiny_llama, str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "not empty" in r.stderr
    r = subprocess.run([sys.executable, "-m", "armserve.cli", "quantize", tiny_llama, str(tmp_path / "x"),
                        "--group-size", "48"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "group size" in r.stderr


@pytest.mark.parametrize("lm_head,fmt", [("keep", None), ("int4", "w4")])
def test_quantize_lm_head_choices(tiny_llama, tmp_path, lm_head, fmt):
    """--lm-head keep leaves it in --dtype; int4 quantizes it like the other layers; both load and
    agree with their own dequantized weights."""
    from armserve.quantization.quantize import quantize_model

    cfg = quantize_model(tiny_llama, str(tmp_path / "q"), lm_head=lm_head, progress=False)
    assert cfg["lm_head"] == lm_head and (("lm_head" in cfg["modules_not_converted"]) == (lm_head == "keep"))
    q = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_space=0.02)
    head = q.llm_engine.model.lm_head
    assert ([p.fmt for p in head.parts] if isinstance(head, QuantizedLinear) else None) == ([fmt] if fmt else None)
    deq = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_space=0.02, quantization="none")
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = q.generate(["the cat sat on the mat"], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    b = deq.generate(["the cat sat on the mat"], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(a) & set(b)
    assert len(common) >= 3 and max(abs(a[t].logprob - b[t].logprob) for t in common) < 0.15
    with pytest.raises(ValueError, match="lm_head must be"):
        quantize_model(tiny_llama, str(tmp_path / "r"), lm_head="fp8", progress=False)


def test_quantize_untie_lm_head(tiny_checkpoints, tmp_path):
    """untie_lm_head (the quantized self-draft's copy): a head tied to the embedding table gets its
    own int8 copy of the table and the config is untied; it loads as a w8 layer that computes what
    its dequantized weights do."""
    import json

    from safetensors.torch import load_file

    from armserve.quantization.quantize import quantize_model

    src = tiny_checkpoints["llama3-rope-tied"]
    quantize_model(src, str(tmp_path / "q"), progress=False, untie_lm_head=True)
    assert json.load(open(tmp_path / "q" / "config.json"))["tie_word_embeddings"] is False
    q = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_space=0.02)
    head = q.llm_engine.model.lm_head
    assert isinstance(head, QuantizedLinear) and [p.fmt for p in head.parts] == ["w8"]
    deq = LLM(str(tmp_path / "q"), dtype="float32", kv_cache_space=0.02, quantization="none")
    # (the head's int8 copy beside the table, which stays as the source has it)
    out = load_file(str(tmp_path / "q" / "model.safetensors"))
    table = load_file(os.path.join(src, "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(out["model.embed_tokens.weight"], table.to(out["model.embed_tokens.weight"].dtype))
    assert any(n.startswith("lm_head.") for n in out)
    p = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a = q.generate(["the cat sat on the mat"], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    b = deq.generate(["the cat sat on the mat"], p, use_tqdm=False)[0].outputs[0].logprobs[0]
    common = set(a) & set(b)
    assert len(common) >= 3 and max(abs(a[t].logprob - b[t].logprob) for t in common) < 0.15


# ---- accuracy -----------------------------------------------------------------------------


def test_w4a8_perplexity_within_5_percent_of_float32(smollm2_hf_reference, smollm2_float32_baseline, tmp_path):
    """SmolLM2 on held-in public-domain prose: `armserve quantize` w4a8 (group 32) and the GGUF's
    own Q4_1 blocks run as w4a8, against the float32 model (issue: within 5%)."""
    from armserve.evaluate import perplexity
    from armserve.quantization.quantize import quantize_model

    ids, ppl_float = smollm2_float32_baseline["ids"], smollm2_float32_baseline["perplexity"]
    out = str(tmp_path / "w4a8")
    quantize_model(smollm2_hf_reference, out, group_size=32, progress=False)
    q = LLM(out, dtype="float32", kv_cache_space=0.1, max_model_len=1088)
    assert any(isinstance(m, QuantizedLinear) for m in q.llm_engine.model.modules())
    ppl_q = perplexity(q, ids, 1024)
    assert ppl_q == pytest.approx(ppl_float, rel=0.05), (ppl_float, ppl_q)
    assert ppl_q != ppl_float  # the weights really are quantized


def test_fused_layer_with_float_and_quantized_shards(isa):
    """GGUF Q4_K_M files store some q/k as Q5_0 (no direct conversion: float) beside Q6_K v."""
    from types import SimpleNamespace

    from armserve.models.llama import LlamaForCausalLM

    cfg = SimpleNamespace(num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, vocab_size=32,
                          tie_word_embeddings=True, hidden_act="silu", rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    torch.manual_seed(5)
    wq, wk = torch.randn(64, 64), torch.randn(32, 64)
    v = random_w8(32, 64, 16)
    # float q before the quantized v (swap carries it over), float k after it
    loaded = model.load_weights([("model.layers.0.self_attn.q_proj.weight", wq),
                                 ("model.layers.0.self_attn.v_proj.weight", v),
                                 ("model.layers.0.self_attn.k_proj.weight", wk)])
    assert {"layers.0.self_attn.qkv_proj.weight#q", "layers.0.self_attn.qkv_proj.weight#k",
            "layers.0.self_attn.qkv_proj.weight#v"} <= loaded
    layer = model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, QuantizedLinear)
    layer.finalize()
    x = torch.randn(3, 64)
    want = torch.cat([x @ wq.T, x @ wk.T, qlinear_ref(x, v)], dim=1)
    rel = (layer(x) - want).norm() / want.norm()
    assert rel < 0.02, rel  # int8 weights for q/k, int8 activations throughout
