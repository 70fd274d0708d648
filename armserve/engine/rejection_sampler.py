"""Speculative decoding, the verifying half: which drafted tokens the target model accepts.

A request with k drafts d_0..d_{k-1} has k+1 rows of logits from one forward: row j is the
target's next-token distribution p_j after the known tokens and d_0..d_{j-1}. Each row is
processed exactly as the plain sampler would process it at that position (grammar-free requests
only: penalties and min_tokens see the drafts before it as output, then temperature, top-k/p,
min-p), so:

- greedy: accept d_j while d_j == argmax p_j; the first mismatch is replaced by argmax p_j, and
  when all k are accepted argmax p_k follows (the bonus token). The tokens are the ones plain
  decoding would produce.
- random: accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); an n-gram draft is a point
  mass (q_j = 1 at d_j), so with probability p_j(d_j). On the first rejection the token is drawn
  from the residual max(p_j - q_j, 0), renormalised: p_j without d_j. All accepted: a bonus draw
  from p_k. Every emitted token is then distributed as p (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

import torch

from armserve import kernels
from armserve.engine.request import Request
from armserve.engine.sampler import Sampler, build_sampling_batch


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from unnormalised non-negative weights [V] (exponential race, as the sampler)."""
    noise = torch.empty(probs.shape, dtype=torch.float32).uniform_(generator=generator).log_().neg_()
    return int((probs / noise).argmax())


def rejection_sample(logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]],
                     vocab_size: int) -> list[tuple[list[int], int]]:
    """Verify each request's drafts against its rows of `logits` ([sum(k_i + 1), V], each
    request's k_i + 1 rows in order). Returns per request (accepted drafts, the token after them)."""
    params, prompts, outputs, gens = [], [], [], []
    for req, d in zip(reqs, drafts):
        for j in range(len(d) + 1):
            params.append(req.params)
            prompts.append(req.prompt_token_ids)
            outputs.append(req.output_token_ids + d[:j] if j else req.output_token_ids)
            gens.append(req.generator)
    batch = build_sampling_batch(params, prompts, outputs, gens, vocab_size)
    adjusted = Sampler.adjusted_logits(logits, batch)
    greedy_ids = None if batch.all_random else kernels.argmax(adjusted).tolist()
    probs = None if batch.all_greedy else Sampler.probs(adjusted, batch)

    results: list[tuple[list[int], int]] = []
    base = 0
    for req, d in zip(reqs, drafts):
        k = len(d)
        if req.params.greedy:
            g = greedy_ids[base:base + k + 1]  # type: ignore[index]
            n = 0
            while n < k and d[n] == g[n]:
                n += 1
            results.append((d[:n], g[n]))
        else:
            rows = probs[base:base + k + 1]  # type: ignore[index]
            gen = req.generator
            u = torch.empty(k, dtype=torch.float64).uniform_(generator=gen).tolist()
            p_draft = rows[torch.arange(k), torch.tensor(d, dtype=torch.long)].tolist()
            n = 0
            while n < k and u[n] < p_draft[n]:
                n += 1
            if n < k:
                residual = rows[n].clone()
                residual[d[n]] = 0.0
                results.append((d[:n], _draw(residual, gen)))
            else:
                results.append((list(d), _draw(rows[k], gen)))
        base += k + 1
    return results
