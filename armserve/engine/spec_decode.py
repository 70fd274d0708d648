"""Speculative decoding, the proposing half: n-gram (prompt lookup) drafts and how many to draft.

Each step the scheduler asks `NgramProposer.propose` for up to k draft tokens per decoding
request; the runner verifies them in the same forward as everything else in the batch
(engine/rejection_sampler.py), and `SpecState.update` adapts the request's k to how many it
accepted.

    tokens:  ... a b c d e ...... x a b c          (prompt + output so far)
                 └─┬─┘ └┬┘              └─┬─┘
                   │    drafts: d e ...   the last n tokens, n = prompt_lookup_max .. min
                   └ their latest earlier occurrence

Lookup is a dict per n from each n-gram to the position after its latest occurrence, extended by
the tokens added since the last step: O(new tokens) per step, never a scan of the sequence.
"""

from __future__ import annotations

from armserve.config import SPEC_BACKOFF_STEPS, SPEC_MAX_BACKOFF_STEPS, SpeculativeConfig
from armserve.engine.request import Request


class SpecState:
    """One request's n-gram index (or draft-model progress) and its adaptive draft length."""

    __slots__ = ("maps", "indexed", "k", "resume_step", "backoff", "draft_computed", "epoch", "suffix",
                 "eagle")

    def __init__(self, nmin: int, nmax: int, k: int) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(nmax, nmin - 1, -1)}
        self.indexed = 0  # n-grams ending before this position are in `maps`
        self.k = k  # tokens to draft now (0: paused until resume_step)
        self.resume_step = 0
        self.backoff = SPEC_BACKOFF_STEPS
        # a draft model's (engine/draft_proposer.py): leading tokens with draft KV, and the
        # request's preemption count when they were computed
        self.draft_computed = 0
        self.epoch = 0
        self.suffix = None  # suffix decoding's per-request trees (engine/suffix_decode.py)
        # an EAGLE-3 head's first draft (engine/eagle_proposer.py): (position, preemption count,
        # token, the hidden state it feeds back), from the last step's record
        self.eagle = None

    def update(self, num_drafted: int, num_accepted: int, max_k: int, step: int) -> None:
        """Adapt to one verification: a fully accepted run drafts the full k next (and clears the
        back-off: the text is being copied), a partial one a token more than it accepted, a run with
        nothing accepted halves the length; at 0 drafting pauses, for longer each time.

        NOTE: a full run jumps to max_k rather than climbing by one: replaying the greedy outputs
        of bench_spec's prompts, climbing 1, 2, 3, 4 into each copied span cost SmolLM2's code
        edit 6% more steps."""
        if num_accepted == num_drafted:
            self.k = max_k
            self.backoff = SPEC_BACKOFF_STEPS
        elif num_accepted:
            self.k = num_accepted + 1
        else:
            self.k //= 2
            if self.k == 0:
                self.resume_step = step + self.backoff
                self.backoff = min(2 * self.backoff, SPEC_MAX_BACKOFF_STEPS)


def speculation_allowed(req: Request) -> bool:
    """Whether a request may take drafts at all. Off, so outputs stay exact and reproducible, for:
    structured outputs (the grammar would have to run ahead over drafts) and seeded sampling (its
    text must not depend on what shares the batch, while whether a step speculates does)."""
    p = req.params
    if req.grammar is not None or p.structured_outputs is not None:
        return False
    return p.seed is None or p.greedy


def request_state(req: Request, nmin: int, nmax: int, k: int) -> SpecState | None:
    """The request's state (made on first use), or None when it must not speculate."""
    st = req.spec
    if st is None:
        if not speculation_allowed(req):
            req.spec = False
            return None
        st = req.spec = SpecState(nmin, nmax, k)
    return st or None


def draft_limit(st: SpecState | None, step: int, limit: int) -> int:
    """How many tokens a request may draft this step: its adaptive k capped by `limit`, 0 while
    it is backed off (a back-off that ran out tries one token again)."""
    if st is None or limit <= 0:
        return 0
    if st.k == 0:
        if step < st.resume_step:
            return 0
        st.k = 1
    return min(limit, st.k)


class NgramProposer:
    """Prompt-lookup drafts (`speculative_config` method "ngram")."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.nmin: int = config.prompt_lookup_min  # type: ignore[assignment]
        self.nmax: int = config.prompt_lookup_max  # type: ignore[assignment]
        self.step = 0  # scheduler steps that could speculate (for back-off)

    def state(self, req: Request) -> SpecState | None:
        return request_state(req, self.nmin, self.nmax, self.k)

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(limit, the request's k) tokens that followed the latest earlier occurrence of
        the sequence's longest matching suffix; [] when nothing matches."""
        st = self.state(req)
        k = draft_limit(st, self.step, limit)
        if k == 0:
            return []
        toks = req.all_token_ids
        end = len(toks)
        # Index the n-grams that end at positions [indexed, end): the one ending at `end` is the
        # suffix being looked up and must not find itself.
        for n, table in st.maps.items():
            for p in range(max(st.indexed, n), end):
                table[tuple(toks[p - n:p])] = p
        st.indexed = end
        for n, table in st.maps.items():
            if n > end:
                continue
            p = table.get(tuple(toks[end - n:]))
            if p is not None:
                return toks[p:p + k]
        return []
