"""A llama.cpp GGUF LoRA file (`llama-server --lora`, convert_lora_to_gguf.py), read and checked
against the base model it will run on.

    general.type = "adapter", adapter.type = "lora", general.architecture = the base's (llama, qwen2, ...)
    adapter.lora.alpha                      scaling alpha / r of every module (0 or absent: 1.0)
    blk.{i}.{attn_q|...|ffn_down}.weight.lora_a    [r, in]   (ggml ne [in, r])
    blk.{i}.{attn_q|...|ffn_down}.weight.lora_b    [out, r]  (ggml ne [r, out])

F32, F16, BF16 or Q8_0 tensors (the converter's --outtype). As for the base GGUF, llama.cpp's
converter interleaved the rotary pairs of q/k rows for Llama-family architectures, and so the
rows of their lora_b: undone here the same way as the base loader undoes them
(model_loader/gguf.py), on a GGUF base and on a Hugging Face base alike.
"""

from __future__ import annotations

import logging
import re

import torch

from armserve.lora.request import LoRAError, LoRARequest
from armserve.model_loader.gguf import BLOCK_NAMES, header_field, unpermute_qk
from armserve.models import UnsupportedArchitectureError, gguf_model_class

logger = logging.getLogger(__name__)

_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# (layer, module) -> (the tensor's name, {"A": lora_a, "B": lora_b}), as adapter.py's PEFT reader gives them
Parts = dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]]


def _arch_fits(arch: str, model_cls: type) -> bool:
    """Whether a LoRA for llama.cpp architecture `arch` was made for a base of `model_cls`: the class
    reading that architecture, or a parent family llama.cpp converts it as (Mistral: `llama`) with the
    same tensor layout."""
    try:
        cls = gguf_model_class(arch)
    except UnsupportedArchitectureError:
        return False
    return model_cls is cls or (issubclass(model_cls, cls) and model_cls.gguf_permuted_qk == cls.gguf_permuted_qk
                                and model_cls.gguf_block_names == cls.gguf_block_names)


def read_gguf_lora(req: LoRARequest, model_cls: type, heads: tuple[int, int],
                   out_features: dict[tuple[int, str], int]) -> tuple[Parts, float]:
    """(layer, module) -> (tensor name, {"A": [r, in], "B": [out, r]}) of `req`'s GGUF file, q/k's B
    back in Hugging Face row order, and the file's alpha (0: llama.cpp's scaling 1). `heads`: the
    base's (attention heads, KV heads); `out_features`: each module's output rows. LoRAError naming
    anything that is not a LoRA of this base."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    try:
        reader = GGUFReader(req.lora_path)
    except Exception as e:  # not GGUF at all, or truncated
        raise LoRAError(f"{where}: not a PEFT adapter folder nor a readable GGUF file: {e}") from None
    kind = header_field(reader, "general.type")
    if kind != "adapter":
        raise LoRAError(f"{where}: general.type is {kind!r}, not 'adapter': a model file, not a LoRA adapter")
    if header_field(reader, "adapter.type") != "lora":
        raise LoRAError(f"{where}: adapter.type is {header_field(reader, 'adapter.type')!r}, not 'lora'")
    if header_field(reader, "adapter.alora.invocation_tokens") is not None:
        raise LoRAError(f"{where}: activated LoRA (adapter.alora.invocation_tokens) is not supported")
    arch = header_field(reader, "general.architecture")
    if not _arch_fits(arch or "", model_cls):
        mine = "/".join(model_cls.gguf_architectures) or model_cls.__name__
        raise LoRAError(f"{where}: a LoRA for llama.cpp architecture {arch!r}, but the base model is {mine!r} "
                        "(an adapter for another model?)")
    names = {**BLOCK_NAMES, **model_cls.gguf_block_names}
    permuted = model_cls.gguf_permuted_qk
    parts: Parts = {}
    for t in reader.tensors:
        m = _TENSOR.match(t.name)
        if m is None:
            if t.name.endswith("_norm.weight"):  # mergekit-extract-lora's norms: llama.cpp skips them too
                logger.warning("%s: %s (a norm weight) is ignored, as llama.cpp ignores it", where, t.name)
                continue
            what = "an embedding or LM-head LoRA" if t.name.startswith(("token_embd.", "output.")) else \
                "not a LoRA tensor of a decoder projection (blk.N.<name>.weight.lora_a / .lora_b)"
            raise LoRAError(f"{where}: tensor {t.name} is {what}")
        layer, gguf_name, ab = int(m.group(1)), m.group(2), m.group(3).upper()
        module = names.get(gguf_name, "").rpartition(".")[2]
        if (layer, module) not in out_features:
            raise LoRAError(f"{where}: tensor {t.name} targets {gguf_name} of layer {layer}, which this base "
                            "model has no LoRA-adaptable projection for")
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        except Exception as e:
            raise LoRAError(f"{where}: cannot read tensor {t.name} ({t.tensor_type.name}): {e}") from None
        if ab == "B" and permuted and module in ("q_proj", "k_proj") and w.dim() == 2 \
                and w.shape[0] == out_features[(layer, module)]:
            w = unpermute_qk(w, heads[0] if module == "q_proj" else heads[1])
        parts.setdefault((layer, module), (f"blk.{layer}.{gguf_name}.weight", {}))[1][ab] = w
    alpha = header_field(reader, "adapter.lora.alpha")
    return parts, float(alpha or 0.0)
