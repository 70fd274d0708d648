"""The PyTorch reference of each kernel: what an op computes where its kernel does not run
(ARMSERVE_ISA=torch, no library built, an input the kernel does not take), and what the tests hold
every kernel variant to. Written to be read, in float32 (float64 for the matmuls) and rounded
where the kernels round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from armserve.quantization.formats import QuantizedTensor
    from armserve.quantization.gguf import GGUFRows


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: returns (norm(x + residual) * (weight + offset), x + residual)."""
    if residual is not None:
        x = x + residual
    # Computed in float32 like the reference implementations: bf16 variance loses digits.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        out = (xf * (weight.float() + offset)).to(x.dtype)
    else:
        out = weight * xf.to(x.dtype)
    return out, x


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, head_dim: int,
               rotary_dim: int, is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference: new rotated q and k, computed in float32 and rounded to their dtype."""
    T = positions.shape[0]
    cs = cos_sin.index_select(0, positions)
    half = rotary_dim // 2
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xr = x[..., :rotary_dim].float()
        if is_neox_style:
            x1, x2 = xr.chunk(2, dim=-1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        if is_neox_style:
            out = torch.cat([o1, o2], dim=-1)
        else:
            out = torch.stack([o1, o2], dim=-1).flatten(-2)
        out = out.to(x.dtype)
        if rotary_dim < head_dim:
            out = torch.cat([out, x[..., rotary_dim:]], dim=-1)
        return out

    return rotate(q.reshape(T, -1, head_dim)).view(T, -1), rotate(k.reshape(T, -1, head_dim)).view(T, -1)


def act_and_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    """PyTorch reference: x = [gate | up] along the last dim -> act(gate) * up."""
    d = x.shape[-1] // 2
    gate, up = x[..., :d], x[..., d:]
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none") * up


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each last-dim row: (int8 values, float32 scales).

    scale = absmax / 127 and q = round_half_even(x / scale), all in float32 (an all-zero row gets
    scale 0 and zeros). The C++ reshape_and_cache_i8 produces exactly these values.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    s = scale.unsqueeze(-1)
    q = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    return q.round().clamp_(-127, 127).to(torch.int8), scale


def dequantize_kv_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 rows times their scales, in float32 (exactly what the kernels' load_i8 computes)."""
    return q.float() * scale.unsqueeze(-1)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_start: list[int],
    q_len: list[int],
    context_len: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Readable PyTorch reference of the paged-attention kernel, one sequence at a time, in float32.

    q: [T, Hq*D]; caches [slots, Hkv, D]. Sequence s owns rows q_start[s]..+q_len[s]; its queries
    sit at the last q_len[s] positions of its context_len[s] cached tokens. With `k_scale`/`v_scale`
    ([slots, Hkv]) the caches are int8 and are dequantized first.
    """
    if k_scale is not None:
        k_cache, v_cache = dequantize_kv_ref(k_cache, k_scale), dequantize_kv_ref(v_cache, v_scale)
    T = q.shape[0]
    out = torch.zeros(T, num_heads, head_dim, dtype=torch.float32)
    qf = q.reshape(T, num_heads, head_dim).float()
    rep = num_heads // num_kv_heads
    for s in range(len(q_start)):
        ctx, ql = context_len[s], q_len[s]
        pos = torch.arange(ctx)
        slots = torch.tensor(block_tables[s], dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        k = k_cache[slots].float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = v_cache[slots].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        rows = slice(q_start[s], q_start[s] + ql)
        scores = torch.matmul(qf[rows].transpose(0, 1), k.transpose(1, 2)) * scale  # [Hq, ql, ctx]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - ql, ctx)[:, None]
        visible = pos[None, :] <= q_pos
        if sliding_window:
            visible &= (q_pos - pos[None, :]) < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(0, 1)
    return out.reshape(T, num_heads * head_dim).to(q.dtype)


def bias_gelu_ref(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """gelu(x + bias), each step rounded to x's dtype."""
    return F.gelu(x + bias, approximate=approximate)


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None, x_bias: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + x_bias + residual) * weight + bias, each sum rounded to x's dtype."""
    if x_bias is not None:
        x = x + x_bias
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def encoder_attention_ref(qkv: torch.Tensor, seq_lens: list[int], num_heads: int, head_dim: int,
                          scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch reference of the encoder-attention kernel: (qkv + bias, rounded to its dtype) into
    one unmasked `scaled_dot_product_attention` per sequence, in float32, rounded to qkv's dtype.
    qkv: [T, 3 * H * D], sequences back to back."""
    qkv = qkv if bias is None else qkv + bias
    T, H, D = qkv.shape[0], num_heads, head_dim
    q, k, v = qkv.float().reshape(T, 3, H, D).permute(1, 2, 0, 3).unbind(0)  # [H, T, D] each
    out = torch.empty(T, H, D)
    start = 0
    for n in seq_lens:
        rows = slice(start, start + n)
        out[rows] = F.scaled_dot_product_attention(q[:, rows], k[:, rows], v[:, rows], scale=scale).transpose(0, 1)
        start += n
    return out.reshape(T, H * D).to(qkv.dtype)


def unpack_bf16_ref(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """PyTorch reference inverting `pack_bf16`: the bf16 weight [n, k] out of
    [ceil(n / 16), ceil(k / 2), 16, 2] blocks."""
    kp = -(-k // 2)
    p = packed.view(torch.bfloat16).reshape(-1, kp, 16, 2)
    return p.permute(0, 2, 1, 3).reshape(-1, kp * 2)[:n, :k].contiguous()


def gemm_bf16_ref(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """PyTorch reference of `gemm_bf16`: the float64 product of the bf16 values, rounded once."""
    w = unpack_bf16_ref(packed, n, k)
    return (x.double() @ w.double().t()).to(out_dtype)


def unpack_f32_ref(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """PyTorch reference inverting `pack_f32`: the float32 weight [n, k] out of
    [ceil(n / 16), ceil(k / 2), 2, 16] blocks."""
    kp = -(-k // 2)
    p = packed.reshape(-1, kp, 2, 16)
    return p.permute(0, 3, 1, 2).reshape(-1, kp * 2)[:n, :k].contiguous()


def gemm_f32_ref(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PyTorch reference of `gemm_f32`: the float64 product, rounded once."""
    return (x.double() @ unpack_f32_ref(packed, n, k).double().t()).to(out_dtype)


def fused_moe_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of `fused_moe`: token by token, expert by expert, in fp32 (w_gate_up
    [E, 2I, H], w_down [E, H, I])."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gate_up[e].float() @ x[t].float()
            g, u = gu.chunk(2)
            out[t] += weights[t, j] * (w_down[e].float() @ (F.silu(g) * u))
    return out


def quantize_act_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 per token and group of `group` columns: (codes [m, k], scales [m, k // group],
    group sums [m, k // group]). One scale per group, not per token, so an outlier channel only
    costs its own group precision."""
    xf = x.float().reshape(-1, x.shape[-1])
    m, k = xf.shape
    xg = xf.view(m, k // group, group)
    amax = xg.abs().amax(dim=-1)
    nz = amax > 0
    scale = torch.where(nz, amax / 127.0, torch.ones_like(amax))
    # NOTE: not `127.0 / amax`: PyTorch computes a scalar-by-tensor division as a reciprocal times
    # 127, one ulp off the IEEE quotient the kernels use, which flips rounding ties.
    inv = torch.where(nz, torch.full_like(amax, 127.0) / amax, torch.ones_like(amax))
    q = torch.round(xg * inv[..., None]).to(torch.int8)  # round half to even, as the kernels
    return q.view(m, k), scale, q.sum(dim=-1, dtype=torch.int32)


def qlinear_ref(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """What the kernels compute: int8 activations times the dequantized weight (with the
    kernels' scales, `kernel_scales`), in float64."""
    from armserve.quantization.formats import kernel_scales  # (the quantization package imports the kernels)

    q, scale, _ = quantize_act_ref(x, qt.group)
    xd = q.double() * scale.double().repeat_interleave(qt.group, dim=1)
    y = xd @ kernel_scales(qt).dequantize().double().T
    return y.to(x.dtype).reshape(*x.shape[:-1], qt.codes.shape[0])


def qgemm_dense_ref(x: torch.Tensor, qt: QuantizedTensor) -> torch.Tensor:
    """What `kernels.qgemm_dense` (the prefill path) computes: x times the weight dequantized with the
    kernels' scales and rounded to bf16, summed in float64."""
    from armserve.quantization.formats import kernel_scales

    w = kernel_scales(qt).dequantize().to(torch.bfloat16)
    return (x.double() @ w.double().T).to(x.dtype)


def qembedding_ref(ids: torch.Tensor, qt: QuantizedTensor, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """What `kernels.qembedding` computes: rows ids - start of the dequantized table `qt` (its own
    scales, float32) rounded to `dtype`, zero rows where ids - start is outside the table."""
    from armserve.quantization.formats import QuantizedTensor

    local = ids - start
    outside = (local < 0) | (local >= qt.codes.shape[0])
    r = local.masked_fill(outside, 0)
    rows = QuantizedTensor(qt.fmt, qt.codes[r], qt.scales[r], None if qt.szp is None else qt.szp[r], qt.group)
    return rows.dequantize().to(dtype).masked_fill_(outside.unsqueeze(-1), 0)


def gguf_embedding_ref(ids: torch.Tensor, table: GGUFRows, dtype: torch.dtype, start: int = 0) -> torch.Tensor:
    """What `kernels.gguf_embedding` computes: rows ids - start of the GGUF table, dequantized as the
    loader converts its blocks (float32), rounded to `dtype`; zero rows outside the table."""
    local = ids - start
    outside = (local < 0) | (local >= table.shape[0])
    rows = table.dequantize(local.masked_fill(outside, 0).numpy())
    return rows.to(dtype).masked_fill_(outside.unsqueeze(-1), 0)
