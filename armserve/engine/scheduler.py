"""The scheduler: one token budget per step, running requests first, then waiting ones.

There is no prefill or decode phase. Each request knows how many of its tokens have KV in the
cache (`num_computed_tokens`); each step it is offered `num_tokens - num_computed_tokens` more,
capped by what is left of `max_num_batched_tokens`. A long prompt therefore moves in chunks
beside running decodes, a prefix-cache hit just starts a request further along, and a
preempted request is recomputed by the same rule.

A pooling engine (engine/pooling_backend.py) schedules with `chunked_prefill=False`: a request
runs whole in one step or waits for a step with room for it (an encoder sees every token at once).

With speculative decoding (engine/spec_decode.py) a decoding request may carry k draft tokens:
it is scheduled as 1 + k query tokens (from the same budget, with KV slots for all of them), and
`update_from_output` keeps the KV of the accepted ones only (engine/rejection_sampler.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from armserve.engine.kv_cache_manager import KVCacheManager
from armserve.engine.request import Request, RequestStatus
from armserve.engine.spec_decode import NgramProposer
from armserve.engine.stats import SpecDecodingStats


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # including the drafts
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)  # drafts after the last known token

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so it yields a new one."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == r.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    speculating: bool = False  # the step may draft (not turned off for a large batch)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        chunked_prefill: bool = True,
        proposer: NgramProposer | None = None,  # or a DraftModelProposer, SuffixProposer
        max_loras: int | None = None,  # LoRA: adapters the running requests may use at once (None: no LoRA)
    ) -> None:
        self.kv = kv
        self.chunked_prefill = chunked_prefill
        self.proposer = proposer
        self.max_loras = max_loras
        self.spec_stats = SpecDecodingStats.empty(proposer.k) if proposer is not None else None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Stop a request (abort, stop string) and free its blocks at once."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = status
        self.kv.free(request_id)
        if req.spec and hasattr(self.proposer, "finish"):
            self.proposer.finish(req)  # (suffix decoding keeps the request's output for others)
        return req

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv

        proposer = self.proposer
        share = proposer.config.draft_share(len(self.running)) if proposer is not None else 0
        if share == 0:
            proposer = None  # a batch this large: verifying drafts costs more than it saves
        if proposer is not None:
            proposer.step += 1
            out.speculating = True
        batched = proposer is not None and getattr(proposer, "batched", False)
        pending: list[tuple[ScheduledRequest, int]] = []  # (a draft model's requests, tokens to draft)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts: list[int] = []
            reserve = 0  # slots for a draft model's tokens, drafted once every slot is allocated
            if proposer is not None and n == 1 and req.num_computed_tokens + 1 == req.num_tokens:
                # never draft past max_tokens or max_model_len, nor past the budget or the request's
                # share of the step's verify budget
                limit = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1,
                            budget - 1, share)
                if batched:
                    reserve = proposer.draft_length(req, limit)  # type: ignore[union-attr]
                else:
                    drafts = proposer.propose(req, limit)
            scheduled = True
            while not kv.allocate_slots(req, n + len(drafts) + reserve):
                if drafts or reserve:
                    drafts, reserve = [], 0  # drafts are never worth a preemption
                    continue
                # Out of blocks: preempt the newest running request and retry.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            n += len(drafts)
            sched = ScheduledRequest(req, n, kv.get_block_ids(req.request_id), drafts)
            out.scheduled.append(sched)
            if reserve:
                pending.append((sched, reserve))
            budget -= n + reserve
            i += 1
        if pending:
            # a preemption above may have taken a pending request's blocks
            pending = [(s, r) for s, r in pending if s.request.status == RequestStatus.RUNNING]
            found = proposer.propose_batch(  # type: ignore[union-attr]
                [(s.request, r, s.block_ids) for s, r in pending])
            for (s, r), d in zip(pending, found):
                s.spec_token_ids = d
                s.num_new_tokens += len(d)
                budget += r - len(d)
                if len(d) < r:
                    kv.trim(s.request.request_id, s.request.num_tokens + len(d))

        # NOTE: after a preemption memory is tight: admitting new work would only thrash.
        if not out.preempted:
            # LoRA (vLLM's rule): a request whose adapter would make the running set exceed max_loras
            # waits, and those behind it may go first.
            adapters = None if self.max_loras is None else {
                r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                lora = req.lora_request
                if adapters is not None and lora is not None and lora.lora_int_id not in adapters:
                    if len(adapters) >= self.max_loras:  # type: ignore[operator]
                        skipped.append(self.waiting.popleft())
                        continue
                hit_blocks = kv.get_computed_blocks(req)
                num_hit = len(hit_blocks) * kv.block_size
                if not self.chunked_prefill and req.num_tokens - num_hit > budget:
                    break  # whole or not at all: it waits for a step with room (FIFO)
                n = min(req.num_tokens - num_hit, budget)
                if not kv.allocate_slots(req, n, hit_blocks):
                    break
                self.waiting.popleft()
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                req.num_computed_tokens = num_hit
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                if adapters is not None and lora is not None:
                    adapters.add(lora.lora_int_id)
                out.scheduled.append(ScheduledRequest(req, n, kv.get_block_ids(req.request_id)))
                budget -= n
            self.waiting.extendleft(reversed(skipped))

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_from_output(
        self, out: SchedulerOutput, sampled: list[int | None], accepted: dict[int, list[int]] | None = None
    ) -> list[list[int] | None]:
        """Advance computed counts, append sampled tokens and finish requests that hit a
        stop token, `max_tokens` or `max_model_len`. `accepted[i]`: the drafts of scheduled
        request i that were accepted (its tokens this step are those, then `sampled[i]`).
        Returns each scheduled request's new tokens (None: a prefill chunk), cut after the
        token that finished it.

        This loop runs once per step for every scheduled request: keep it lean.
        """
        new_tokens: list[list[int] | None] = []
        for idx, (sched, token) in enumerate(zip(out.scheduled, sampled)):
            req = sched.request
            if token is None:
                req.num_computed_tokens += sched.num_new_tokens
                new_tokens.append(None)  # a prefill chunk that did not reach the end of the prompt
                continue
            if not sched.spec_token_ids:
                req.num_computed_tokens += sched.num_new_tokens
                new_tokens.append([token])
                self._append(req, token)
                continue
            # A verified run: keep the KV of the last known token and of the accepted drafts only.
            acc = accepted[idx] if accepted else []
            num_drafts = len(sched.spec_token_ids)
            req.num_computed_tokens += sched.num_new_tokens - num_drafts + len(acc)
            self._record_spec(req, num_drafts, len(acc))
            toks = acc + [token]
            for j, t in enumerate(toks):
                if self._append(req, t):
                    toks = toks[: j + 1]  # never past a stop token or the length limit
                    break
            else:
                self.kv.trim(req.request_id, req.num_tokens)  # the rejected drafts' blocks
            new_tokens.append(toks)
        return new_tokens

    def _append(self, req: Request, token: int) -> bool:
        """Append one token; finish the request (True) on a stop token, its grammar's end,
        `max_tokens` or `max_model_len`."""
        req.append_output_token(token)
        params = req.params
        status = None
        if req.grammar is not None and not req.grammar.accept_token(token):
            # Cannot happen with the mask applied, short of every allowed token being -inf/NaN.
            status = RequestStatus.FINISHED_STOPPED
        elif req.grammar is not None and req.grammar.is_terminated():
            status = RequestStatus.FINISHED_STOPPED  # the grammar is complete (it took a stop token)
            req.stop_reason = None
        elif token in params.all_stop_token_ids and req.num_output_tokens >= params.min_tokens:
            status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token if token in params.stop_token_ids else None
        elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is None:
            return False
        self.finish_request(req.request_id, status)
        return True

    def _record_spec(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        st = self.spec_stats
        st.num_drafts += 1  # type: ignore[union-attr]
        st.num_draft_tokens += num_drafts  # type: ignore[union-attr]
        st.num_accepted_tokens += num_accepted  # type: ignore[union-attr]
        per_pos = st.num_accepted_tokens_per_pos  # type: ignore[union-attr]
        for j in range(num_accepted):
            per_pos[j] += 1
        proposer = self.proposer
        req.spec.update(num_drafts, num_accepted, proposer.k, proposer.step)  # type: ignore[union-attr]
