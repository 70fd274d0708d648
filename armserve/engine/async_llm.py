"""The async engine: an engine core (in its own process by default) serving many async callers,
each request an async stream of deltas.

    event loop(s) (HTTP)                           engine core (armserve.engine.core)
    --------------------                           ----------------------------------
    await add_request()  ── input processor ──► AddCommand ──► backend.add_request, step, ...
    async for out in stream ◄── output processor ◄── ("outputs", BackendOutput, ...) per step
                                (stop strings ──► AbortCommand(sequences=...))

The core runs in a child process (`engine_process=True`, the default, as vLLM v1): this process
keeps the HTTP server, tokenizing, detokenizing (the output processor, on the core's reader thread)
and streaming, the core schedules and steps on token ids, and the two never wait for each other's
GIL. With `engine_process=False` (or the environment variable
ARMSERVE_ENGINE_PROCESS=0, or vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0) the core runs in a thread of
this process instead: less start-up, the same behaviour (engine/core_client.py has both).

With `data_parallel_size=N` there are N cores, each with its own KV cache and cores to compute
on; each request goes to the core with the fewest requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import pickle
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, AsyncGenerator, Callable, Sequence

from armserve.config import DEFAULT_STATS_INTERVAL, WAITING_REQUESTS_PER_SEQ, EngineConfig
from armserve.engine.commands import AbortCommand, AddCommand, LoRACommand
from armserve.engine.core_client import ProcessCore, ThreadCore, engine_process_default
from armserve.engine.exceptions import EngineDeadError, EngineOverloadedError, RequestFailedError, RequestTimeoutError
from armserve.engine.input_processor import EngineCoreRequest, InputProcessor, PromptType
from armserve.engine.output_processor import OutputProcessor
from armserve.engine.request_stream import RequestStream, deliver
from armserve.pooling_params import PoolingParams
from armserve.engine.stat_loggers import LoggingStatLogger, StatLogger, combine_stats
from armserve.engine.stats import IterationStats, SchedulerStats
from armserve.memory import release_free_heap
from armserve.model_source import resolve_model_path
from armserve.outputs import RequestOutput
from armserve.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "RequestStream"]

logger = logging.getLogger("armserve")


# ---- the frontend ----------------------------------------------------------------------------


@dataclass(slots=True)
class _Live:
    """A request this frontend has sent to a core and not yet seen finish."""

    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    engine: int
    accepted: asyncio.Future | None
    waiting: bool = True  # no output yet: it counts against the admission bounds


class AsyncLLM:
    """Engine cores serving many async callers at once.

    Usage::

        llm = AsyncLLM(EngineConfig(model=path))
        async for out in llm.generate("Hello", SamplingParams(max_tokens=32)):
            print(out.outputs[0].text, end="")   # deltas
        llm.shutdown()

    The constructor returns once every core has loaded the model and run its warm-up step.
    `engine_process` (default: on, see `engine_process_default`) runs each core in its own
    process; `config.data_parallel_size` cores serve one request stream, balanced by load.
    """

    def __init__(
        self,
        config: EngineConfig,
        log_stats: bool = True,
        stats_interval: float | None = None,
        stat_loggers: Sequence[StatLogger] = (),
        engine_process: bool | None = None,
        restart_on_failure: bool = False,
    ) -> None:
        config = config.for_serving()
        self.config = config
        if stats_interval is None:
            stats_interval = float(os.environ.get("ARMSERVE_LOG_STATS_INTERVAL", DEFAULT_STATS_INTERVAL))
        self._log_stats = LoggingStatLogger(stats_interval) if log_stats else None
        self._stat_loggers: list[StatLogger] = list(stat_loggers)
        if self._log_stats is not None:
            self._stat_loggers.append(self._log_stats)
        self.engine_process = engine_process_default() if engine_process is None else engine_process
        dp = getattr(config, "data_parallel_size", 1) or 1
        if dp > 1 and not self.engine_process:
            raise ValueError("data_parallel_size > 1 runs each engine in its own process: "
                             "engine_process cannot be off")
        warm_up = os.environ.get("ARMSERVE_WARMUP", "1") != "0"
        self._core_args = (stats_interval, warm_up)
        self._envs: list[dict[str, str]] = [{}]
        # A core process that dies is started again in place (engine_process only); else the
        # engine stays dead and a server exits so that its supervisor restarts it.
        self.restart_on_failure = restart_on_failure and self.engine_process
        self._restarts: deque[float] = deque()
        self._restarting: set[int] = set()
        self._stopping = False
        self._live: dict[str, _Live] = {}
        self._lora_calls: dict[str, asyncio.Future] = {}  # LoRACommand token -> its caller's future
        # Admission bookkeeping (event loop and reader threads): requests with no output yet.
        self._admit_lock = threading.Lock()
        self._num_waiting = 0
        self._waiting_tokens = 0
        self._prefill_window: deque[tuple[float, int]] = deque()  # (time, prompt tokens) of recent steps
        self._kv_tokens = [0] * dp
        self._load = [0] * dp  # requests in flight per engine
        self._snapshots: list[SchedulerStats] = [SchedulerStats() for _ in range(dp)]
        self._dead: BaseException | None = None
        self._ready_info: dict[str, Any] = {}
        self._tokenizer: Any = None  # the first core's (its "ready" message)
        # One output processor per engine (its requests), given the tokenizer once the first is
        # ready; the cores' reader threads, the event loop and abort() share them under the lock.
        self._outputs = [OutputProcessor(None, log_stats=True) for _ in range(dp)]
        self._output_lock = threading.RLock()
        self._cores: list[ThreadCore | ProcessCore] = []
        # CPUs on no engine's cores, for the front end to pin itself to (cpu.serving_layout); None:
        # none to spare, or the engine runs in this process.
        self.frontend_cpus: list[int] | None = None
        try:
            if self.engine_process:
                from armserve.cpu import serving_layout

                resolve_model_path(config.model)  # a wrong path fails before any spawn
                envs, self.frontend_cpus = serving_layout(dp, config.tensor_parallel_size or 1)
                self._envs = envs
                for i, env in enumerate(envs):
                    # (the first core sends its tokenizer with its "ready": the front end never
                    # imports torch or the model code, engine/core.py says why)
                    self._cores.append(ProcessCore(config, self._handler(i), stats_interval, warm_up, env, i,
                                                   send_tokenizer=i == 0))
            else:
                core = ThreadCore(config, self._handler(0), stats_interval, warm_up)
                self._cores.append(core)
                self.tokenizer = core.core.tokenizer
                self._snapshots[0] = core.core.snapshot()
            for c in self._cores:
                c.start()
            if self.engine_process:
                self.tokenizer = self._tokenizer
                release_free_heap()  # what unpickling it left behind
                if config.chat_template:
                    self.tokenizer.chat_template = config.chat_template
                # (the space the engines chose when none was given: config.py's default rule)
                config.kv_cache_space = self._ready_info.get("kv_cache_space", config.kv_cache_space)
        except BaseException:
            self.shutdown()
            raise
        for op in self._outputs:
            op.tokenizer = self.tokenizer
        # Prompts are processed here, for the limits of the engines' model and KV cache.
        self.input_processor: InputProcessor = replace(self._ready_info["input"], tokenizer=self.tokenizer)
        self.max_model_len: int = self.input_processor.max_model_len
        self.config.max_model_len = self.max_model_len
        self.max_waiting_requests: int = config.max_waiting_requests or WAITING_REQUESTS_PER_SEQ * config.max_num_seqs * dp
        # (0 when a backend does not report its cache: then only the request bound applies)
        self.max_waiting_tokens: int = config.max_waiting_tokens or sum(self._kv_tokens)

    # ---- public API (any thread / the event loop) ------------------------------------------

    @property
    def kernels_status(self) -> dict[str, str] | None:
        """The engine's kernel library (kernels.status(), from its "ready" message; None for a
        backend that does not report it)."""
        return self._ready_info.get("kernels")

    @property
    def is_running(self) -> bool:
        return self._dead is None and all(c.alive() for c in self._cores)

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped, or None while it runs."""
        return self._dead

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The engines' state after their latest steps (summed over data-parallel engines)."""
        return combine_stats(list(self._snapshots))

    @property
    def engine_stats(self) -> list[SchedulerStats]:
        """Each data-parallel engine's state after its latest step."""
        return list(self._snapshots)

    async def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        deadline: float | None = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Process the request (`input_processor`) and submit it; returns its stream once the engine
        has accepted it.

        Raises a `ValueError` (naming the problem) if the request is invalid,
        `EngineOverloadedError` at once if the waiting queue is full (`max_waiting_requests`,
        `max_waiting_tokens`), and `EngineDeadError` if the engine is not running. With a
        `deadline` (seconds from now) a request not finished by then is aborted and its stream
        raises `RequestTimeoutError`.
        """
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        request = self.input_processor.process(request_id or uuid.uuid4().hex, prompt, params, arrival_time,
                                               lora_request)
        return await self.add_processed_request(request, deadline)

    async def add_processed_request(self, request: EngineCoreRequest, deadline: float | None = None) -> RequestStream:
        """`add_request` of a request `input_processor` made."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        loop = asyncio.get_running_loop()
        request_id, ids = request.request_id, request.prompt_token_ids
        # (an aborted request's id is in use until its core has let it go)
        if request_id in self._live or any(request_id in op.requests for op in self._outputs):
            raise ValueError(f"request id {request_id!r} is already in use")
        # (a data-parallel engine being restarted takes nothing new meanwhile)
        serving = [i for i in range(len(self._cores)) if i not in self._restarting]
        if not serving:
            raise EngineDeadError("the engine is restarting")
        engine = min(serving, key=self._load.__getitem__)
        with self._admit_lock:
            self._admit(len(ids))
            self._num_waiting += 1
            self._waiting_tokens += len(ids)
        stream = RequestStream(request_id, self, loop)
        accepted = loop.create_future()
        self._live[request_id] = _Live(stream, request.prompt, ids, engine, accepted)
        self._load[engine] += 1
        with self._output_lock:
            self._outputs[engine].add_request(request, "delta")
        if deadline is not None:
            loop.call_later(deadline, self._expire, request_id, stream, deadline)
        self._cores[engine].send(AddCommand(request))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._forget(request_id)
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its delta outputs; closing the generator early aborts it.
        `lora_request`: the adapter (lora.LoRARequest; the engine started with enable_lora) or None."""
        stream = await self.add_request(request_id, prompt, params, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def add_lora(self, lora_request: Any) -> None:
        """Read an adapter (lora.LoRARequest) in every engine now, checked against the model: a
        LoRAError (ValueError) names a bad folder. Requests load their adapter anyway; this checks
        it up front (the server's /v1/load_lora_adapter, --lora-modules)."""
        await self._lora_command(lora_request=lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter in every engine (its cache entry and slot)."""
        await self._lora_command(remove=lora_int_id)

    async def _lora_command(self, **kw: Any) -> None:
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        loop = asyncio.get_running_loop()
        futures = []
        for i, core in enumerate(self._cores):
            token = f"{uuid.uuid4().hex}:{i}"
            self._lora_calls[token] = fut = loop.create_future()
            futures.append(fut)
            core.send(LoRACommand(token, **kw))
        for fut in futures:
            await fut

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's `encode` for an embedding model: yields the one output, its vector in `pooled`."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'stopped'})")
        request = self.input_processor.process_pooling(request_id or uuid.uuid4().hex, prompt, pooling_params)
        stream = await self.add_processed_request(request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _admit(self, num_tokens: int) -> None:
        """EngineOverloadedError if a request of `num_tokens` prompt tokens would pass a bound
        (call under the admission lock). A lone prompt is let in whatever its size: it fits
        max_model_len, which the engine checks."""
        full = None
        if self._num_waiting >= self.max_waiting_requests:
            full = f"{self._num_waiting} requests are waiting (max_waiting_requests {self.max_waiting_requests})"
        elif self.max_waiting_tokens and self._num_waiting and \
                self._waiting_tokens + num_tokens > self.max_waiting_tokens:
            full = (f"{self._waiting_tokens} prompt tokens are waiting and this request adds {num_tokens} "
                    f"(max_waiting_tokens {self.max_waiting_tokens})")
        if full is not None:
            raise EngineOverloadedError(f"the server is overloaded: {full}; retry later", self._retry_after())

    def _retry_after(self) -> int:
        """Seconds until the waiting prompt tokens are likely prefilled, at the recent prefill
        rate (1-60; 1 when there is no recent rate to go by)."""
        window = list(self._prefill_window)
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return 1
        rate = sum(t for _, t in window[1:]) / (window[-1][0] - window[0][0])
        return max(1, min(60, math.ceil(self._waiting_tokens / rate))) if rate > 0 else 1

    @property
    def num_unfinished_requests(self) -> int:
        """Requests sent to the engines and not yet finished (all of them, waiting or running)."""
        return len(self._live)

    @property
    def num_waiting_requests(self) -> int:
        """Requests admitted that have no output yet."""
        return self._num_waiting

    def fail_unfinished(self, error: RequestFailedError) -> None:
        """Abort every unfinished request; each caller's stream (or add_request) raises `error`.
        The engines keep running."""
        for engine, rids in self._fail_requests(error).items():
            self._cores[engine].send(AbortCommand(rids))

    def _fail_requests(self, error: RequestFailedError, engine: int | None = None) -> dict[int, list[str]]:
        """End the unfinished requests (of `engine`, or all) with `error`: each caller's stream,
        or its pending add_request, raises it. Returns their ids by engine."""
        by_engine: dict[int, list[str]] = {}
        deliveries: list[tuple[RequestStream, Any]] = []
        for rid in list(self._live):
            live = self._live.get(rid)
            if live is None or (engine is not None and live.engine != engine):
                continue
            by_engine.setdefault(live.engine, []).append(rid)
            self._end(rid, live, error, deliveries)
        deliver(deliveries)
        return by_engine

    def _end(self, request_id: str, live: _Live, error: RequestFailedError,
             deliveries: list[tuple[RequestStream, Any]]) -> None:
        """Forget one request and hand `error` to its caller: its pending add_request now, or its
        stream through `deliveries` (for `deliver`)."""
        self._forget(request_id)
        if not _answer(live, error):
            deliveries.append((live.stream, error))

    def _expire(self, request_id: str, stream: RequestStream, seconds: float) -> None:
        """The deadline of `request_id` passed (event loop): abort it, tell its reader."""
        live = self._live.get(request_id)
        if live is None or live.stream is not stream:
            return  # finished (or the id was reused by a later request)
        self._cores[live.engine].send(AbortCommand([request_id]))
        deliveries: list[tuple[RequestStream, Any]] = []
        self._end(request_id, live, RequestTimeoutError(
            f"the request did not finish within its deadline of {seconds:g} s"), deliveries)
        deliver(deliveries)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (thread-safe); their KV blocks are freed before the next step. A reader
        still waiting gets the request's last output (its unfinished completions ended "abort")
        once the core has let it go (its "aborted" message)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_engine: dict[int, list[str]] = {}
        for rid in ids:
            live = self._live.get(rid)
            if live is not None:
                by_engine.setdefault(live.engine, []).append(rid)
        for engine, rids in by_engine.items():
            self._cores[engine].send(AbortCommand(rids))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine cores; unfinished requests end with `EngineDeadError`."""
        self._stopping = True
        for c in self._cores:
            c.stop(timeout)
        if self._dead is None:
            self._fail_all(EngineDeadError("the engine was shut down"))

    # ---- messages from the cores (their reader threads, or the core thread) ----------------

    def _handler(self, engine: int) -> Callable[[tuple], None]:
        return lambda msg: self._on_message(engine, msg)

    def _on_message(self, engine: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            _, backend_out, scheduled, snap = msg
            deliveries: list[tuple[RequestStream, Any]] = []
            with self._output_lock:
                outputs, stopped = self._outputs[engine].process(backend_out, scheduled, time.time())
                it = self._outputs[engine].take_stats()
                it.step = True
                if stopped:  # (sent before their ids are forgotten, as abort() does)
                    self._cores[engine].send(AbortCommand([], stopped))
                for out in outputs:
                    live = self._live.get(out.request_id)
                    if live is None:
                        continue
                    if live.waiting:
                        self._unwait(live)
                    if out.finished:
                        self._forget(out.request_id)
                    deliveries.append((live.stream, out))
            # Recorded first: a client that sees its request finish finds it in the metrics.
            self._record(engine, snap, it)
            deliver(deliveries)
        elif kind == "aborted":  # the core let these requests go: their readers get their last output
            _, rids, snap = msg
            deliveries = []
            with self._output_lock:
                for rid in rids:
                    out = self._outputs[engine].abort_request(rid)
                    live = self._live.get(rid)
                    if out is None or live is None:
                        continue  # (ended meanwhile, or its reader was told otherwise: a deadline, a failure)
                    out.prompt, out.prompt_token_ids = live.prompt, live.prompt_token_ids
                    self._forget(rid)
                    deliveries.append((live.stream, out))
                it = self._outputs[engine].take_stats()
            self._record(engine, snap, it)
            deliver(deliveries)
        elif kind == "accepted":
            _, rid, error = msg
            live = self._live.get(rid)
            if live is not None:
                _answer(live, error)
            if error is not None:
                self._forget(rid)
                with self._output_lock:
                    self._outputs[engine].forget(rid)
        elif kind == "lora":
            _, token, error = msg
            fut = self._lora_calls.pop(token, None)
            if fut is not None:
                try:
                    fut.get_loop().call_soon_threadsafe(_resolve, fut, error)
                except RuntimeError:
                    pass  # that event loop is closed
        elif kind == "stats":
            with self._output_lock:
                it = self._outputs[engine].take_stats()  # (requests aborted meanwhile)
            self._record(engine, msg[1], it)
        elif kind == "ready":
            # (without the tokenizer's pickle: 5 MB for a 150k-token vocabulary, parsed once here)
            self._ready_info = {k: v for k, v in msg[1].items() if k != "tokenizer"}
            if msg[1].get("tokenizer") is not None:  # (pickled: a core process's)
                self._tokenizer = pickle.loads(msg[1]["tokenizer"])
            self._kv_tokens[engine] = msg[1].get("kv_cache_tokens", 0)
        elif kind == "dead":
            with self._output_lock:
                self._outputs[engine].requests.clear()  # (its requests fail below; a restarted core starts empty)
            why = msg[1] if len(self._cores) == 1 else f"engine {engine}: {msg[1]}"
            if self._stopping:
                if self._dead is None:
                    self._fail_all(EngineDeadError(why))
            elif self.restart_on_failure and self._may_restart():
                self._fail_engine(engine, EngineDeadError(why))
                self._restarting.add(engine)
                threading.Thread(target=self._restart, args=(engine, why), name="armserve-engine-restart",
                                 daemon=True).start()
            elif self._dead is None:
                self._fail_all(EngineDeadError(why))

    @property
    def restarting(self) -> bool:
        """True while a dead engine core is being started again (`restart_on_failure`)."""
        return bool(self._restarting)

    def _may_restart(self) -> bool:
        # NOTE: a core that dies again and again (a model that crashes every step) is given up
        # on, so the server exits and its supervisor sees the failure.
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > 300:
            self._restarts.popleft()
        if len(self._restarts) >= 3:
            logger.error("the engine core died 3 times within 5 minutes: not restarting it again")
            return False
        self._restarts.append(now)
        return True

    def _restart(self, engine: int, why: str) -> None:
        """Start engine core `engine` again (a thread of its own: loading takes seconds)."""
        logger.error("engine core %d died (%s): restarting it", engine, why)
        try:
            core = ProcessCore(self.config, self._handler(engine), *self._core_args, self._envs[engine], engine)
            self._cores[engine] = core
            core.start()
        except BaseException as e:  # noqa: BLE001 - any failure leaves the engine dead
            logger.error("restarting engine core %d failed: %s", engine, e)
            self._restarting.discard(engine)
            self._fail_all(EngineDeadError(f"{why}; restarting it failed: {e}"))
            return
        self._restarting.discard(engine)
        self._dead = None
        logger.info("engine core %d is serving again", engine)

    def _fail_engine(self, engine: int, error: EngineDeadError) -> None:
        """Fail the requests of one dead engine core. The other data-parallel engines go on
        serving; with none left, new requests are refused until it is back."""
        if len(self._restarting | {engine}) == len(self._cores):
            self._dead = error
        self._fail_requests(error, engine)

    def _unwait(self, live: _Live) -> None:
        with self._admit_lock:
            if live.waiting:
                live.waiting = False
                self._num_waiting -= 1
                self._waiting_tokens -= len(live.prompt_token_ids)

    def _forget(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._load[live.engine] -= 1
            self._unwait(live)

    def _record(self, engine: int, snap: SchedulerStats, it: IterationStats) -> None:
        self._snapshots[engine] = snap
        if it.num_prompt_tokens:
            now = time.monotonic()
            self._prefill_window.append((now, it.num_prompt_tokens))
            while self._prefill_window and now - self._prefill_window[0][0] > 30:
                self._prefill_window.popleft()
        for sl in self._stat_loggers:
            try:
                sl.record(snap, it, engine)
            except Exception:  # a metrics bug must never take the engine down
                logger.exception("stat logger %r failed", sl)
        if self._log_stats is not None:
            self._log_stats.maybe_log()

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        self._fail_requests(error)


def _answer(live: _Live, error: BaseException | None) -> bool:
    """Answer the request's pending add_request (accepted, or `error`); False if none is pending."""
    fut, live.accepted = live.accepted, None
    if fut is None:
        return False
    try:
        fut.get_loop().call_soon_threadsafe(_resolve, fut, error)
    except RuntimeError:
        pass  # that event loop is closed
    return True


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled while waiting
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
