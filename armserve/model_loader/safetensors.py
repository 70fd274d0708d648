"""Hugging Face folders: safetensors weights (one file or shards with their index, else
pytorch_model*.bin), and the int4 / int8 weights that `armserve quantize` writes into them
(quantization/checkpoint.py)."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch

from armserve.model_source import ModelLoadError
from armserve.quantization import QuantizedTensor, checkpoint


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
                        prefix = name[: -len(".qweight")]
                        if not quantized_config:
                            raise ModelLoadError(f"{prefix}.qweight found but config.json has no armserve "
                                                 "quantization_config")
                        qt = checkpoint.decode(f.get_tensor, prefix, keys)
                        yield prefix + ".weight", (qt.dequantize() if dequantize else qt)
                    elif name.endswith((".scales", ".zeros")) and name.rsplit(".", 1)[0] + ".qweight" in keys:
                        continue  # read with its .qweight
                    else:
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # SafetensorError, OSError on truncated files
            raise ModelLoadError(f"cannot read weight file {path} (corrupt or truncated?): {e}") from e
