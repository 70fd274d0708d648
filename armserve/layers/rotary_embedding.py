"""Rotary position embedding with a precomputed cos/sin table (default, linear, llama3 and yarn scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from armserve import kernels


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope settings of a transformers config, old (`rope_theta` + `rope_scaling`) or new
    (`rope_parameters`) style, as one flat dict with at least `rope_type` and `rope_theta`; with
    `layer_type`, that kind of layer's own entry where the config has one per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if layer_type is not None and isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
        out["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    out["rope_type"] = out.get("rope_type") or out.get("type") or "default"
    return out


def _inv_freq(rot_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, rot_dim, params)
    raise ValueError(
        f"rope_type {kind!r} is not supported; supported: default, linear, llama3, yarn"
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, rot_dim: int, params: dict) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times kept, a linear
    ramp between (transformers' _compute_yarn_parameters)."""
    base = float(params["rope_theta"])
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return rot_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(params: dict) -> float:
    """What YaRN multiplies cos and sin by (1 for every other kind): `attention_factor`, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (DeepSeek), else mscale(factor)."""
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor, m, m_all = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return yarn_mscale(factor, m) / yarn_mscale(factor, m_all)
    return yarn_mscale(factor)


_COS_SIN: dict[tuple, torch.Tensor] = {}


def _cos_sin(rotary_dim: int, max_position: int, params: dict) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos and sin of each half. One table per setting, shared
    by every layer that uses it (Gemma 3 270M: 32k positions x 256 dims is 32 MiB a table)."""
    key = (rotary_dim, max_position, repr(sorted(params.items())))
    table = _COS_SIN.get(key)
    if table is None:
        inv_freq = _inv_freq(rotary_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        factor = rope_attention_factor(params)
        _COS_SIN[key] = table = table * factor if factor != 1.0 else table
    return table


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k in place of a copy.

    `is_neox_style` rotates the two halves of each head (Hugging Face layout); otherwise
    adjacent pairs (GPT-J layout).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        params: dict,
        rotary_dim: int | None = None,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.is_neox_style = is_neox_style
        self.register_buffer("cos_sin", _cos_sin(self.rotary_dim, max_position, params), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq*D]; k: [T, Hkv*D] (views into a fused qkv are rotated in place)."""
        return kernels.rotary(positions, q, k, self.cos_sin, self.head_dim, self.rotary_dim, self.is_neox_style)


def trim_rope_tables(model: nn.Module, positions: int) -> None:
    """Keep the first `positions` rows of each RotaryEmbedding's table in `model`: a table holds
    max_position_embeddings rows (Llama 3.x: 131,072 x 128 float32, 64 MiB), and an engine never
    rotates past its max_model_len (plus speculative rows: EngineConfig.positions_reached). Layers
    sharing a table share its trimmed copy. Call after loading, before any step records the
    tables' addresses."""
    trimmed: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if isinstance(m, RotaryEmbedding) and m.cos_sin.shape[0] > positions:
            key = m.cos_sin.data_ptr()
            if key not in trimmed:
                trimmed[key] = m.cos_sin[:positions].clone()
            m.cos_sin = trimmed[key]
    # (the cache's full tables: dropped, so that they go)
    for k in [k for k, t in _COS_SIN.items() if t.data_ptr() in trimmed]:
        del _COS_SIN[k]
