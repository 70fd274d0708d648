"""The async engine: `LLMEngine` driven by a background thread, each request an async stream.

    asyncio thread (HTTP)                         engine thread (owns LLMEngine)
    ---------------------                         ------------------------------
    await add_request() ──► inbox (SimpleQueue) ──► engine.add_request / abort_request
    async for out in stream ◄── loop.call_soon_threadsafe ◄── engine.step() outputs (deltas)

The engine is not thread-safe, so exactly one thread touches it; everything else talks to that
thread through the inbox. Outputs cross back in one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Protocol, Sequence

from armserve.config import EngineConfig
from armserve.engine.llm_engine import LLMEngine, PromptType
from armserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")

DEFAULT_STATS_INTERVAL = 5.0  # seconds between stats lines while busy


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down or crashed); no request can be served."""


# ---- statistics handed to stat loggers -------------------------------------------------------


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the engine's state after a step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # cumulative, in tokens
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # cumulative

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(slots=True)
class FinishedRequestStats:
    """One request's life, recorded when it finishes or is aborted."""

    finish_reason: str  # "stop", "length" or "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    queue_time: float | None
    time_per_output_token: float | None  # mean over the request's decode, None with < 2 tokens


@dataclass(slots=True)
class IterationStats:
    """What happened since the previous record: tokens, first tokens, finished requests."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives stats from the engine thread (implementations must be thread-safe to read)."""

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None: ...


class LoggingStatLogger:
    """Logs one vLLM-style throughput line every `interval` seconds while the engine is busy."""

    def __init__(self, interval: float = DEFAULT_STATS_INTERVAL) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._last: SchedulerStats = SchedulerStats()
        self._last_line_busy = False

    def record(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self._prompt_tokens += iteration.num_prompt_tokens
        self._generation_tokens += iteration.num_generation_tokens
        self._last = scheduler

    def maybe_log(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        elapsed = now - self._last_time
        if elapsed < self.interval:
            return
        s = self._last
        busy = bool(self._prompt_tokens or self._generation_tokens or s.num_running or s.num_waiting)
        # NOTE: one more line after going idle, so the log shows the engine drained to zero.
        if busy or self._last_line_busy:
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                self._prompt_tokens / elapsed, self._generation_tokens / elapsed,
                s.num_running, s.num_waiting, 100 * s.kv_cache_usage, 100 * s.prefix_cache_hit_rate,
            )
        self._last_line_busy = busy
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0


# ---- per-request streams ---------------------------------------------------------------------


def merge_delta_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Join two consecutive delta outputs of one request into one (`b` came later)."""
    comps: dict[int, CompletionOutput] = {
        c.index: CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                                  list(c.logprobs) if c.logprobs is not None else None,
                                  c.finish_reason, c.stop_reason)
        for c in a.outputs
    }
    for c in b.outputs:
        prev = comps.get(c.index)
        if prev is None:
            comps[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
    return RequestOutput(
        request_id=b.request_id,
        prompt=b.prompt,
        prompt_token_ids=b.prompt_token_ids,
        prompt_logprobs=b.prompt_logprobs,  # cumulative in the engine: the later one has it all
        outputs=[comps[i] for i in sorted(comps)],
        finished=b.finished,
        metrics=b.metrics,
        num_cached_tokens=b.num_cached_tokens,
    )


class RequestStream:
    """The outputs of one request as an async iterator of deltas.

    When the reader falls behind, queued deltas are merged, so a slow client gets fewer,
    larger chunks instead of an ever-growing backlog. Closing an unfinished stream aborts
    the request, which frees its KV blocks at once.
    """

    def __init__(self, request_id: str, owner: "AsyncLLM", loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:  # event-loop thread only
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output (merged deltas); raises the engine's error if the request failed."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        while self._items and isinstance(self._items[0], RequestOutput):
            item = merge_delta_outputs(item, self._items.popleft())  # type: ignore[arg-type]
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

    def close(self) -> None:
        """Stop reading; aborts the request if it has not finished. Safe to call twice."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._owner.abort(self.request_id)


# ---- commands sent to the engine thread ------------------------------------------------------


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    accepted: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


class _Stop:
    pass


@dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping of one live request, for streams and statistics."""

    stream: RequestStream
    n: int
    num_prompt_tokens: int
    metrics: RequestMetrics | None = None
    tokens_per_completion: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def num_generation_tokens(self) -> int:
        return sum(self.tokens_per_completion.values())


class AsyncLLM:
    """An `LLMEngine` stepping in a background thread, serving many async callers at once.

    Usage::

        llm = AsyncLLM(EngineConfig(model=path))
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text, end="")   # deltas
        llm.shutdown()

    The model loads in the constructor (in the caller's thread), then the engine thread starts.
    """

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        stats_interval: float | None = None,
        stat_loggers: Sequence[StatLogger] = (),
    ) -> None:
        self.engine = LLMEngine(config)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        if stats_interval is None:
            stats_interval = float(os.environ.get("ARMSERVE_LOG_STATS_INTERVAL", DEFAULT_STATS_INTERVAL))
        self._log_stats = LoggingStatLogger(stats_interval) if log_stats else None
        self._stat_loggers: list[StatLogger] = list(stat_loggers)
        if self._log_stats is not None:
            self._stat_loggers.append(self._log_stats)
        self._stats_interval = stats_interval
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._dead: BaseException | None = None
        self._scheduler_stats = self._snapshot()
        # NOTE: a thread, not a process: torch releases the GIL inside its kernels, so while a
        # step computes, the asyncio thread keeps parsing requests and streaming tokens. A
        # process would add a serialization hop per step for no gain at CPU-sized batches.
        self._warmed_up = threading.Event()
        self._thread = threading.Thread(target=self._run, name="armserve-engine", daemon=True)
        self._thread.start()
        self._warmed_up.wait()  # ready only once the engine thread has run its warm-up step

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Attach a logger (e.g. Prometheus); call before submitting requests."""
        self._stat_loggers.insert(0, stat_logger)
        stat_logger.record(self._scheduler_stats, IterationStats())

    # ---- public API (any thread / the event loop) ------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped, or None while it runs."""
        return self._dead

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engine state after its latest step (replaced atomically; safe to read)."""
        return self._scheduler_stats

    async def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Submit a request; returns its stream once the engine has accepted it.

        Raises the engine's `ValueError` (naming the problem) if the request is invalid, and
        `EngineDeadError` if the engine is not running.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        loop = asyncio.get_running_loop()
        if params.structured_outputs is not None:
            # NOTE: compiled here, on a worker thread, so a large schema (0.1-1 s) never stalls the
            # engine's steps; the engine then finds it in the grammar cache.
            await loop.run_in_executor(None, self.engine.structured.compile, params.structured_outputs)
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(request_id, self, loop)
        accepted = loop.create_future()
        self._inbox.put(_Add(request_id, prompt, params, arrival_time or time.time(), stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its delta outputs; closing the generator early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (thread-safe); their KV blocks are freed before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._inbox.put(_Abort(ids))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; unfinished requests end with `EngineDeadError`."""
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            # On this thread: the kernels' per-thread scratch buffers and the memory a large step
            # touches are then in place before the first request (ARMSERVE_WARMUP=0 skips it).
            try:
                if os.environ.get("ARMSERVE_WARMUP", "1") != "0":
                    engine.warm_up()
            finally:
                self._warmed_up.set()
            while True:
                if not self._drain_inbox(block=not engine.has_unfinished_requests()):
                    break
                if engine.has_unfinished_requests():
                    self._step()
                if self._log_stats is not None:
                    self._log_stats.maybe_log()
            self._fail_all(EngineDeadError("the engine was shut down"))
        except BaseException as e:  # a bug in the engine: fail every request, report unhealthy
            logger.exception("engine loop crashed; failing all requests")
            self._fail_all(EngineDeadError(f"the engine crashed: {type(e).__name__}: {e}"))
        finally:
            if self._dead is None:
                self._dead = EngineDeadError("the engine was shut down")

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued commands; waits for one if `block`. Returns False on shutdown."""
        first = True
        while True:
            try:
                if block and first:
                    # Wake up at the stats interval even when idle, for the final stats line.
                    cmd = self._inbox.get(timeout=self._stats_interval)
                else:
                    cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True
            first = False
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._handle_add(cmd)
            else:
                self._handle_abort(cmd.request_ids)

    def _handle_add(self, cmd: _Add) -> None:
        loop = cmd.stream._loop
        try:
            text, ids = self.engine.tokenize_prompt(cmd.prompt)
            prompt = {"prompt": text, "prompt_token_ids": ids}
            self.engine.add_request(cmd.request_id, prompt, cmd.params, cmd.arrival_time, output_kind="delta")
        except Exception as e:  # validation errors name the problem; the engine is untouched
            loop.call_soon_threadsafe(_resolve, cmd.accepted, e)
            return
        self._tracked[cmd.request_id] = _Tracked(cmd.stream, cmd.params.n, len(ids))
        loop.call_soon_threadsafe(_resolve, cmd.accepted, None)

    def _handle_abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if rid in self._tracked]
        if not live:
            return
        self.engine.abort_request(live)
        it = IterationStats()
        deliveries: list[tuple[RequestStream, RequestOutput]] = []
        for rid in live:
            t = self._tracked.pop(rid)
            it.finished.append(self._finished_stats(t, "abort"))
            # Tell a reader that may still be waiting that the request is over.
            outs = [CompletionOutput(i, "", [], None, None, "abort") for i in range(t.n) if i not in t.finish_reasons]
            deliveries.append((t.stream, RequestOutput(rid, None, [], None, outs, True, t.metrics)))
        self._deliver(deliveries)
        self._record(it)

    def _step(self) -> None:
        engine = self.engine
        prompt_before = engine.num_prompt_tokens_total
        gen_before = engine.num_generation_tokens_total
        outputs = engine.step()
        it = IterationStats(
            num_prompt_tokens=engine.num_prompt_tokens_total - prompt_before,
            num_generation_tokens=engine.num_generation_tokens_total - gen_before,
        )
        deliveries: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            t = self._tracked.get(out.request_id)
            if t is None:
                continue
            t.metrics = out.metrics
            had_tokens = t.num_generation_tokens > 0
            for c in out.outputs:
                t.tokens_per_completion[c.index] = t.tokens_per_completion.get(c.index, 0) + len(c.token_ids)
                if c.finish_reason is not None:
                    t.finish_reasons[c.index] = c.finish_reason
            m = out.metrics
            if not had_tokens and t.num_generation_tokens > 0 and m is not None and m.first_token_time:
                it.time_to_first_tokens.append(m.first_token_time - m.arrival_time)
            if out.finished:
                del self._tracked[out.request_id]
                reason = "length" if "length" in t.finish_reasons.values() else "stop"
                it.finished.append(self._finished_stats(t, reason))
            deliveries.append((t.stream, out))
        self._deliver(deliveries)
        self._record(it)

    def _finished_stats(self, t: _Tracked, reason: str) -> FinishedRequestStats:
        m = t.metrics
        now = time.time()
        tpot = None
        longest = max(t.tokens_per_completion.values(), default=0)
        if m is not None and m.first_token_time and m.last_token_time and longest > 1:
            tpot = (m.last_token_time - m.first_token_time) / (longest - 1)
        queue_time = None
        if m is not None and m.first_scheduled_time:
            queue_time = m.first_scheduled_time - m.arrival_time
        e2e = now - m.arrival_time if m is not None else 0.0
        return FinishedRequestStats(reason, t.num_prompt_tokens, t.num_generation_tokens, e2e, queue_time, tpot)

    def _snapshot(self) -> SchedulerStats:
        e = self.engine
        kv = e.kv
        return SchedulerStats(
            num_running=e.scheduler.num_running,
            num_waiting=e.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_preemptions=e.scheduler.num_preemptions,
        )

    def _record(self, it: IterationStats) -> None:
        self._scheduler_stats = snap = self._snapshot()
        for sl in self._stat_loggers:
            try:
                sl.record(snap, it)
            except Exception:  # a metrics bug must never take the engine down
                logger.exception("stat logger %r failed", sl)

    def _deliver(self, deliveries: list[tuple[RequestStream, Any]]) -> None:
        """Hand outputs to their event loops: one thread-safe callback per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream._loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # that event loop is closed: nobody is listening

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        deliveries = [(t.stream, error) for t in self._tracked.values()]
        self._tracked.clear()
        while True:  # requests that never reached the engine
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                try:
                    cmd.stream._loop.call_soon_threadsafe(_resolve, cmd.accepted, error)
                except RuntimeError:
                    pass
        self._deliver(deliveries)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled while waiting
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
