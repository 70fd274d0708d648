"""An engine's memory plan, made from the checkpoint's metadata before any weight is read: weights by
kind (dense, quantized, embedding, head) as the engine holds them, the KV cache (bytes per token,
its space and the tokens that fit), a runtime estimate, and their total against what the machine
has available. It also sizes the KV cache when none is given (config.py:
DEFAULT_KV_CACHE_MEMORY_FRACTION) and refuses a given one that does not fit.

`armserve info --model M` prints it; every engine logs it as it starts loading.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from dataclasses import dataclass, field

import torch

from armserve.config import DEFAULT_KV_CACHE_MEMORY_FRACTION, ConfigError, EngineConfig
from armserve.engine.model_runner import kv_cache_bytes_per_token
from armserve.memory import available_memory, numa_node_count, total_memory
from armserve.model_source import ModelSource
from armserve.quantization.gguf import GGUF_ROW_TYPES

GiB = 1 << 30
MiB = 1 << 20

# The engine process before weights and KV cache: the interpreter, torch, the kernel library, the
# tokenizer and the step graphs. Measured here (x86_64, torch 2.13): 250-300 MiB resident.
RUNTIME_BASE_BYTES = 300 * MiB

WEIGHT_KINDS = ("dense", "quantized", "embedding", "head")

# GGUF tensor types held as they are stored (the rest are float and become the model dtype).
_GGUF_FLOAT = {"F32", "F16", "BF16", "F64"}
# safetensors dtypes of quantized weights (`armserve quantize` output: packed codes and their scales).
_INT_DTYPES = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64"}
_EMBEDDING_NAMES = ("embed_tokens.", "token_embd.", "wte.", "word_embeddings.")
_HEAD_NAMES = ("lm_head.", "output.")


def _kind(name: str, quantized: bool) -> str:
    if any(n in name for n in _EMBEDDING_NAMES) or name.startswith("tok_embeddings."):
        return "embedding"
    if any(name.startswith(n) or f".{n}" in name for n in _HEAD_NAMES):
        return "head"
    return "quantized" if quantized else "dense"


def _safetensors_header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def checkpoint_tensors(src: ModelSource) -> list[tuple[str, int, int, int | None, str]]:
    """(name, elements, bytes as stored, bytes held quantized, stored type) of every tensor of the checkpoint,
    from the GGUF tensor infos or the safetensors headers (no tensor data is read). The last is
    None for a tensor the engine holds in float: the packed layout's size for GGUF blocks the loader
    converts (quantization/gguf.py; other block types are dequantized), the stored size for
    `armserve quantize` tensors."""
    out: list[tuple[str, int, int, int | None, str]] = []
    if src.is_gguf:
        from armserve.model_loader.gguf import _reader  # the header parse the load shares
        from armserve.quantization.formats import packed_bytes
        from armserve.quantization.gguf import gguf_format

        for t in _reader(os.path.join(src.folder, src.gguf_file)).tensors:
            numel, k, kind = int(t.n_elements), int(t.shape[0]), t.tensor_type.name
            fmt = gguf_format(kind, k)
            held = packed_bytes(fmt[0], numel // k, k, fmt[1]) if fmt and len(t.shape) == 2 else None
            out.append((t.name, numel, int(t.n_bytes), held, kind))
        return out
    rows: list[tuple[str, int, int, str]] = []
    for path in sorted(glob.glob(os.path.join(src.folder, "*.safetensors"))):
        for name, info in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            rows.append((name, numel, info["data_offsets"][1] - info["data_offsets"][0], info["dtype"]))
    # (a module with integer codes is quantized as a whole: its float scales and zero points too)
    quantized_modules = {n.rpartition(".")[0] for n, _, _, dt in rows if dt in _INT_DTYPES}
    return [(n, numel, size, size if n.rpartition(".")[0] in quantized_modules else None, dt)
            for n, numel, size, dt in rows]


def weight_bytes(src: ModelSource, hf, dtype: torch.dtype, quantization: str | None = None) -> dict[str, int]:
    """Bytes of weights by kind as the engine holds them: quantized weights in the kernels' packed
    layout (unless `quantization` is "none"), float ones in `dtype`. A GGUF token table beside its
    own head stays in the file's memory map as stored (counted as stored: its pages once every row
    was looked up); a table tied to a quantized head is that head's weight (counted there); a head
    tied to a float table gets its own copy in `dtype` (the layout the head's GEMM reads)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    keep_quantized = quantization != "none"
    sizes = dict.fromkeys(WEIGHT_KINDS, 0)
    tensors = checkpoint_tensors(src)
    has_head = any(_kind(name, held is not None) == "head" for name, _, _, held, _ in tensors)
    for name, numel, stored, held, stored_type in tensors:
        kind = _kind(name, held is not None)
        if not keep_quantized:
            held = None
        if kind == "embedding" and src.is_gguf and has_head and keep_quantized and stored_type in GGUF_ROW_TYPES:
            sizes[kind] += stored  # mapped (quantization/embedding.py MappedEmbedding)
        elif kind == "embedding" and not has_head and getattr(hf, "tie_word_embeddings", False):
            sizes["head"] += held if held is not None else numel * itemsize
            sizes[kind] += 0 if held is not None else numel * itemsize  # (a float table: the lookups' own)
        else:
            sizes[kind] += held if held is not None else numel * itemsize
    return sizes


def runtime_bytes(config: EngineConfig, hf) -> int:
    """RUNTIME_BASE_BYTES plus one step's activations (max_num_batched_tokens rows of the widest
    layers, float32) and a decode batch's logits (max_num_seqs rows of the vocabulary)."""
    hidden = hf.hidden_size
    inter = getattr(hf, "intermediate_size", None) or 4 * hidden
    tokens = config.max_num_batched_tokens or 0
    activations = tokens * (6 * hidden + 3 * inter) * 4
    logits = config.max_num_seqs * hf.vocab_size * 4
    return RUNTIME_BASE_BYTES + activations + logits


@dataclass
class MemoryPlan:
    """An engine's memory, planned (bytes; the KV cache and runtime over all tensor-parallel ranks)."""

    weights: dict[str, int]
    kv_bytes_per_token: int
    kv_space: int
    kv_tokens: int
    runtime: int
    available: int
    kv_source: str  # how the KV space was chosen
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv_space + self.runtime

    def as_dict(self) -> dict:
        return {"weights": dict(self.weights), "weights_total": sum(self.weights.values()),
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_space": self.kv_space, "kv_tokens": self.kv_tokens,
                "kv_source": self.kv_source, "runtime": self.runtime, "total": self.total,
                "available": self.available}

    def lines(self) -> list[str]:
        w = self.weights
        return [f"weights    {sum(w.values()) / MiB:9.1f} MiB  (" + ", ".join(
                    f"{k} {w[k] / MiB:.1f}" for k in WEIGHT_KINDS) + " MiB)",
                f"KV cache   {self.kv_space / MiB:9.1f} MiB  ({self.kv_tokens} tokens x {self.kv_bytes_per_token} "
                f"bytes; {self.kv_source})",
                f"runtime    {self.runtime / MiB:9.1f} MiB  (estimate: interpreter, torch, kernels, one step)",
                f"total      {self.total / MiB:9.1f} MiB  of {self.available / MiB:.0f} MiB available"]


def plan_memory(config: EngineConfig, src: ModelSource, hf, dtype: torch.dtype, cache_dtype: torch.dtype,
                weights: dict[str, int] | None = None) -> MemoryPlan:
    """The plan of an engine for `config` (max_model_len and max_num_batched_tokens filled in).
    When `config.kv_cache_space` is None it is set here (config.py: DEFAULT_KV_CACHE_MEMORY_FRACTION);
    a given one that does not fit what the machine has available is a ConfigError naming the numbers."""
    tp = config.tensor_parallel_size
    weights = weight_bytes(src, hf, dtype, config.quantization) if weights is None else weights
    per_token_rank = kv_cache_bytes_per_token(hf, cache_dtype, tp)
    runtime = tp * runtime_bytes(config, hf)
    available = available_memory()
    need_rest = sum(weights.values()) + runtime
    seq_bytes = config.max_model_len * per_token_rank  # type: ignore[operator]
    if config.kv_cache_space is None:
        engines = tp * config.data_parallel_size
        rule = DEFAULT_KV_CACHE_MEMORY_FRACTION * total_memory() / max(numa_node_count(), engines)
        usable = config.max_num_seqs * seq_bytes
        left = (available - need_rest) / tp
        share = DEFAULT_KV_CACHE_MEMORY_FRACTION * left  # (the rest stays for the machine's other work)
        space = int(min(rule, usable, share))
        source = (f"default: {DEFAULT_KV_CACHE_MEMORY_FRACTION:g} of the node's memory"
                  + (f" / {engines} engine processes" if engines > 1 else "")
                  + (", capped at max_num_seqs x max_model_len" if space == int(usable) else "")
                  + (f", capped at {DEFAULT_KV_CACHE_MEMORY_FRACTION:g} of what is available"
                     if space == int(share) and share < min(rule, usable) else ""))
        if space < seq_bytes:
            raise ConfigError(
                f"not enough memory for this model: weights {sum(weights.values()) / GiB:.2f} GiB + runtime "
                f"{runtime / GiB:.2f} GiB leave {max(left, 0) / GiB:.2f} GiB of the {available / GiB:.2f} GiB "
                f"available, less than one sequence of max_model_len {config.max_model_len} needs in the KV cache "
                f"({seq_bytes / GiB:.2f} GiB); lower --max-model-len or free memory")
        config.kv_cache_space = space / GiB
    else:
        space = int(config.kv_cache_space * GiB)
        source = "--kv-cache-space"
        need = need_rest + tp * space
        if need > available:
            raise ConfigError(
                f"the memory plan does not fit: weights {sum(weights.values()) / GiB:.2f} GiB + KV cache "
                f"{tp * space / GiB:.2f} GiB (kv_cache_space {config.kv_cache_space:g} GiB"
                f"{f' x {tp} ranks' if tp > 1 else ''}) + runtime {runtime / GiB:.2f} GiB = {need / GiB:.2f} GiB, "
                f"but {available / GiB:.2f} GiB is available (MemAvailable, within the cgroup limit); lower "
                f"--kv-cache-space")
    tokens = space // per_token_rank
    return MemoryPlan(weights, per_token_rank * tp, tp * space, tokens, runtime, available, source)
