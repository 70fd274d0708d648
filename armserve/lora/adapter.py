"""A LoRA adapter, read and checked against the base model it will run on: a PEFT folder (here)
or a llama.cpp GGUF LoRA file (gguf_adapter.py).

    folder/adapter_config.json          r, lora_alpha, use_rslora, target_modules, rank_pattern,
                                        alpha_pattern (PEFT's LoraConfig)
    folder/adapter_model.safetensors    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}
                                        .lora_A.weight [r, in] / .lora_B.weight [out, r]
    (or adapter_model.bin, the older torch.save format)

Each module's delta is scaling * B @ A with scaling = alpha / r (rsLoRA: alpha / sqrt(r); a GGUF
file: its one adapter.lora.alpha / r, or 1 without an alpha, as llama.cpp scales it); the
scaling is folded into B here, once, so a module's rank and alpha may differ from the config's
(rank_pattern / alpha_pattern) at no cost in the batch. Anything the engine cannot apply faithfully
(DoRA, biases, embedding or head targets, modules_to_save) is refused by name, never ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from armserve.lora.request import LoRAError, LoRARequest

# The projections a decoder layer's LoRA may target (PEFT module names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter on the CPU: (layer, module) -> (A [r, in], scaling * B [out, r]), float32."""

    request: LoRARequest
    rank: int  # the largest module rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the module's name or its tail."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _read_config(req: LoRARequest) -> dict:
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    if not os.path.isdir(req.lora_path):
        raise LoRAError(f"{where}: no such folder or file")
    path = os.path.join(req.lora_path, "adapter_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{where}: adapter_config.json is missing (expected a PEFT adapter folder)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{where}: adapter_config.json is unreadable: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{where}: adapter_config.json is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {peft_type} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise LoRAError(f"{where}: DoRA adapters (use_dora) are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAError(f"{where}: adapters with trained biases (bias={cfg.get('bias')!r}, lora_bias) are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"{where}: modules_to_save {cfg['modules_to_save']} (fully trained copies of base modules) "
                        "are not supported")
    if cfg.get("fan_in_fan_out"):
        raise LoRAError(f"{where}: fan_in_fan_out adapters (Conv1D bases) are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, (list, tuple)):
        bad = sorted(set(targets) - set(TARGET_MODULES))
        if bad:
            raise LoRAError(f"{where}: target module(s) {', '.join(bad)} are not supported; supported: "
                            f"{', '.join(TARGET_MODULES)}")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise LoRAError(f"{where}: adapter_config.json has no valid rank r (got {cfg.get('r')!r})")
    return cfg


def _read_tensors(req: LoRARequest) -> dict[str, torch.Tensor]:
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    st = os.path.join(req.lora_path, "adapter_model.safetensors")
    binary = os.path.join(req.lora_path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file

            return load_file(st)
        if os.path.isfile(binary):
            # weights_only: an adapter file must not run code when read
            return torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: the message says which
        raise LoRAError(f"{where}: cannot read the adapter weights: {e}") from None
    raise LoRAError(f"{where}: adapter_model.safetensors is missing")


def _read_peft(req: LoRARequest, shapes: dict[tuple[int, str], tuple[int, int]]
               ) -> tuple[dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]], Callable[[str, int], float]]:
    """(layer, module) -> (module name, {"A", "B"}) of a PEFT folder, and its scaling(name, r)."""
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    cfg = _read_config(req)
    tensors = _read_tensors(req)
    parts: dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            what = "an embedding LoRA" if "lora_embedding" in key else "DoRA magnitudes" if "magnitude" in key \
                else "a LoRA bias" if key.endswith(".bias") else "not a LoRA weight of a decoder projection"
            raise LoRAError(f"{where}: tensor {key} is {what}; supported targets: {', '.join(TARGET_MODULES)}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAError(f"{where}: target module {module} ({key}) is not supported; supported: "
                            f"{', '.join(TARGET_MODULES)}")
        if (layer, module) not in shapes:
            raise LoRAError(f"{where}: {key} targets layer {layer} {module}, which the base model does not have")
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        parts.setdefault((layer, module), (f"model.layers.{layer}.{block}.{module}", {}))[1][ab] = t
    alpha0, rslora = cfg.get("lora_alpha", cfg["r"]), bool(cfg.get("use_rslora"))

    def scaling(name: str, r: int) -> float:
        alpha = _pattern_value(cfg.get("alpha_pattern"), name, alpha0)
        return alpha / math.sqrt(r) if rslora else alpha / r

    return parts, scaling


def load_adapter(req: LoRARequest, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int,
                 model_cls: type, heads: tuple[int, int]) -> LoRAAdapter:
    """Read `req`'s PEFT folder or llama.cpp GGUF LoRA file and check it against the base:
    `shapes[(layer, module)]` = (in, out) features of each module the base lets an adapter target;
    `model_cls` and `heads` (attention heads, KV heads): the base's family and heads, for a GGUF
    file's architecture, tensor names and q/k row order. LoRAError naming any problem."""
    where = f"LoRA adapter {req.lora_name!r} ({req.lora_path})"
    if os.path.isfile(req.lora_path):
        from armserve.lora.gguf_adapter import read_gguf_lora

        parts, alpha = read_gguf_lora(req, model_cls, heads, {key: n for key, (_, n) in shapes.items()})

        def scaling(name: str, r: int) -> float:
            return alpha / r if alpha else 1.0  # llama.cpp's llama_adapter_lora_weight::get_scale

        a_name, b_name = "lora_a", "lora_b"
    else:
        parts, scaling = _read_peft(req, shapes)
        a_name, b_name = "lora_A", "lora_B"
    if not parts:
        raise LoRAError(f"{where}: the adapter holds no LoRA weights")
    adapter = LoRAAdapter(req, 0)
    for (layer, module), (name, ab) in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            have, lack = (a_name, b_name) if "A" in ab else (b_name, a_name)
            raise LoRAError(f"{where}: {name} has {have} but no {lack}")
        a, b = ab["A"], ab["B"]
        k, n = shapes[(layer, module)]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, k) or tuple(b.shape) != (n, r):
            raise LoRAError(f"{where}: {name} has {a_name} {tuple(a.shape)} and {b_name} {tuple(b.shape)}; this "
                            f"base model needs [r, {k}] and [{n}, r] (an adapter for another model?)")
        if r > max_rank:
            raise LoRAError(f"{where}: {name} has rank {r}, above max_lora_rank {max_rank} (raise --max-lora-rank)")
        adapter.weights[(layer, module)] = (a.float().contiguous(), (b.float() * scaling(name, r)).contiguous())
        adapter.rank = max(adapter.rank, r)
    return adapter
