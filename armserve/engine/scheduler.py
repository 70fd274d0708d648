"""The scheduler: one token budget per step, running requests first, then waiting ones.

There is no prefill or decode phase. Each request knows how many of its tokens have KV in the
cache (`num_computed_tokens`); each step it is offered `num_tokens - num_computed_tokens` more,
capped by what is left of `max_num_batched_tokens`. A long prompt therefore moves in chunks
beside running decodes, a prefix-cache hit just starts a request further along, and a
preempted request is recomputed by the same rule.

A pooling engine (engine/pooling_backend.py) schedules with `chunked_prefill=False`: a request
runs whole in one step or waits for a step with room for it (an encoder sees every token at once).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from armserve.engine.kv_cache_manager import KVCacheManager
from armserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so it yields a new one."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

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
    ) -> None:
        self.kv = kv
        self.chunked_prefill = chunked_prefill
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

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled = True
            while not kv.allocate_slots(req, n):
                # Out of blocks: preempt the newest running request and retry.
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            out.scheduled.append(ScheduledRequest(req, n, kv.get_block_ids(req.request_id)))
            budget -= n
            i += 1

        # NOTE: after a preemption memory is tight: admitting new work would only thrash.
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
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
                out.scheduled.append(ScheduledRequest(req, n, kv.get_block_ids(req.request_id)))
                budget -= n

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
        self, out: SchedulerOutput, sampled: list[int | None]
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens and finish requests that hit a
        stop token, `max_tokens` or `max_model_len`. Returns the requests that got a token.

        This loop runs once per step for every scheduled request: keep it lean.
        """
        got_token: list[Request] = []
        for sched, token in zip(out.scheduled, sampled):
            req = sched.request
            req.num_computed_tokens += sched.num_new_tokens
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.append_output_token(token)
            got_token.append(req)
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
            if status is not None:
                self.finish_request(req.request_id, status)
        return got_token
