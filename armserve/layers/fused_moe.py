"""Mixture-of-Experts on CPU: the router's top-k and the experts' MLPs over their tokens.

`select_experts` turns router logits into (weights, expert ids) per token; `fused_experts` runs
each expert that received tokens once, over all of its tokens (gate/up as one fused projection,
so one GEMM each way per active expert, on the dense or w4a8 kernels of the expert's own
layers), and scatters the weighted results back in fp32. `kernels.reference.fused_moe_ref`
is the PyTorch reference the tests hold both to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from armserve import kernels


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool, *, scoring: str = "softmax",
                   correction_bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
                   routed_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] fp32, ids [T, top_k] int64) from router logits [T, experts].

    - `scoring`: "softmax" over the experts (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" per expert
      (DeepSeek-V3);
    - `correction_bias` (V3's e_score_correction_bias) is added to the scores for the choice only:
      the weights are the unbiased scores of the chosen experts;
    - `num_groups` > 1: experts split into equal groups and only the best `topk_groups` groups
      compete (V2's group-limited greedy: a group's score is its best expert; V3 with sigmoid
      scoring: the sum of its best two);
    - `renormalize`: the chosen weights rescaled to sum 1 (norm_topk_prob);
    - `routed_scale`: the weights multiplied by it last (routed_scaling_factor).
    """
    logits = logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown expert scoring {scoring!r}; expected softmax or sigmoid")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        if scoring == "sigmoid":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        # NOTE: -inf, not 0: a biased (V3) score may be negative and must still lose to a kept one.
        choice = choice.masked_fill(~keep.repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scale != 1.0:
        weights = weights * routed_scale
    return weights, ids


@dataclass(frozen=True)
class KernelExperts:
    """Every expert's weights where the fused kernel (kernels.fused_moe) reads them: the addresses of
    each expert's gate, up and down weights (int64 [E] each) in one format."""

    fmt: str  # "w4" / "w8" (quantized GEMM tiles) or "bf16" (dense GEMM blocks)
    inter: int
    group_gu: int
    group_dn: int
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def kernel_experts(experts: nn.ModuleList) -> KernelExperts | None:
    """The experts as the fused kernel reads them, worked out once per layer; None where it
    cannot (float32 / float16 weights, a bias, an activation other than SiLU, formats that differ
    between experts, an intermediate width not a multiple of 16): those run expert by expert."""
    cached = getattr(experts, "_kernel_experts", False)
    if cached is not False:
        return cached
    from armserve.layers.activation import SiluAndMul

    found = None
    first = experts[0]
    inter, hidden = first.down_proj.in_features, first.down_proj.out_features
    projections = []
    if inter % 16 == 0 and all(type(e.act) is SiluAndMul for e in experts):  # (GeluAndMul derives from it)
        for e in experts:
            # (the kernel adds no bias; each layer knows where its packed row blocks are)
            gu = None if e.gate_up_proj.bias is not None else e.gate_up_proj.row_blocks(inter)
            dn = None if e.down_proj.bias is not None else e.down_proj.row_blocks(hidden)
            if gu is None or dn is None or len(gu[2]) != 2 or len(dn[2]) != 1:
                break
            projections.append((gu, dn))
        else:
            kinds = {(gu[0], gu[1], dn[0], dn[1]) for gu, dn in projections}
            if len(kinds) == 1 and next(iter(kinds))[0] == next(iter(kinds))[2]:
                fmt, group_gu, _, group_dn = next(iter(kinds))
                addr = lambda vals: torch.tensor(vals, dtype=torch.int64)  # noqa: E731
                found = KernelExperts(fmt, inter, group_gu, group_dn, addr([gu[2][0] for gu, _ in projections]),
                                      addr([gu[2][1] for gu, _ in projections]),
                                      addr([dn[2][0] for _, dn in projections]))
    experts._kernel_experts = found
    return found


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: nn.ModuleList,
                  use_kernel: bool = True) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]) for every token t, as fp32 [T, hidden].

    The (token, k) pairs are sorted by expert (stable: a token's rows keep their order), so each
    active expert runs once over a contiguous group; experts with no tokens cost nothing. Where
    the experts allow (`kernel_experts`), all of it is one kernel call (csrc/moe_impl.h), which
    rounds as the expert-by-expert path does; `use_kernel=False` forces the latter.
    """
    ke = kernel_experts(experts) if use_kernel else None
    if ke is not None and ids.shape[1] <= 64 and kernels.use_kernel("moe", x, fmt=ke.fmt):
        return kernels.fused_moe(ke.fmt, x, weights, ids, ke.gate, ke.up, ke.down, ke.inter, ke.group_gu, ke.group_dn)
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

