"""Batched token sampling: penalties, temperature, top-k/top-p/min-p and logprobs, in tensors.

The engine builds one `SamplingBatch` per step for the rows that need a sampled token
(`build_sampling_batch`) and calls `Sampler()(logits, batch)`. Everything is batched
tensor math, in place where it is [B, V]; the only Python loop is over rows that carry their
own seeded generator, so that a seeded request draws the same uniform whatever else shares
the batch. Random rows draw by inverse CDF over their filtered weights (`filtered_weights`,
`sample_weights`); `apply_top_k_top_p_min_p` is the filters' logit-space reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from armserve import kernels
from armserve.engine.structured_output import apply_grammar_bitmask
from armserve.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (same threshold as SamplingParams.greedy).
_SAMPLING_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-step sampling parameters of B rows, as tensors (built by `build_sampling_batch`).

    Optional tensors are None when no row needs that step, so the sampler can skip it.
    """

    temperature: torch.Tensor  # [B] float32, 0 for greedy rows
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 where disabled
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lp] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None  # [B, Lo] int64, padded with vocab_size
    # (row, token ids to forbid) for rows that have not reached min_tokens yet.
    min_tokens_mask: list[tuple[int, list[int]]] = field(default_factory=list)
    # row -> the request's own generator (random rows of requests with a seed).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    all_greedy: bool = False
    all_random: bool = False
    max_num_logprobs: int | None = None  # max of params.logprobs over rows, None if no row asks
    # Structured outputs: allowed-token bitmask [R, ceil(V / 32)] int32 of the constrained rows
    # `grammar_rows` [R] (structured_output.py); None when no row is constrained.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalty is None


@dataclass
class LogprobsTensors:
    """Logprobs of one chosen/target token per row plus the top-k alternatives."""

    token_ids: torch.Tensor  # [N, k+1] int64: column 0 = chosen/target token, then top-k
    logprobs: torch.Tensor  # [N, k+1] float32
    ranks: torch.Tensor  # [N] int64: 1-based rank of the chosen/target token in the vocab


@dataclass
class SamplerOutput:
    """The sampled token of every row and, when asked for, their logprobs."""

    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # k = batch.max_num_logprobs


def _pad_2d(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(
        len(rows), width
    )


def build_sampling_batch(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: list[torch.Generator | None],
    vocab_size: int,
) -> SamplingBatch:
    """Gather the parameters of B rows into a `SamplingBatch`.

    `output_token_ids[i]` are the tokens generated so far by row i (used for penalties and
    min_tokens); `generators[i]` is the request's seeded generator or None.
    """
    greedy = [p.greedy for p in params]
    temperature = torch.tensor(
        [0.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32
    )
    # Filters only matter for random rows; greedy rows get the "disabled" value so a
    # batch of greedy rows with e.g. top_k set does not pay for sorting.
    top_k_list = [vocab_size if g or p.top_k <= 0 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)]
    top_p_list = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    min_p_list = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
    top_k = torch.tensor(top_k_list, dtype=torch.int64) if any(k < vocab_size for k in top_k_list) else None
    top_p = torch.tensor(top_p_list, dtype=torch.float32) if any(p < 1.0 for p in top_p_list) else None
    min_p = torch.tensor(min_p_list, dtype=torch.float32) if any(p > 0.0 for p in min_p_list) else None

    # Penalties apply to greedy rows as well (as in vLLM).
    use_penalties = any(
        p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0 for p in params
    )
    presence = frequency = repetition = prompt_ids = output_ids = None
    if use_penalties:
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
        # Only rows with a repetition penalty look at the prompt; others get an empty row
        # so a long prompt of an unpenalised row does not widen the padded tensor.
        prompt_ids = _pad_2d(
            [list(ids) if p.repetition_penalty != 1.0 else [] for p, ids in zip(params, prompt_token_ids)],
            vocab_size,
        )
        output_ids = _pad_2d([list(ids) for ids in output_token_ids], vocab_size)

    min_tokens_mask: list[tuple[int, list[int]]] = []
    for i, (p, out) in enumerate(zip(params, output_token_ids)):
        # NOTE: a structured-output row's end is the grammar's call (it may allow only EOS).
        if p.min_tokens and len(out) < p.min_tokens and p.structured_outputs is None:
            stop_ids = sorted(t for t in p.all_stop_token_ids if 0 <= t < vocab_size)
            if stop_ids:
                min_tokens_mask.append((i, stop_ids))

    gens = {i: g for i, (g, is_greedy) in enumerate(zip(generators, greedy)) if g is not None and not is_greedy}
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingBatch(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        min_tokens_mask=min_tokens_mask,
        generators=gens,
        all_greedy=all(greedy),
        all_random=not any(greedy),
        max_num_logprobs=max(wanted) if wanted else None,
    )


def apply_min_tokens_mask(logits: torch.Tensor, mask: list[tuple[int, list[int]]]) -> torch.Tensor:
    """Set the forbidden (stop) tokens of rows below min_tokens to -inf, in place."""
    if not mask:
        return logits
    rows = [r for r, ids in mask for _ in ids]
    cols = [t for _, ids in mask for t in ids]
    logits[torch.tensor(rows), torch.tensor(cols)] = float("-inf")
    return logits


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    """Apply the three penalties in place and return `logits`.

    Repetition penalty (CTRL/HF style) covers prompt and output tokens: a positive logit
    is divided by it, a negative one multiplied. Presence and frequency (OpenAI style)
    cover output tokens only: logit -= frequency * count + presence * (count > 0).

    Only the logits of tokens the rows hold change, so they are gathered, penalised and
    scattered back ([B, prompt + output] values, not a dozen passes over [B, V]).
    """
    vocab_size = logits.shape[1]
    ids = torch.cat([prompt_token_ids, output_token_ids], dim=1)  # padded with vocab_size
    if ids.shape[1] == 0:
        return logits
    valid = ids < vocab_size
    held = valid.any(dim=1, keepdim=True)
    # Padding points at the row's first token, whose value every copy then computes and writes
    # alike, so the scatter has no conflicting duplicates.
    first = ids.gather(1, valid.to(torch.int8).argmax(dim=1, keepdim=True))
    idx = torch.where(valid, ids, torch.where(held, first, 0))
    old = logits.gather(1, idx)
    # each token's count in its row's output: the width of its run in the sorted output ids
    # (padding sorts last and matches no token)
    out_sorted = output_token_ids.sort(dim=1).values
    count = (torch.searchsorted(out_sorted, idx, right=True) - torch.searchsorted(out_sorted, idx)).to(torch.int32)
    rep = repetition_penalty.unsqueeze(1)
    new = torch.where(old > 0, old / rep, old * rep)
    new = new - frequency_penalty.unsqueeze(1) * count
    new = new - presence_penalty.unsqueeze(1) * (count > 0)
    logits.scatter_(1, idx, torch.where(held, new, old))
    return logits


# Top-p looks for its cut-off among the most likely tokens, in windows of these widths, each for
# the rows the one before did not hold, then a full sort for the rest: a topk of 64 costs half a
# topk of 512 over a 152k vocabulary, and LM rows at usual temperatures keep fewer than 150
# tokens; flat rows (a confused model, a high temperature) go on to the wide window.
_TOP_P_WINDOW = 64
_TOP_P_WIDE = 1024


def _kth_largest(x: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row its k-th largest value ([B, 1]; -inf where top-k is off: k <= 0 or >= V) and the
    rows' largest values, descending, as wide as the largest k; None when no row uses top-k."""
    vocab_size = x.shape[1]
    top_k = torch.where(top_k <= 0, vocab_size, top_k).clamp(1, vocab_size)
    enabled = top_k < vocab_size
    if not bool(enabled.any()):
        return None
    # Disabled rows (k == V) must not force a full-width topk for everyone.
    max_k = int(top_k[enabled].max())
    top_vals = x.topk(max_k, dim=-1).values
    kth = top_vals.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    return torch.where(enabled.unsqueeze(1), kth, float("-inf")), top_vals


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Mask in place everything below each row's k-th largest logit (ties are kept)."""
    found = _kth_largest(logits, top_k)
    if found is not None:
        logits.masked_fill_(logits < found[0], float("-inf"))


def _top_p_cutoff(x: torch.Tensor, top_p: torch.Tensor, window: int, weights: bool,
                  vals: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the smallest value top-p keeps ([N, 1]), searched among the `window` largest
    (or the given descending `vals`), and whether they held the cut ([N]). `x`: logits, or
    with `weights` unnormalised probabilities (`filtered_weights`)."""
    vocab_size = x.shape[1]
    if vals is None:
        vals = x.topk(min(window, vocab_size), dim=-1).values  # descending
    window = vals.shape[1]
    if weights:
        probs = vals / x.sum(dim=-1, keepdim=True)
    else:
        probs = (vals - x.logsumexp(dim=-1, keepdim=True)).exp()
    # Like HF: a token goes when it and all less likely tokens hold <= 1 - p of the mass.
    tail_mass = 1.0 - (probs.cumsum(dim=-1) - probs)
    keep = tail_mass > (1.0 - top_p).unsqueeze(1)
    keep[:, 0] = True  # the most likely token always survives
    n_keep = keep.sum(dim=-1)  # tail_mass only decreases, so `keep` is a prefix
    cutoff = vals.gather(1, (n_keep - 1).unsqueeze(1))
    # (the window holds the cut when the nucleus ends inside it or its mass reaches p)
    sufficient = (n_keep < window) | (window == vocab_size) | (probs.sum(dim=-1) >= top_p)
    return cutoff, sufficient


def _apply_top_p(x: torch.Tensor, top_p: torch.Tensor, weights: bool = False,
                 window_vals: torch.Tensor | None = None) -> None:
    """Drop in place the low-probability tail of the rows with top_p < 1: logits to -inf, or
    with `weights` unnormalised probabilities to 0. `window_vals`: every row's largest values,
    descending, where the cut-off is looked for first (top-k's, which already left no more in
    the rows); None: the `_TOP_P_WINDOW` largest. Rows whose cut lies beyond look in wider ones."""
    rows = torch.nonzero(top_p < 1.0).squeeze(1)
    if rows.numel() == 0:
        return
    every_row = rows.numel() == x.shape[0]
    sub = x if every_row else x[rows]
    sub_p = top_p if every_row else top_p[rows]
    vals = None if window_vals is None else (window_vals if every_row else window_vals[rows])
    cutoff, sufficient = _top_p_cutoff(sub, sub_p, _TOP_P_WINDOW, weights, vals)
    for window in (_TOP_P_WIDE, sub.shape[1]):
        if bool(sufficient.all()):
            break
        wide = torch.nonzero(~sufficient).squeeze(1)
        cutoff[wide], sufficient[wide] = _top_p_cutoff(sub[wide], sub_p[wide], window, weights)
    # A threshold instead of a scatter of sorted positions; ties at the cut are kept.
    if weights:
        sub.mul_(sub >= cutoff)
    else:
        sub.masked_fill_(sub < cutoff, float("-inf"))
    if not every_row:
        x[rows] = sub


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Return a copy of `logits` [B, V] with the tokens filtered out by top-k, then top-p
    (on the top-k renormalised distribution), then min-p set to -inf: the filters in logit
    space, as transformers' logits processors apply them (tests/test_sampler.py), and the
    reference the sampler's own `filtered_weights` is tested against.

    `top_k` [B] (>= vocab size or <= 0 disables a row), `top_p` [B] (1.0 disables),
    `min_p` [B] (0.0 disables); any may be None. At least the most likely token always
    survives. Tokens tied with the last kept one are kept too.
    """
    out = logits.clone()
    if top_k is not None:
        _apply_top_k(out, top_k)
    if top_p is not None:
        _apply_top_p(out, top_p)
    if min_p is not None:
        # Threshold relative to the most likely token; renormalisation by the earlier
        # filters does not change the ratio p_i / p_max, so this equals HF's
        # MinPLogitsWarper applied after top-k/top-p.
        probs = out.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        out.masked_fill_(probs < threshold, float("-inf"))
    return out


def compute_logprobs_tensors(logits: torch.Tensor, target_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Log-softmax of `logits` [N, V]; the target token's logprob and rank plus the top-k.

    Used for sample logprobs (target = sampled token) and prompt logprobs (target = next
    prompt token). Ranks are 1-based: 1 + number of tokens strictly more likely.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = target_ids.to(torch.int64).unsqueeze(1)
    target_lp = logprobs.gather(1, target_ids)
    ranks = (logprobs > target_lp).sum(dim=-1) + 1
    k = min(k, logprobs.shape[1])
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        token_ids = torch.cat([target_ids, top_ids], dim=1)
        lps = torch.cat([target_lp, top_lp], dim=1)
    else:
        token_ids, lps = target_ids, target_lp
    return LogprobsTensors(token_ids=token_ids, logprobs=lps, ranks=ranks.to(torch.int64))


# Tokens more than 86.5 (in logits over the temperature) below the most likely one weigh 0:
# exp's float32 result would soon be denormal (the normal range ends at e^-87.3), and PyTorch's
# exp takes ~30x longer per denormal or -inf input than per ordinary one (sampling 32 rows of
# Qwen's logits at temperature 0.2 took 7x longer, measured alone; in the engine a kernel that
# leaves the CPU flushing denormals can hide it). Logits are clamped at the floor, weights at or
# below e^-86.5 zeroed.
_EXP_FLOOR = -87.0
_ZERO_BELOW = math.exp(-86.5)


def filtered_weights(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution random rows sample from, unnormalised, made in place of `logits` [B, V]
    (a float32 copy): divided by the temperature, then exp(logit - row max), so the most likely
    token weighs 1; then top-k, top-p and min-p zero their tails. Greedy rows get temperature 1.
    Tokens below e^-86.5 of the most likely one weigh 0 (`_EXP_FLOOR`).

    The same distribution as the softmax of `apply_top_k_top_p_min_p` (tested against it), without
    its second pass over the logits for the log-sum-exp: min-p compares with the max directly.
    """
    temp = torch.where(batch.temperature < _SAMPLING_EPS, 1.0, batch.temperature)
    logits.div_(temp.unsqueeze(1))
    x = logits.sub_(logits.amax(dim=-1, keepdim=True))  # the most likely token at 0
    # What lay at or below the floor (the -inf of grammar and min_tokens masks) weighs exactly 0
    # after the threshold, whatever ulp each ISA's exp gives the floor. The filters then cut on
    # the weights, in place, by multiplying with a mask: a [B, V] temporary of floats costs its
    # page faults every step, and masked_fill_ runs several times slower than a multiply here.
    w = torch.nn.functional.threshold_(x.clamp_(min=_EXP_FLOOR).exp_(), _ZERO_BELOW, 0.0)
    top_vals = None  # each row's largest weights, descending, when top-k found them
    found = None if batch.top_k is None else _kth_largest(w, batch.top_k)
    if found is not None:
        kth, top_vals = found
        w.mul_(w >= kth)  # (ties with the k-th kept)
        # top-p's window: what top-k left of each row's largest (a row with a smaller k loses the
        # rest); a row without top-k (its k-th at -inf) needs a window of its own
        top_vals = top_vals.mul_(top_vals >= kth) if bool(torch.isfinite(kth).all()) else None
    if batch.top_p is not None:
        _apply_top_p(w, batch.top_p, weights=True, window_vals=top_vals)
    if batch.min_p is not None:
        # p_i < min_p * p_max, with p_max's weight 1 (top-k and top-p keep the most likely token)
        w.mul_(w >= batch.min_p.unsqueeze(1))
    return w


def _uniforms(n: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One Uniform[0, 1) draw per row, float64; rows with a generator draw from their own, so a
    seeded row's draw depends only on its generator, not on the batch."""
    u = torch.rand(n, dtype=torch.float64) if len(generators) < n else torch.empty(n, dtype=torch.float64)
    for row, gen in generators.items():
        u[row] = torch.rand(1, dtype=torch.float64, generator=gen)
    return u


# Inverse-CDF sampling sums the weights in blocks of this many tokens (float32 within a block,
# float64 across blocks), then walks one block: no [B, V] cumulative sum, whose float32 rounding
# over 150k tokens would move the CDF's late boundaries by up to ~1% of the mass.
_CDF_BLOCK = 1024


def sample_weights(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row of the unnormalised weights `w` [B, V] (>= 0, some > 0 per row)
    with the uniforms `u` [B]: the token where the row's cumulative weight first exceeds
    u * total. A zero-weight token is never drawn. One uniform per row instead of the V draws of
    an exponential race (at 32 rows of a 152k vocabulary its noise took ~13 ms, measured alone)."""
    rows, vocab_size = w.shape
    blk = min(_CDF_BLOCK, vocab_size)
    whole = vocab_size // blk
    sums = torch.empty(rows, -(-vocab_size // blk), dtype=torch.float64)
    sums[:, :whole] = w[:, :whole * blk].view(rows, whole, blk).sum(dim=-1)
    if whole * blk < vocab_size:
        sums[:, whole] = w[:, whole * blk:].sum(dim=-1)
    cum = sums.cumsum(dim=-1)
    total = cum[:, -1]
    # (below the total, so the block found has weight even when zero blocks end the row)
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=cum.shape[1] - 1)
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    cols = (block * blk).unsqueeze(1) + torch.arange(blk)
    inside = cols < vocab_size
    vals = w.gather(1, cols.clamp(max=vocab_size - 1)) * inside
    within = vals.cumsum(dim=-1, dtype=torch.float64)
    j = torch.searchsorted(within, (target - before).unsqueeze(1), right=True).squeeze(1).clamp_(max=blk - 1)
    # The block sums and the walk add in different orders: at the very end of a block the
    # rounding can point past its last positive weight. Take the nearest positive one before it.
    missed = vals.gather(1, j.unsqueeze(1)).squeeze(1) <= 0
    if bool(missed.any()):
        for r in torch.nonzero(missed).flatten().tolist():
            # (there is one: the block has weight, and the walk stops at or after its first)
            j[r] = torch.nonzero(vals[r, : int(j[r]) + 1] > 0).flatten()[-1]
    return cols.gather(1, j.unsqueeze(1)).squeeze(1)


class Sampler:
    """Turns the last-position logits of a batch into one token per row (vLLM v1 order)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from `logits` [B, V] (not modified). Logprobs, when asked for, are the raw
        model log-softmax, before penalties, temperature and filtering (like vLLM)."""
        raw_logits = logits
        logits = self.adjusted_logits(logits, batch)
        greedy_ids = None if batch.all_random else kernels.argmax(logits)
        if batch.all_greedy:
            assert greedy_ids is not None
            sampled = greedy_ids
        else:
            random_ids = sample_weights(filtered_weights(logits, batch), _uniforms(logits.shape[0], batch.generators))
            if greedy_ids is None:
                sampled = random_ids
            else:
                sampled = torch.where(batch.temperature < _SAMPLING_EPS, greedy_ids, random_ids)

        lp = None
        if batch.max_num_logprobs is not None:
            lp = compute_logprobs_tensors(raw_logits, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.to(torch.int64), logprobs=lp)

    @staticmethod
    def adjusted_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 logits after the grammar mask, min_tokens and penalties: greedy rows take their
        argmax. A copy unless a plain greedy batch, which only reads them."""
        plain_greedy = (batch.all_greedy and batch.no_penalties and not batch.min_tokens_mask
                        and batch.grammar_bitmask is None)
        logits = logits.to(torch.float32, copy=not plain_greedy)
        if batch.grammar_bitmask is not None:
            assert batch.grammar_rows is not None
            apply_grammar_bitmask(logits, batch.grammar_bitmask, batch.grammar_rows)
        apply_min_tokens_mask(logits, batch.min_tokens_mask)
        if not batch.no_penalties:
            assert batch.prompt_token_ids is not None and batch.output_token_ids is not None
            assert batch.presence_penalty is not None and batch.frequency_penalty is not None
            apply_penalties(
                logits,
                batch.prompt_token_ids,
                batch.output_token_ids,
                batch.presence_penalty,
                batch.frequency_penalty,
                batch.repetition_penalty,  # type: ignore[arg-type]
            )
        return logits

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution random rows sample from (`filtered_weights`, normalised), made in place
        of `adjusted_logits`. Greedy rows get temperature 1 (discarded)."""
        w = filtered_weights(logits, batch)
        return w.div_(w.sum(dim=-1, keepdim=True))
