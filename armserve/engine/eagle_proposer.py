"""Speculative decoding with a head that drafts from the target's own hidden states: an EAGLE-3
head (`speculative_config` method "eagle3", models/eagle3.py) or a DeepSeek-V3 MTP layer ("mtp",
models/deepseek_mtp.py). The head: `combine(aux)` makes its hidden input from the target's kept
hidden states, `forward(ids, positions, hidden)` -> (normed, fed back), `draft_token_ids(normed)`.

Its KV cache has the target's block layout under the target's block ids (a draft model's
arrangement, engine/draft_proposer.py), so a request's block table serves both. Two halves:

    record   right after each target step (TorchBackend.step): the target's kept hidden states
             of the rows it keeps (the prompt chunk, or the last known token and the accepted
             drafts) are fused by `fc` and run through the head, position p with the token at
             p + 1 (known by then: the step's sampled token ends the row), in one forward over
             the batch; this writes the head's KV, and the last row of each request that
             decodes next gives its first draft d_0 and the hidden state it feeds back.
    propose  when the scheduler has allocated the step's slots: d_0, then one single-token
             head step per further draft, each on the head's previous output and draft.

The rows of rejected drafts are overwritten by the next record before anything attends to them.
A step the scheduler runs without speculation (a large batch) skips the record, and so does a
request backed off from drafting (engine/spec_decode.py) until the step before it drafts again:
those positions keep stale head KV, and a request drafts nothing until a record has run for it.
Stale head KV (skipped steps, a prefix-cache hit on blocks another request filled) only lowers
acceptance: the target verifies every token. The head drafts its argmax, a point mass, so the rejection rule
is the n-gram one (engine/rejection_sampler.py).
"""

from __future__ import annotations

import torch

from armserve.config import SpeculativeConfig
from armserve.engine.draft_proposer import DraftModelProposer, _View
from armserve.engine.request import Request
from armserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from armserve.engine.spec_decode import SpecState
from armserve.layers.attention import set_attention_metadata


class EagleProposer(DraftModelProposer):
    """Drafts from an EAGLE-3 head or MTP layer (`runner`: a ModelRunner over the head, for its KV
    cache and step layout, on the target's block ids)."""

    def __init__(self, config: SpeculativeConfig, runner) -> None:
        super().__init__(config, runner)  # per-request state and draft length as a draft model's
        self.head = runner.model

    @torch.inference_mode()
    def record(self, out: SchedulerOutput, starts: list[int], aux: torch.Tensor) -> None:
        """After a target step (the scheduler updated): `starts` are the requests' computed counts
        before it, `aux` the target's kept hidden states of every scheduled row (schedule order)."""
        rows: list[int] = []
        sched: list[ScheduledRequest] = []
        reqs: list[Request] = []
        base = 0
        nxt = self.step + 1
        for s, c0 in zip(out.scheduled, starts):
            req = s.request
            r0, base = base, base + s.num_new_tokens
            c1 = req.num_computed_tokens
            st = None if req.is_finished or c1 <= c0 else self.state(req)
            # NOTE: a request backed off from drafting (its drafts were rejected) skips the head
            # until the step before it drafts again: its head KV of those positions stays stale
            # (a little less acceptance then), and a head that is wrong costs next to nothing.
            if st is None or (st.k == 0 and nxt < st.resume_step):
                continue
            rows.extend(range(r0, r0 + c1 - c0))
            # position p pairs the target's hidden state at p with the token at p + 1
            sched.append(ScheduledRequest(_View(c0, []), c1 - c0, s.block_ids,  # type: ignore[arg-type]
                                          req.all_token_ids[c0 + 1:c1 + 1]))
            reqs.append(req)
        if not sched:
            return
        hidden = self.head.combine(aux.index_select(0, torch.tensor(rows, dtype=torch.long)))
        normed, fed, row_end = self._forward(sched, hidden)
        ready = [i for i, r in enumerate(reqs) if r.num_computed_tokens + 1 == r.num_tokens]  # decodes next
        if not ready:
            return
        sel = torch.tensor([row_end[i] for i in ready], dtype=torch.long)
        tokens = self.head.draft_token_ids(normed.index_select(0, sel))
        fed = fed.index_select(0, sel)
        for j, i in enumerate(ready):
            r = reqs[i]
            r.spec.eagle = (r.num_tokens - 1, r.num_preemptions, tokens[j], fed[j:j + 1])  # type: ignore[union-attr]

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[Request, int, list[int]]]) -> list[list[int]]:
        """Drafts for (request, tokens to draft, its block ids) each, in order: [] for a request
        whose last step was not recorded."""
        drafts: list[list[int]] = [[] for _ in items]
        rows = []  # (index, request, k, blocks, hidden fed back)
        for i, (req, k, blocks) in enumerate(items):
            st: SpecState = req.spec  # type: ignore[assignment]
            ready, st.eagle = st.eagle, None
            if ready is None or ready[:2] != (req.num_tokens - 1, req.num_preemptions) or k < 1:
                continue
            drafts[i].append(ready[2])
            rows.append((i, req, k, blocks, ready[3]))
        for j in range(1, max((r[2] for r in rows), default=0)):
            rows = [r for r in rows if r[2] > j]
            # draft j - 1 at position num_tokens + j - 2 (the head's rows trail the target's by one)
            sched = [ScheduledRequest(_View(req.num_tokens + j - 2, []), 1, blocks,  # type: ignore[arg-type]
                                      [drafts[i][-1]]) for i, req, _, blocks, _ in rows]
            normed, fed, _ = self._forward(sched, torch.cat([r[4] for r in rows]))
            for r, t in zip(rows, self.head.draft_token_ids(normed)):  # (one row each, in order)
                drafts[r[0]].append(t)
            rows = [(*r[:4], fed[n:n + 1]) for n, r in enumerate(rows)]
        return drafts

    def _forward(self, sched: list[ScheduledRequest], hidden: torch.Tensor):
        """The head over `sched`'s rows (`hidden`: theirs, in schedule order): (normed, fed back,
        each request's last row), the outputs in schedule order too."""
        runner = self.runner
        input_ids, positions, md, row_end, order = runner._prepare(SchedulerOutput(sched))
        # the runner orders rows decodes first: put the hidden rows the same way
        starts, at = [], 0
        for s in sched:
            starts.append(at)
            at += s.num_new_tokens
        perm = [starts[i] + j for i in order for j in range(sched[i].num_new_tokens)]
        identity = perm == list(range(len(perm)))
        if not identity:
            hidden = hidden.index_select(0, torch.tensor(perm, dtype=torch.long))
        set_attention_metadata(md)
        try:
            normed, fed = self.head(input_ids, positions, hidden.contiguous())
        finally:
            set_attention_metadata(None)
        if not identity:  # back to schedule order
            inv = torch.empty(len(perm), dtype=torch.long)
            inv[torch.tensor(perm, dtype=torch.long)] = torch.arange(len(perm))
            normed, fed = normed.index_select(0, inv), fed.index_select(0, inv)
            row_end = [starts[i] + s.num_new_tokens - 1 for i, s in enumerate(sched)]
        return normed, fed, row_end
