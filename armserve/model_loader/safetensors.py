"""Hugging Face folders: safetensors weights (one file or shards with their index, else
pytorch_model*.bin), and the int4 / int8 weights that `armserve quantize` writes into them
(quantization/checkpoint.py)."""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Iterator

import torch

from armserve.model_source import ModelLoadError
from armserve.quantization import QuantizedTensor, checkpoint


def iter_weights(folder: str, quantized_config: bool = False, dequantize: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The folder's tensors (safetensors, with their index if sharded, else pytorch_model*.bin);
    `armserve quantize` weights as QuantizedTensors (float with `dequantize`)."""
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
            with _SafetensorsFile(path) as f:
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


# safetensors dtype names -> torch dtypes
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class _SafetensorsFile:
    """A safetensors file read tensor by tensor straight into fresh tensors (the format: an 8-byte
    little-endian header length, a JSON header of name -> dtype, shape, data offsets, the data).

    NOTE: not `safetensors.safe_open`, which maps the whole file: every page a load reads then
    counts in the process's resident memory until the file is closed, on top of the copies the
    model keeps (the kernels read their own packed layouts), so a load peaked near twice the
    weights. Read with plain reads, the peak is the weights plus the tensor in flight.
    """

    def __init__(self, path: str) -> None:
        self.file = open(path, "rb", buffering=0)
        try:
            size = os.fstat(self.file.fileno()).st_size
            head = self.file.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError("not a safetensors file (bad header length)")
            header = json.loads(self.file.read(n))
            header.pop("__metadata__", None)
            for name, info in header.items():
                begin, end = info["data_offsets"]
                if info["dtype"] not in _DTYPES or not 0 <= begin <= end or 8 + n + end > size:
                    raise ValueError(f"tensor {name}: unsupported dtype {info['dtype']} or data past the end of the file")
        except Exception:
            self.file.close()
            raise
        self.header, self.base = header, 8 + n

    def __enter__(self) -> _SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return sorted(self.header)

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self.header[name]
        begin, end = info["data_offsets"]
        t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
        raw = t.reshape(-1).view(torch.uint8).numpy()
        if raw.nbytes != end - begin:
            raise ValueError(f"tensor {name}: {end - begin} bytes of data for shape {info['shape']} {info['dtype']}")
        view, done = memoryview(raw), 0
        self.file.seek(self.base + begin)
        while done < raw.nbytes:  # (one read returns at most ~2 GiB on Linux)
            got = self.file.readinto(view[done:])
            if not got:
                raise ValueError(f"tensor {name}: the file ends inside its data")
            done += got
        return t
