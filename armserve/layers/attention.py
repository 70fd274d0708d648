"""Paged attention over the KV cache for a mixed batch of decodes and prefill chunks.

The model runner publishes one `AttentionMetadata` per step (`set_attention_metadata`), so model
code stays `forward(positions, hidden_states)`. Token rows of a step are laid out as

    [ decode tokens (one per request) | prefill chunk of req A | prefill chunk of req B | ... ]

A token's cache slot is `block_id * block_size + offset` (see kv_cache_manager.py). One layer's
cache is laid out for the attention kernels (drawn in kernels/attention.py, int8 scales included);
`cache_rows` / `write_cache_rows` read and write rows by slot whatever the layout, so nothing else
needs to know it.

This is the PyTorch path: it gathers each request's context from its blocks and calls
`scaled_dot_product_attention`. The C++ kernels implement the same interface.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from armserve import kernels
from armserve.kernels import KEY_TILE, kv_cache_shapes  # the kernels' cache layout
from armserve.kernels.reference import dequantize_kv_ref, quantize_kv_ref


def _slot_index(cache: torch.Tensor, slots: torch.Tensor, key: bool | None) -> tuple:
    """Index tuple selecting the rows of `slots` in a K (`key`) or V cache, or scales (None)."""
    paired = cache.dtype == torch.bfloat16
    if key is None:  # scales [blocks, heads, bs]
        bs = cache.shape[2]
        return (slots // bs, slice(None), slots % bs)
    if key:  # [blocks, heads, tiles, hd(/2), KEY_TILE(, 2)]
        bs = cache.shape[2] * KEY_TILE
        o = slots % bs
        return (slots // bs, slice(None), o // KEY_TILE, slice(None), o % KEY_TILE) + ((slice(None),) if paired else ())
    if paired:  # V [blocks, heads, bs / 2, hd, 2]
        bs = cache.shape[2] * 2
        o = slots % bs
        return (slots // bs, slice(None), o // 2, slice(None), o % 2)
    bs = cache.shape[2]  # V [blocks, heads, bs, hd]
    return (slots // bs, slice(None), slots % bs)


def cache_rows(cache: torch.Tensor, slots: torch.Tensor, key: bool | None) -> torch.Tensor:
    """Rows [len(slots), num_kv_heads, head_dim] of a K (`key`) or V cache, or scales [len(slots),
    num_kv_heads] (`key` None)."""
    rows = cache[_slot_index(cache, slots, key)]
    return rows.flatten(2) if key and cache.dim() == 6 else rows


def write_cache_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, key: bool | None) -> None:
    """Store rows [len(slots), num_kv_heads, head_dim] (or scales) at `slots` (see `cache_rows`)."""
    if key and cache.dim() == 6:
        rows = rows.unflatten(2, (-1, 2))
    cache[_slot_index(cache, slots, key)] = rows


def cache_from_rows(rows: torch.Tensor, block_size: int, key: bool | None) -> torch.Tensor:
    """A K (`key`) or V cache, or a scale tensor (`key` None, 2-d rows), holding `rows` [slots, ...]
    at their slot index: for tests and benchmarks that think of a cache as rows."""
    slots = rows.shape[0]
    nb = slots // block_size
    if key is None:
        out = torch.empty(nb, rows.shape[1], block_size, dtype=rows.dtype)
    else:
        k_shape, v_shape, _ = kv_cache_shapes(nb, block_size, rows.shape[1], rows.shape[2], rows.dtype)
        out = torch.empty(k_shape if key else v_shape, dtype=rows.dtype)
    write_cache_rows(out, torch.arange(slots), rows, key)
    return out


@dataclass
class PrefillChunk:
    """One request's chunk of new tokens that attends to its cached context plus itself."""

    q_start: int  # first row of this chunk in the step's token rows
    q_len: int
    context_len: int  # tokens in the cache after this step (cached prefix + chunk)
    slots: torch.Tensor  # [context_len] cache slots of every context token, in order
    positions: torch.Tensor  # [q_len] positions of the chunk's tokens
    fresh: bool  # no cached prefix: K/V can be taken from this step's rows directly


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token is written to
    num_decodes: int
    # C++ kernel path: the whole step in one struct (see kernels.make_attn_batch); None on the
    # PyTorch path, which uses the fields below instead.
    kernel_batch: object | None = None
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context] (padded with slot 0)
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Masks depend on the sliding window, so they are built lazily once per window size
    # and shared by every layer of the step.
    _mask_cache: dict = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("d", window)
        m = self._mask_cache.get(key)
        if m is None:
            lens = self.decode_context_lens
            cols = torch.arange(self.decode_slots.shape[1])
            m = cols[None, :] < lens[:, None]
            if window is not None:
                # the query sits at position len-1; keys must satisfy q - k < window
                m &= cols[None, :] > (lens[:, None] - 1 - window)
            m = m[:, None, None, :]  # [B, 1, 1, L]
            self._mask_cache[key] = m
        return m

    def decode_padding(self) -> torch.Tensor | None:
        """[B, 1, L, 1]: True past each sequence's context, where the padded gather reads cache rows
        nobody wrote (None when no sequence is shorter than the longest)."""
        key = ("pad",)
        if key not in self._mask_cache:
            pad = ~self.decode_mask(None).transpose(-1, -2)
            self._mask_cache[key] = pad if bool(pad.any()) else None
        return self._mask_cache[key]

    def prefill_mask(self, idx: int, window: int | None) -> torch.Tensor | None:
        key = ("p", idx, window)
        if key in self._mask_cache:
            return self._mask_cache[key]
        p = self.prefills[idx]
        k_pos = torch.arange(p.context_len)
        q_pos = p.positions[:, None]
        m = k_pos[None, :] <= q_pos
        if window is not None:
            m &= (q_pos - k_pos[None, :]) < window
        self._mask_cache[key] = m
        return m


    def padded_prefills(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of whole sequences and no cache (the pooling runner: each prefill fresh, from
        position 0, back to back) laid out side by side in a [B, L] grid: (the grid cell of each
        token row [T], the mask [B, 1, L, L]: causal, within the sequence and the `window`). A
        padding query row sees every key (its output is dropped, and a row of no key is NaN)."""
        key = ("grid", window)
        if key not in self._mask_cache:
            lens = torch.tensor([p.q_len for p in self.prefills])
            cols = torch.arange(int(lens.max()))
            valid = cols[None, :] < lens[:, None]  # [B, L]
            m = (cols[None, :] <= cols[:, None])[None] & valid[:, None, :]  # [B, Lq, Lk]
            if window is not None:
                m &= (cols[:, None] - cols[None, :]) < window
            m |= ~valid[:, :, None]
            self._mask_cache[key] = (valid.reshape(-1).nonzero().squeeze(1), m[:, None])
        return self._mask_cache[key]


_METADATA: AttentionMetadata | None = None


def set_attention_metadata(md: AttentionMetadata | None) -> None:
    global _METADATA
    _METADATA = md


def get_attention_metadata() -> AttentionMetadata:
    assert _METADATA is not None, "attention called outside a model-runner step"
    return _METADATA


class Attention(nn.Module):
    """Writes this step's K/V into the paged cache, then attends. GQA/MQA by head grouping."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # Bound by the model runner after the cache is allocated; scales only for an int8 cache.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # Expected RMS of each key channel [Hkv*D], estimated from the weights at load (models
        # that know their key projection set it), and the factors derived from it for an int8
        # cache: see `enable_key_smoothing`.
        self.key_channel_rms: torch.Tensor | None = None
        self.q_mul: torch.Tensor | None = None
        self.k_mul: torch.Tensor | None = None

    def enable_key_smoothing(self, on: bool = True) -> None:
        """Flatten outlier key channels before they are quantized to int8 (an int8 cache binds this).

        Some models (Qwen2.5's large k_proj bias) have a few key channels tens of times larger than
        the rest; with one int8 scale per (token, head) those channels decide the step size and
        every other channel loses its precision (+3.3% perplexity on Qwen2.5-Coder-0.5B). Each
        channel c is divided by s_c = max(1, rms_c / mean rms of its head) and the matching query
        channels multiplied by s_c, so q.k, and the attention, are unchanged in exact arithmetic
        (SmoothQuant's migration, with every difficulty moved to the unquantized side). The model
        makes the two channels of each rotary pair share s_c, so the scaling commutes with RoPE.
        """
        if not on or self.key_channel_rms is None:
            self.q_mul = self.k_mul = None
            return
        rms = self.key_channel_rms.float().view(self.num_kv_heads, self.head_dim)
        factor = (rms / rms.mean(dim=1, keepdim=True).clamp(min=1e-12)).clamp(min=1.0)
        self.k_mul = (1.0 / factor).reshape(-1)
        self.q_mul = factor.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0).reshape(-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, Hq*D]; k, v: [T, Hkv*D] -> [T, Hq*D]."""
        md = get_attention_metadata()
        quantized = self.k_scale is not None
        if self.k_mul is not None:
            # in place: q and k are this layer's own (rotary) outputs, used only here
            if md.kernel_batch is not None and kernels.use_kernel("small", q):
                q, k = kernels.mul_cols(q, self.q_mul), kernels.mul_cols(k, self.k_mul)
            else:
                q = q.mul_(self.q_mul)
                k = k.mul_(self.k_mul)
        if md.kernel_batch is not None:
            if quantized:
                kernels.reshape_and_cache_i8(k, v, self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                                         md.slot_mapping)
                return kernels.paged_attention_i8(
                    q, self.k_cache, self.v_cache, self.k_scale, self.v_scale, md.kernel_batch, self.num_heads,
                    self.num_kv_heads, self.head_dim, self.scale, self.sliding_window, self.logit_softcap,
                )
            kernels.reshape_and_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
            return kernels.paged_attention(
                q, self.k_cache, self.v_cache, md.kernel_batch, self.num_heads, self.num_kv_heads,
                self.head_dim, self.scale, self.sliding_window, self.logit_softcap,
            )
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None:
            # No cache bound (the pooling runner, models/adapters.py): each sequence is whole in
            # this step, so every prefill is fresh and attends to this step's own rows; several
            # go through one call over a padded grid rather than one call each.
            assert not md.num_decodes and all(p.fresh for p in md.prefills), "attention without a KV cache"
            if len(md.prefills) > 1 and self.logit_softcap is None:
                return self._padded(q, k, v, md)
        elif quantized:
            kq, ks = quantize_kv_ref(k)
            vq, vs = quantize_kv_ref(v)
            write_cache_rows(k_cache, md.slot_mapping, kq, key=True)
            write_cache_rows(v_cache, md.slot_mapping, vq, key=False)
            write_cache_rows(self.k_scale, md.slot_mapping, ks, key=None)
            write_cache_rows(self.v_scale, md.slot_mapping, vs, key=None)
            # NOTE: a fresh prefill attends to what the cache holds (as the kernel does), not to the
            # exact k/v: otherwise the tokens would depend on how a prompt was chunked.
            k, v = dequantize_kv_ref(kq, ks).to(q.dtype), dequantize_kv_ref(vq, vs).to(q.dtype)
        else:
            write_cache_rows(k_cache, md.slot_mapping, k.to(k_cache.dtype), key=True)
            write_cache_rows(v_cache, md.slot_mapping, v.to(v_cache.dtype), key=False)

        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        nd = md.num_decodes
        if nd:
            kk = self._gather(k_cache, self.k_scale, md.decode_slots, q.dtype, True).transpose(1, 2)  # [B, Hkv, L, D]
            vv = self._gather(v_cache, self.v_scale, md.decode_slots, q.dtype, False).transpose(1, 2)
            # Padding rows hold whatever the (torch.empty) cache held: the mask gives them weight 0,
            # but 0 * NaN is NaN, so clear them first.
            pad = md.decode_padding()
            if pad is not None:
                kk, vv = kk.masked_fill(pad, 0.0), vv.masked_fill(pad, 0.0)
            qq = q[:nd].unsqueeze(2)  # [B, Hq, 1, D]
            o = self._sdpa(qq, kk, vv, md.decode_mask(self.sliding_window), gqa)
            out[:nd] = o.squeeze(2)
        for i, p in enumerate(md.prefills):
            rows = slice(p.q_start, p.q_start + p.q_len)
            qq = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
            if p.fresh:
                kk, vv = k[rows], v[rows]
            else:
                kk = self._gather(k_cache, self.k_scale, p.slots, q.dtype, True)
                vv = self._gather(v_cache, self.v_scale, p.slots, q.dtype, False)
            kk = kk.transpose(0, 1).unsqueeze(0)
            vv = vv.transpose(0, 1).unsqueeze(0)
            if p.fresh and self.sliding_window is None and self.logit_softcap is None:
                o = F.scaled_dot_product_attention(
                    qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=gqa
                )
            else:
                o = self._sdpa(qq, kk, vv, md.prefill_mask(i, self.sliding_window), gqa)
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out.view(T, self.num_heads * self.head_dim)

    def _padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Every sequence of a cache-less step in one SDPA call (`padded_prefills`)."""
        index, mask = md.padded_prefills(self.sliding_window)
        B, L, D = mask.shape[0], mask.shape[-1], self.head_dim

        def grid(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D], padding rows zero
            g = x.new_zeros(B * L, x.shape[1], D)
            g.index_copy_(0, index, x)
            return g.view(B, L, x.shape[1], D).transpose(1, 2)

        o = F.scaled_dot_product_attention(grid(q), grid(k), grid(v), attn_mask=mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o.transpose(1, 2).reshape(B * L, -1).index_select(0, index)

    @staticmethod
    def _gather(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
                dtype: torch.dtype, key: bool) -> torch.Tensor:
        """K (`key`) or V cache rows at `slots` in `dtype`, dequantized when the cache is int8."""
        shape = slots.shape
        flat = slots.reshape(-1)
        if scale is None:
            rows = cache_rows(cache, flat, key).to(dtype)
        else:
            rows = dequantize_kv_ref(cache_rows(cache, flat, key), cache_rows(scale, flat, None)).to(dtype)
        return rows.reshape(*shape, *rows.shape[1:])

    def _sdpa(self, q, k, v, mask, gqa: bool) -> torch.Tensor:
        if self.logit_softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        # Gemma-2 style soft-capped scores: no fused kernel for that, so spell it out.
        if gqa:
            rep = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        s = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        s = torch.tanh(s / self.logit_softcap) * self.logit_softcap
        s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)


def key_channel_rms(w_k: torch.Tensor, b_k: torch.Tensor | None, norm_weight: torch.Tensor) -> torch.Tensor:
    """Expected RMS of each key channel, from the weights alone: k = W_k (n * gamma) + b with n
    the RMS-normalised hidden state (unit mean square), taken as uncorrelated across dims, gives
    E[k_c^2] = ||W_k[c] * gamma||^2 + b_c^2. Crude, but it finds bias- and weight-driven outlier
    channels, which is all key smoothing needs."""
    ms = (w_k.float() * norm_weight.float()).pow(2).sum(dim=1)
    if b_k is not None:
        ms = ms + b_k.float().pow(2)
    return ms.sqrt()

