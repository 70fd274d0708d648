"""The int4 / int8 weights of an `armserve quantize` checkpoint, both ways: the tensors the command
writes for a quantized weight (`encode`), the QuantizedTensor the loader reads back (`decode`), and
the `quantization_config` that marks such a folder.

An int4 weight `{name}.weight` [n, k] in groups of g columns is stored as
    {name}.qweight  uint8 [n, k / 2]   two 4-bit codes per byte, low nibble = even column
    {name}.scales   float16 [n, k / g]  one scale per group of g columns
    {name}.zeros    float16 [n, k / g]  zero point in code units (asymmetric only; symmetric uses 8)
so that w = scale * (code - zero); an int8 one (the LM head by default) as
    {name}.qweight  int8 [n, k]        symmetric codes, w = scale * code
    {name}.scales   float16 [n, k / g]
The group size follows from the shapes (per-channel layers have one group per row).
"""

from __future__ import annotations

from typing import Callable

import torch

from armserve.quantization.formats import QuantizedTensor


def armserve_quantization(config) -> dict | None:
    """The quantization_config written by `armserve quantize`, if this checkpoint has one."""
    q = getattr(config, "quantization_config", None)
    if q is not None and not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else None
    return q if q and q.get("quant_method") == "armserve" else None


def encode(prefix: str, qt: QuantizedTensor, symmetric: bool) -> dict[str, torch.Tensor]:
    """The tensors stored for weight `{prefix}.weight` (`symmetric`: int4 without zero points)."""
    # (w5 / w6 come from GGUF Q5_0 / Q6_K blocks only; `armserve quantize` writes w4 / w8)
    if qt.fmt not in ("w4", "w8"):
        raise ValueError(f"cannot store a {qt.fmt} weight in an armserve checkpoint (w4 or w8 only)")
    if qt.fmt == "w8":  # int8 codes are stored as they are (a .qweight of dtype int8 marks the format)
        return {prefix + ".qweight": qt.codes.contiguous(), prefix + ".scales": qt.scales.to(torch.float16)}
    out = {
        prefix + ".qweight": (qt.codes[:, 0::2] | (qt.codes[:, 1::2] << 4)).contiguous(),
        prefix + ".scales": qt.scales.to(torch.float16),
    }
    if not symmetric:
        out[prefix + ".zeros"] = (qt.szp / qt.scales).to(torch.float16)
    return out


def decode(get_tensor: Callable[[str], torch.Tensor], prefix: str, keys: set[str]) -> QuantizedTensor:
    """The weight `encode` stored under `prefix`, read through `get_tensor(name)` from a file
    holding the tensors `keys`."""
    packed = get_tensor(prefix + ".qweight")
    scales = get_tensor(prefix + ".scales").float()
    if packed.dtype == torch.int8:
        return QuantizedTensor("w8", packed.contiguous(), scales, None, packed.shape[1] // scales.shape[1])
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    if prefix + ".zeros" in keys:
        szp = scales * get_tensor(prefix + ".zeros").float()
    else:
        szp = scales * 8.0  # symmetric: codes are q + 8
    return QuantizedTensor("w4", codes.contiguous(), scales, szp, codes.shape[1] // scales.shape[1])
