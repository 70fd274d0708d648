"""Adapters the engine serves: an LRU of adapters read onto the CPU and the slots of one batch.

    add(LoRARequest)        read and check the folder or GGUF file (LoRAError naming the problem), cached;
                            past `max_cpu_loras` the least recently used adapter is dropped
                            (read again from its folder if a request needs it later)
    slots_for(requests)     the slot of each adapter a step runs, loaded into the layers' slot
                            buffers if not there yet; a slot no adapter of this step uses is
                            taken least recently used first

`max_loras` slots: the scheduler admits no request whose adapter would make a step need more
(vLLM's rule: it waits until one frees), so `slots_for` always finds room.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import torch
from torch import nn

from armserve.layers.lora import LoRAWeights
from armserve.lora.adapter import LoRAAdapter, load_adapter
from armserve.lora.request import LoRAError, LoRARequest

# fused layer -> the PEFT module name of each of its shards ("all": the layer is one module)
_FUSED = {"qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
          "gate_up_proj": {0: "gate_proj", 1: "up_proj"}}
_LAYERS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class LoRAManager:
    """The model's LoRA slots and the adapters cached for them (engine process only)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int) -> None:
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.scales = torch.ones(max_loras, dtype=torch.float32)
        self.layers: list[tuple[int, LoRAWeights]] = []
        # the base's family and (attention, KV) heads: what a GGUF LoRA file's names and q/k rows follow
        self.model_cls = type(model)
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", 1)
        self.heads = (heads, getattr(config, "num_key_value_heads", None) or heads)
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}  # (layer, module) -> (in, out) features
        for i, layer in enumerate(getattr(model, "layers", [])):
            for block, name in _LAYERS:
                m = getattr(getattr(layer, block, None), name, None)
                split = getattr(m, "split", None)
                if split is None or split.cols is not None or any(n != full for _, full, _, n in split.rows):
                    continue  # not a projection this engine can adapt (an MoE block's experts) / a TP part
                slices, col = [], 0
                for shard, full, _, n in split.rows:
                    # (a family whose checkpoint stores the layer fused, Phi-3's qkv_proj: not a PEFT target)
                    module = name if shard == "all" else _FUSED.get(name, {}).get(shard, f"{name}#{shard}")
                    slices.append((module, col, n))
                    self.shapes[(i, module)] = (split.in_features, n)
                    col += n
                m.lora = LoRAWeights(slices, split.in_features, max_loras, max_lora_rank, dtype, self.scales)
                self.layers.append((i, m.lora))
        if not self.layers:
            raise LoRAError(f"{type(model).__name__} has no projection LoRA adapters can target")
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, LRU order
        self.slot_ids: list[int | None] = [None] * max_loras
        self.slot_step = [0] * max_loras  # the step each slot last served (its LRU order)
        self.step = 0

    def add(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of `req`, read now unless cached; a LoRAError names a bad folder."""
        if not isinstance(req, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        cached = self.cpu.get(req.lora_int_id)
        if cached is not None:
            if (cached.request.lora_path, cached.request.lora_name) != (req.lora_path, req.lora_name):
                raise LoRAError(f"lora_int_id {req.lora_int_id} already names adapter {cached.request.lora_name!r} "
                                f"({cached.request.lora_path}); give each adapter its own id")
            self.cpu.move_to_end(req.lora_int_id)
            return cached
        adapter = load_adapter(req, self.shapes, self.max_rank, self.model_cls, self.heads)
        self.cpu[req.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its cache entry and its slot); False if it was not loaded."""
        found = self.cpu.pop(lora_int_id, None) is not None
        for s, sid in enumerate(self.slot_ids):
            if sid == lora_int_id:
                self.slot_ids[s] = None
                found = True
        return found

    def slots_for(self, requests: Iterable[LoRARequest | None]) -> dict[int, int]:
        """lora_int_id -> slot of every adapter among `requests` (None: the base), each loaded into its slot."""
        self.step += 1
        wanted: dict[int, LoRARequest] = {}
        for r in requests:
            if r is not None:
                wanted.setdefault(r.lora_int_id, r)
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step runs {len(wanted)} adapters, more than max_loras {self.max_loras}")
        slots: dict[int, int] = {}
        for s, sid in enumerate(self.slot_ids):
            if sid in wanted:
                slots[sid] = s
                self.slot_step[s] = self.step
        for lid, req in wanted.items():
            if lid in slots:
                continue
            # a free slot, else the one unused longest (never one this step needs)
            s = min((s for s in range(self.max_loras) if self.slot_step[s] != self.step),
                    key=lambda s: (self.slot_ids[s] is not None, self.slot_step[s]))
            adapter = self.add(req)
            per_layer: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
            for (layer, module), ab in adapter.weights.items():
                per_layer.setdefault(layer, {})[module] = ab
            for layer, weights in self.layers:
                weights.set_slot(s, per_layer.get(layer, {}))
            self.slot_ids[s], self.slot_step[s] = lid, self.step
            slots[lid] = s
        return slots
