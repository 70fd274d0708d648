"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged latent KV cache.

MLA compresses each token's keys and values into one latent vector c (kv_lora_rank wide, after
kv_a_layernorm) plus one rotary key part k_pe shared by all heads (qk_rope_head_dim wide). Head
h's key and value are up-projections of c:

    k_h = [W_UK[h] c | k_pe]          W_UK [heads, qk_nope_head_dim, kv_lora_rank]
    v_h = W_UV[h] c                   W_UV [heads, v_head_dim, kv_lora_rank]

so the cache keeps only the row [c | k_pe] per token per layer, in the block layout of the
scheduler's slots (kv_cache_manager.py):

    cache  [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]    cache dtype
    scales [num_blocks, block_size, 2]    float32, int8 cache only: c's scale, k_pe's scale

(c and k_pe are quantized separately: k_pe is not normalised and its range differs from c's.)

Decode runs absorbed: q_nope . W_UK[h] c = (W_UK[h]^T q_nope) . c, so each head's query is moved
into the latent space once and every head attends to the same cached rows, MQA with one "head"
of width kv_lora_rank + rope; the weighted sum of latents is moved out with W_UV[h] afterwards.
Nothing per head is ever built from the context. Prefill runs expanded: the chunk's context is
up-projected into per-head keys and values once, and attended to as ordinary multi-head
attention (cheaper when many queries share the context). Both compute the same function; the
tests hold them to each other (`mla_attention_ref`).

This is the PyTorch path (gather by slot, masked softmax through scaled_dot_product_attention);
the C++ attention kernels assume one head_dim for K and V and per-head rows, so they are not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from armserve.kernels.reference import dequantize_kv_ref, quantize_kv_ref
from armserve.layers.attention import get_attention_metadata


class MLAAttention(nn.Module):
    """Writes this step's latent rows into the paged cache, then attends (absorbed for decode
    rows, expanded for prefill chunks). `forward(q_nope, q_pe, latent, k_pe) -> [T, heads * v]`."""

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int,
                 scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank, self.rope_dim, self.nope_dim, self.v_dim = kv_lora_rank, rope_dim, nope_dim, v_dim
        self.latent_dim = kv_lora_rank + rope_dim  # values cached per token (the runner reads this)
        self.scale = scale
        # Set by `set_kv_b` after loading: W_UK [H, nope, R] and W_UV^T [H, R, v].
        self.w_uk: torch.Tensor | None = None
        self.w_uv_t: torch.Tensor | None = None
        # Bound by the model runner after the cache is allocated; scales only for an int8 cache.
        self.kv_cache: torch.Tensor | None = None
        self.kv_scale: torch.Tensor | None = None

    def set_kv_b(self, w_kv_b: torch.Tensor) -> None:
        """Split kv_b_proj's weight [H * (nope + v), R] into the two up-projections."""
        w = w_kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()
        self.w_uv_t = w[:, self.nope_dim:].transpose(1, 2).contiguous()

    # ---- cache -------------------------------------------------------------------------------

    def _write(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Store rows [T, R + P] at `slots`; returns them as the cache holds them (dequantized)."""
        flat = self.kv_cache.view(-1, self.latent_dim)
        if self.kv_scale is None:
            flat[slots] = rows.to(flat.dtype)
            return rows
        latent, k_pe = rows.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        (q_lat, s_lat), (q_pe, s_pe) = quantize_kv_ref(latent), quantize_kv_ref(k_pe)
        flat[slots] = torch.cat([q_lat, q_pe], dim=-1)
        self.kv_scale.view(-1, 2)[slots] = torch.stack([s_lat, s_pe], dim=-1)
        return self._dequantize(flat[slots], self.kv_scale.view(-1, 2)[slots]).to(rows.dtype)

    def _dequantize(self, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        r = self.kv_lora_rank
        return torch.cat([dequantize_kv_ref(q[..., :r], s[..., 0]), dequantize_kv_ref(q[..., r:], s[..., 1])], dim=-1)

    def _gather(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cached rows [*slots.shape, R + P] in `dtype`."""
        flat = slots.reshape(-1)
        rows = self.kv_cache.view(-1, self.latent_dim).index_select(0, flat)
        if self.kv_scale is not None:
            rows = self._dequantize(rows, self.kv_scale.view(-1, 2).index_select(0, flat))
        return rows.to(dtype).view(*slots.shape, self.latent_dim)

    # ---- attention ---------------------------------------------------------------------------

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
                ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, P] (rotated); latent [T, R] (normalised), k_pe [T, P]
        (rotated) -> [T, H * v]."""
        md = get_attention_metadata()
        T = q_nope.shape[0]
        rows = self._write(torch.cat([latent, k_pe], dim=-1), md.slot_mapping)
        out = torch.empty(T, self.num_heads, self.v_dim, dtype=q_nope.dtype)
        nd = md.num_decodes
        if nd:
            kv = self._gather(md.decode_slots, q_nope.dtype)  # [B, L, R + P]
            pad = md.decode_padding()
            if pad is not None:  # rows nobody wrote: weight 0 in the mask, but 0 * NaN is NaN
                kv = kv.masked_fill(pad[:, 0], 0.0)
            out[:nd] = self.absorbed(q_nope[:nd], q_pe[:nd], kv, md.decode_mask(None)[:, 0])
        for i, p in enumerate(md.prefills):
            r = slice(p.q_start, p.q_start + p.q_len)
            kv = rows[r] if p.fresh else self._gather(p.slots, q_nope.dtype)
            out[r] = self.expanded(q_nope[r], q_pe[r], kv, None if p.fresh else md.prefill_mask(i, None))
        return out.view(T, self.num_heads * self.v_dim)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
        """Decode: B queries (one token each) against their own contexts kv [B, L, R + P] with
        mask [B, 1, L] (True = visible) -> [B, H, v]. All heads share the latent rows (MQA)."""
        # per head: q_lat[b, h] = W_UK[h]^T q_nope[b, h]   ([H, B, nope] @ [H, nope, R])
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk.to(q_nope.dtype)).transpose(0, 1)
        q = torch.cat([q_lat, q_pe], dim=-1)  # [B, H, R + P]: the heads are the "queries" of one kv head
        # NOTE: two bmm's and a float32 softmax, not scaled_dot_product_attention: with a value
        # narrower than the key and a mask, SDPA takes its slow path on CPU (~3x slower in bf16).
        scores = torch.bmm(q, kv.transpose(1, 2)).float().mul_(self.scale)  # [B, H, L]
        probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1).to(kv.dtype)
        o_lat = torch.bmm(probs, kv[..., : self.kv_lora_rank])  # [B, H, R]
        # per head: out[b, h] = W_UV[h] o_lat[b, h]   ([H, B, R] @ [H, R, v])
        return torch.bmm(o_lat.transpose(0, 1), self.w_uv_t.to(q_nope.dtype)).transpose(0, 1)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None
                 ) -> torch.Tensor:
        """Prefill: one request's Lq queries (the last Lq positions of its context) against its
        context kv [L, R + P], causal (`mask` None: Lq == L) or with mask [Lq, L] -> [Lq, H, v]."""
        L, H = kv.shape[0], self.num_heads
        latent, k_pe = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        dtype = q_nope.dtype
        k_nope = torch.matmul(latent, self.w_uk.to(dtype).transpose(1, 2))  # [H, L, nope]
        v = torch.matmul(latent, self.w_uv_t.to(dtype))  # [H, L, v]
        k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(H, L, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Lq, nope + P]
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1)


def mla_attention_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, w_kv_b: torch.Tensor,
                      kv_lora_rank: int, scale: float, q_positions: torch.Tensor) -> torch.Tensor:
    """Readable reference, in float32, as transformers computes MLA: every context row
    up-projected into per-head keys and values, then causal softmax attention per head.
    q_nope [Lq, H, nope], q_pe [Lq, H, P], kv [L, R + P], w_kv_b [H * (nope + v), R];
    q_positions [Lq] (each query sees context rows 0..its position) -> [Lq, H, v]."""
    H, nope = q_nope.shape[1], q_nope.shape[2]
    latent, k_pe = kv.float().split([kv_lora_rank, kv.shape[1] - kv_lora_rank], dim=-1)
    kvb = (latent @ w_kv_b.float().T).view(kv.shape[0], H, -1)  # [L, H, nope + v]
    k = torch.cat([kvb[..., :nope], k_pe[:, None].expand(-1, H, -1)], dim=-1)
    v = kvb[..., nope:]
    q = torch.cat([q_nope, q_pe], dim=-1).float()
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.arange(kv.shape[0])[None, :] <= q_positions[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
