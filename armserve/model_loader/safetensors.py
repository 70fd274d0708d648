"""Hugging Face folders: safetensors weights (one file or shards with their index, else
pytorch_model*.bin), and the int4 / int8 weights that `armserve quantize` writes into them."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch

from armserve.layers.quantized_linear import QuantizedTensor
from armserve.model_loader.source import ModelLoadError


def _read_quantized(f, prefix: str, keys: set[str], quantized_config: bool, dequantize: bool):
    """An `armserve quantize` weight: nibble-packed int4 codes + scales (+ zero points), or int8
    codes (a .qweight of dtype int8, symmetric) + scales."""
    if not quantized_config:
        raise ModelLoadError(f"{prefix}.qweight found but config.json has no armserve quantization_config")
    packed = f.get_tensor(prefix + ".qweight")
    if packed.dtype == torch.int8:
        scales = f.get_tensor(prefix + ".scales").float()
        qt = QuantizedTensor("w8", packed.contiguous(), scales, None, packed.shape[1] // scales.shape[1])
        return prefix + ".weight", (qt.dequantize() if dequantize else qt)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    scales = f.get_tensor(prefix + ".scales").float()
    if prefix + ".zeros" in keys:
        szp = scales * f.get_tensor(prefix + ".zeros").float()
    else:
        szp = scales * 8.0  # symmetric: codes are q + 8
    # NOTE: the group size follows from the shapes (per-channel layers have one group per row).
    qt = QuantizedTensor("w4", codes.contiguous(), scales, szp, codes.shape[1] // scales.shape[1])
    return prefix + ".weight", (qt.dequantize() if dequantize else qt)


def iter_weights(folder: str, quantized_config: bool = False, dequantize: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The folder's tensors (safetensors, with their index if sharded, else pytorch_model*.bin);
    `armserve quantize` weights as QuantizedTensors (float with `dequantize`)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                wanted = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        missing = [w for w in wanted if not os.path.isfile(os.path.join(folder, w))]
        if missing:
            raise ModelLoadError(f"weight shards listed in {index} are missing: {', '.join(missing)}")
        files = [os.path.join(folder, w) for w in wanted]
    if not files:
        bins = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
        if not bins:
            raise ModelLoadError(f"model folder {folder} has no *.safetensors (or pytorch_model*.bin) weights")
        for b in bins:
            try:
                state = torch.load(b, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ModelLoadError(f"cannot read weight file {b}: {e}") from e
            yield from state.items()
        return
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                keys = set(f.keys())
                for name in f.keys():
                    if name.endswith(".qweight"):
                        yield _read_quantized(f, name[: -len(".qweight")], keys, quantized_config, dequantize)
                    elif name.endswith((".scales", ".zeros")) and name.rsplit(".", 1)[0] + ".qweight" in keys:
                        continue  # read with its .qweight
                    else:
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError, OSError on truncated files
            raise ModelLoadError(f"cannot read weight file {path} (corrupt or truncated?): {e}") from e
