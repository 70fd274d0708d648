"""Mixture-of-Experts on CPU: the router's top-k and the experts' MLPs over their tokens.

`select_experts` turns router logits into (weights, expert ids) per token; `fused_experts` runs
each expert that received tokens once, over all of its tokens (gate/up as one fused projection,
so one GEMM each way per active expert, on the dense or w4a8 kernels of the expert's own
layers), and scatters the weighted results back in fp32. `fused_moe_ref` is the PyTorch
reference the tests hold both to.
"""

from __future__ import annotations

import torch
from torch import nn


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, ids [T, top_k] int64): the top-k of the softmax over experts,
    renormalised to sum 1 per token when `renormalize` (Mixtral, Qwen3-MoE's norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t, as fp32 [T, hidden].

    The (token, k) pairs are sorted by expert (stable: a token's rows keep their order), so each
    active expert runs once over a contiguous group; experts with no tokens cost nothing.
    """
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token_of = order // k
    w = weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(tokens, x.shape[1], dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start:start + n]
        y = experts[e](x.index_select(0, rows))
        out.index_add_(0, rows, y.float() * w[start:start + n])
        start += n
    return out


def fused_moe_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Reference: token by token, expert by expert, in fp32 (w_gate_up [E, 2I, H], w_down [E, H, I])."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w_gate_up[e].float() @ x[t].float()
            g, u = gu.chunk(2)
            out[t] += weights[t, j] * (w_down[e].float() @ (torch.nn.functional.silu(g) * u))
    return out
