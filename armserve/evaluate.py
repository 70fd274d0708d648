"""Model-quality measurements through the engine itself (so they cover its kernels and KV cache)."""

from __future__ import annotations

import math
from typing import Sequence

from armserve.sampling_params import SamplingParams


def perplexity(llm, token_ids: Sequence[int], window: int) -> float:
    """Perplexity of `token_ids` under `llm` by teacher forcing, in windows of `window` tokens.

    The text is cut into consecutive, non-overlapping windows; each is one request whose prompt
    logprobs (`prompt_logprobs=0`: the logprob of each actual next token) are scored, so the first
    token of every window is context only. Returns exp(-mean logprob) over all scored tokens.
    """
    ids = [int(t) for t in token_ids]
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens (one to condition on, one to score), got {window}")
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    max_len = llm.llm_engine.max_model_len
    if window > max_len:
        raise ValueError(f"window {window} exceeds the engine's max_model_len {max_len}")
    # A lone last token would be context for nothing: it scores no token, so it is left out.
    chunks = [c for c in (ids[i:i + window] for i in range(0, len(ids), window)) if len(c) >= 2]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks], params, use_tqdm=False)
    total, count = 0.0, 0
    for chunk, out in zip(chunks, outs):
        for pos in range(1, len(chunk)):
            total += out.prompt_logprobs[pos][chunk[pos]].logprob
            count += 1
    return math.exp(-total / count)
