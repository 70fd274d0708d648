"""The output processor: a backend's new tokens -> text, stop strings, logprobs and `RequestOutput`s,
the same for every backend (vLLM v1's OutputProcessor). It runs where the tokenizer is: beside the
backend in `LLMEngine` (the offline `LLM`), and in the front end of `AsyncLLM` (the server), whose
engine cores report token ids only and stop the sequences a stop string ended when told to.

    BackendOutput ──► per sequence: tokens -> IncrementalDetokenizer (engine/detokenizer.py), which
                      finds stop strings; logprobs decoded; finish reasons
                  ──► per request that progressed: RequestOutput ("final": once at the end;
                      "cumulative": everything so far; "delta": what is new)
                  ──► with `log_stats`: IterationStats for the stat loggers (engine/stats.py)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from armserve.engine.backend import BackendOutput, SequenceOutput, TokenLogprobs
from armserve.engine.detokenizer import IncrementalDetokenizer
from armserve.engine.input_processor import EngineCoreRequest
from armserve.engine.stats import FinishedRequestStats, IterationStats
from armserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

OUTPUT_KINDS = ("final", "cumulative", "delta")


@dataclass
class _Completion:
    """Output-side state of one of a request's n completions."""

    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    sent_tokens: int = 0  # tokens already handed out (delta mode)
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    reported_final: bool = False


@dataclass
class _Request:
    """A user request: one prompt, `n` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: str
    metrics: RequestMetrics
    completions: list[_Completion]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    pooled: Any = None  # a pooling request's vector

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class OutputProcessor:
    """Every live request's output state. Not thread-safe: the engine's thread calls it."""

    def __init__(self, tokenizer: Any, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}
        # What happened since the last `take_stats` (None: not recorded).
        self.stats: IterationStats | None = IterationStats() if log_stats else None

    def take_stats(self) -> IterationStats:
        """The stats recorded since the last call (needs `log_stats`)."""
        stats, self.stats = self.stats, IterationStats()
        return stats  # type: ignore[return-value]

    def add_request(self, request: EngineCoreRequest, output_kind: str) -> None:
        ids = request.prompt_token_ids
        comps = [_Completion(i, IncrementalDetokenizer(self.tokenizer, ids, p),
                             logprobs=[] if p.logprobs is not None else None,
                             cumulative_logprob=0.0 if p.logprobs is not None else None)
                 for i, p in enumerate(request.seq_params)]
        self.requests[request.request_id] = _Request(
            request.request_id, request.prompt, ids, output_kind, RequestMetrics(arrival_time=request.arrival_time),
            comps, prompt_logprobs=[None] if request.params.prompt_logprobs is not None else None)

    def forget(self, request_id: str) -> None:
        """Drop a request without an output or stats (the engine refused it, or it failed)."""
        self.requests.pop(request_id, None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Forget a request; its last output (its unfinished completions ended "abort"), None if it
        was not live."""
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        if self.stats is not None:
            self.stats.finished.append(self._finished_stats(r, "abort"))
        ended = [CompletionOutput(c.index, "", [], None, None, "abort") for c in r.completions if not c.finish_reason]
        return RequestOutput(request_id, None, None, None, ended, True, r.metrics)  # type: ignore[arg-type]

    def process(self, out: BackendOutput, scheduled_time: float,
                now: float) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """One backend step -> (the outputs of the requests that progressed, the sequences a stop
        string ended that the backend must stop).

        Requests it does not know are skipped: an engine core in another process may report a
        step it ran before the abort (or the stop) this side sent it arrived."""
        requests = self.requests
        for rid, num_cached in out.scheduled.items():
            r = requests.get(rid)
            if r is None:
                continue
            r.num_cached_tokens = num_cached
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = scheduled_time
        for rid in out.preempted:
            if rid in requests:
                requests[rid].metrics.num_preemptions += 1
        for rid, rows in out.prompt_logprobs.items():
            if rid in requests:
                self._add_prompt_logprobs(requests[rid], rows)
        touched: dict[str, _Request] = {}
        stopped: list[tuple[str, int]] = []
        num_tokens = 0
        # This loop runs once per step for every sequence that progressed: keep it lean.
        for seq in out.sequences:
            r = requests.get(seq.request_id)
            if r is None:
                continue
            c = r.completions[seq.index]
            if c.finish_reason is not None:
                continue
            touched[r.request_id] = r
            if seq.pooled is not None:
                r.pooled = seq.pooled
            num_tokens += self._update(r, c, seq, now, stopped)

        stats = self.stats
        outputs: list[RequestOutput] = []
        for r in touched.values():
            finished = r.finished
            if finished:
                r.metrics.finished_time = now
                del requests[r.request_id]
                if stats is not None:
                    length = any(c.finish_reason == "length" for c in r.completions)
                    stats.finished.append(self._finished_stats(r, "length" if length else "stop"))
            if r.output_kind == "final" and not finished:
                continue
            outputs.append(self._make_output(r, finished))
        if stats is not None:
            stats.num_prompt_tokens += out.num_prompt_tokens
            stats.num_generation_tokens += num_tokens
        return outputs, stopped

    def _update(self, r: _Request, c: _Completion, seq: SequenceOutput, now: float,
                stopped: list[tuple[str, int]]) -> int:
        """Take one sequence's new tokens; how many were taken (none after a stop string)."""
        toks, lps = seq.token_ids, seq.logprobs
        last = len(toks) - 1
        for i, tok in enumerate(toks):
            c.token_ids.append(tok)
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
                if self.stats is not None:
                    self.stats.time_to_first_tokens.append(now - r.metrics.arrival_time)
            elif i == 0 and self.stats is not None and r.metrics.last_token_time not in (None, now):
                # (once per request and step: a second completion of it sees last_token_time == now)
                self.stats.inter_token_latencies.append(now - r.metrics.last_token_time)  # type: ignore[operator]
            r.metrics.last_token_time = now
            if lps is not None and i < len(lps) and lps[i] is not None:
                self._add_logprobs(c, lps[i])  # type: ignore[arg-type]
            stop_str = c.detok.update([tok], i == last and seq.finish_reason == "stop")
            if stop_str is not None:
                c.finish_reason, c.stop_reason = "stop", stop_str
                if seq.finish_reason is None:  # (else the backend has ended it already)
                    stopped.append((r.request_id, c.index))
                return i + 1
        if seq.finish_reason is not None:
            c.finish_reason, c.stop_reason = seq.finish_reason, seq.stop_reason
        return len(toks)

    @staticmethod
    def _finished_stats(r: _Request, reason: str) -> FinishedRequestStats:
        m, now = r.metrics, time.time()
        longest = max(len(c.token_ids) for c in r.completions)
        tpot = None
        if m.first_token_time and m.last_token_time and longest > 1:
            tpot = (m.last_token_time - m.first_token_time) / (longest - 1)
        queue_time = m.first_scheduled_time - m.arrival_time if m.first_scheduled_time else None
        prefill = decode = None  # (vLLM's phases: first scheduled -> first token -> last token)
        if m.first_token_time and m.first_scheduled_time:
            prefill = m.first_token_time - m.first_scheduled_time
            decode = (m.last_token_time or m.first_token_time) - m.first_token_time
        return FinishedRequestStats(reason, len(r.prompt_token_ids), sum(len(c.token_ids) for c in r.completions),
                                    now - m.arrival_time, queue_time, tpot, prefill, decode)

    @staticmethod
    def _add_logprobs(c: _Completion, lp: TokenLogprobs) -> None:
        c.logprobs.append(_position(*lp, c.detok.decode_token))  # type: ignore[union-attr]
        c.cumulative_logprob += lp[1][0]  # type: ignore[operator]

    @staticmethod
    def _add_prompt_logprobs(r: _Request, rows: tuple[list[list[int]], list[list[float]], list[int]]) -> None:
        dec = r.completions[0].detok.decode_token
        r.prompt_logprobs.extend(_position(*row, dec) for row in zip(*rows))  # type: ignore[union-attr]

    @staticmethod
    def _make_output(r: _Request, finished: bool) -> RequestOutput:
        delta = r.output_kind == "delta"
        comps: list[CompletionOutput] = []
        for c in r.completions:
            if delta:
                if c.reported_final:
                    continue
                toks = c.token_ids[c.sent_tokens:]
                lps = c.logprobs[c.sent_logprobs:] if c.logprobs is not None else None
                if not toks and c.finish_reason is None:
                    continue
                text = c.detok.get_next_output_text(c.finish_reason is not None, delta=True)
                c.sent_tokens = len(c.token_ids)
                c.sent_logprobs = len(c.logprobs) if c.logprobs is not None else 0
            else:
                toks = list(c.token_ids)
                lps = list(c.logprobs) if c.logprobs is not None else None
                text = c.detok.get_next_output_text(c.finish_reason is not None, delta=False)
            if c.finish_reason is not None:
                c.reported_final = True
            comps.append(CompletionOutput(c.index, text, toks, c.cumulative_logprob, lps, c.finish_reason,
                                          c.stop_reason))
        return RequestOutput(request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
                             prompt_logprobs=r.prompt_logprobs, outputs=comps, finished=finished, metrics=r.metrics,
                             num_cached_tokens=r.num_cached_tokens, pooled=r.pooled)


def _position(ids: list[int], vals: list[float], rank: int, decode: Callable[[int], str]) -> dict[int, Logprob]:
    """One position's logprobs: the chosen token (ids[0], of `rank`) first, then the alternatives
    in rank order (one entry per token)."""
    pos = {ids[0]: Logprob(vals[0], rank, decode(ids[0]))}
    for r, (t, v) in enumerate(zip(ids[1:], vals[1:]), start=1):
        if t not in pos:
            pos[t] = Logprob(v, r, decode(t))
    return pos
