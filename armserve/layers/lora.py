"""LoRA on the projections of a decoder: per-slot stacked adapter weights and the step's token slots.

With `enable_lora` each targeted layer (qkv_proj, o_proj, gate_up_proj, down_proj; a float Linear or
a QuantizedLinear alike: the base stays as it is) gets a `LoRAWeights` as its `lora` attribute and
adds its delta to the base output:

    a        [max_loras, slices * max_rank, in]      every slice's A stacked along the rank
    b[i]     [max_loras, rows of slice i, max_rank]  one per slice (q, k, v / gate, up / the whole)
    buf    = lora_shrink(x, a, indices)              # [T, slices * max_rank] float32, once
    out[:, cols of slice i] += b[i] @ buf[:, rank block i]    (lora_expand_, per slice)

A slot holds one adapter (lower ranks zero-padded, scaling folded into B); `indices` names each
token's slot (-1: the base model alone). The model runner publishes them once per step
(`set_lora_indices`), as it does the attention metadata, so model code stays unchanged.
"""

from __future__ import annotations

import torch

from armserve.kernels.lora import lora_expand_, lora_shrink

_INDICES: torch.Tensor | None = None  # this step's slot per token; None: no token has an adapter


def set_lora_indices(indices: torch.Tensor | None) -> None:
    """Publish this step's per-token adapter slots (int64 [T], -1 for the base) or None (no LoRA)."""
    global _INDICES
    _INDICES = indices


class LoRAWeights:
    """One layer's adapter slots. `slices`: (module name, first output column, rows) of each part
    of the layer's output an adapter may target, in output order."""

    def __init__(self, slices: list[tuple[str, int, int]], in_features: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, scales: torch.Tensor) -> None:
        self.slices = slices
        self.max_rank = max_rank
        self.a = torch.zeros(max_loras, len(slices) * max_rank, in_features, dtype=dtype)
        self.b = [torch.zeros(max_loras, n, max_rank, dtype=dtype) for _, _, n in slices]
        self.scales = scales  # [max_loras] float32, shared by every layer (the scaling is in b)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's (A, scaled B) of each module it targets into `slot`, in place (a
        recorded step graph reads these buffers); the modules it does not target get zeros."""
        r = self.max_rank
        self.a[slot].zero_()
        for i, (name, _, _) in enumerate(self.slices):
            self.b[i][slot].zero_()
            if name in weights:
                a, b = weights[name]
                self.a[slot, i * r:i * r + a.shape[0]].copy_(a)
                self.b[i][slot, :, :b.shape[1]].copy_(b)

    def apply_(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, N] += this step's adapters' deltas for x [T, in] (nothing when no token has one)."""
        indices = _INDICES
        if indices is None:
            return
        buf = lora_shrink(x, self.a, indices)
        r = self.max_rank
        for i, (_, col, n) in enumerate(self.slices):
            lora_expand_(out[:, col:col + n], buf[:, i * r:(i + 1) * r], self.b[i], indices, self.scales)
