"""The engine core: one loop that owns a backend (engine/backend.py) and applies add/abort commands,
steps, and reports each step's new token ids and statistics as one message (vLLM v1's EngineCore).
It sees token ids only: the front end (engine/async_llm.py) holds the input processor and the output
processor (detokenizing, stop strings, output objects).

    frontend (AsyncLLM)                               core (EngineCore.run)
    -------------------                               ---------------------
    add / abort / stop  ──► commands ──► inbox ──► backend.add_request / abort_request / step
    output processor, streams, stat loggers ◄── messages ◄── emit(("outputs", BackendOutput, ...))

It runs in its own process (`core_process_main`, the server's default) or in a thread of the
caller's process (`AsyncLLM(..., engine_process=False)`). In its own process the core's Python
(scheduling, sampling bookkeeping) never waits for the HTTP server's GIL: with the GIL shared,
every time a kernel returns, the engine thread queues behind the asyncio thread for up to the
interpreter's switch interval (5 ms), and at 8-64 streams the server's Python is busy most of the
time. In its own process it also lets go of the tokenizer once it has handed it over (tens of MB
for a 150k-token vocabulary), keeping only its pickle for xgrammar's token table.

Messages, core -> frontend (tuples; the first item names the kind):
    ("ready", {"kv_cache_tokens": int, "kv_cache_space": GiB, "input": InputProcessor, "tokenizer": ...})   model
                                                loaded and warmed up; "input": the engine's input processor
                                                without its tokenizer; "tokenizer": the engine's, pickled, when
                                                asked (`send_tokenizer`: the server's front end tokenizes and
                                                detokenizes with it)
    ("failed", exception)                       loading failed (process mode; the process exits)
    ("accepted", request_id, exception | None)  an add was queued, or refused (ValueError naming why)
    ("lora", token, exception | None)           a LoRACommand was applied, or refused (LoRAError)
    ("aborted", [request_id], SchedulerStats)   an AbortCommand's requests were let go
    ("outputs", BackendOutput, scheduled time, SchedulerStats)   one step: each sequence's new tokens
                                                (a pooled vector as a numpy array)
    ("stats", SchedulerStats)                   an idle tick, once per stats interval
    ("dead", message)                           the loop stopped (shutdown or a crash)
"""

from __future__ import annotations

import gc
import linecache
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable

from armserve import kernels
from armserve.config import DEFAULT_STATS_INTERVAL, EngineConfig
from armserve.engine.commands import AbortCommand, AddCommand, LoRACommand, StopCommand
from armserve.engine.llm_engine import check_request, create_backend, input_processor_for, lora_manager
from armserve.engine.stats import SchedulerStats
from armserve.memory import IdleTrim, page_out_library_code, release_free_heap

logger = logging.getLogger("armserve")

@dataclass(slots=True)
class _CompileDone:
    command: AddCommand
    error: BaseException | None


# Modules whose exceptions reach the front end as they are: unpickling one there imports its module,
# and these import no torch or model code (a server's front end has none; tests/test_frontend_memory.py).
_FRONTEND_ERROR_MODULES = ("builtins", "armserve.engine.exceptions", "armserve.engine.input_processor",
                           "armserve.config", "armserve.model_source", "armserve.sampling_params",
                           "armserve.pooling_params", "armserve.prompts", "armserve.lora.request")


def portable_error(e: BaseException, frontend: bool = False) -> BaseException:
    """`e` if it survives pickling (to cross to the frontend process) and, with `frontend`, its class
    lives in a module the front end has (_FRONTEND_ERROR_MODULES); else an equivalent ValueError /
    RuntimeError with the same message."""
    try:
        if frontend and type(e).__module__ not in _FRONTEND_ERROR_MODULES:
            raise TypeError
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return ValueError(str(e)) if isinstance(e, ValueError) else RuntimeError(f"{type(e).__name__}: {e}")


class EngineCore:
    """Owns the backend; `run()` is the loop. `emit` receives every message (see the module
    docstring); commands arrive through `put`. Only the loop's thread touches the backend."""

    def __init__(self, config: EngineConfig, emit: Callable[[tuple], None],
                 stats_interval: float = DEFAULT_STATS_INTERVAL) -> None:
        self.backend = create_backend(config)
        self.config = self.backend.config
        self.tokenizer: Any = self.backend.tokenizer
        # (for the "ready" message, without its tokenizer: the front end's input processor)
        self._input = replace(input_processor_for(self.backend), tokenizer=None)
        self.emit = emit
        self.stats_interval = stats_interval
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # request id -> its wait on a grammar compile (StructuredOutputManager.compile_async)
        self._compiling: dict[str, Any] = {}

    def put(self, command: Any) -> None:
        """Queue a command (any thread)."""
        self.inbox.put(command)

    # ---- the loop ---------------------------------------------------------------------------

    def run(self, warm_up: bool = True, send_tokenizer: bool = False, own_process: bool = False) -> None:
        """Warm up, report ready (with the tokenizer if `send_tokenizer`), then step while there is
        work and apply commands between steps, until a `StopCommand`. Ends with a ("dead", why)
        message either way. `own_process`: the core has a process of its own, whose front end
        detokenizes: it keeps the tokenizer pickled only (and sends that), and hands memory back
        to the system (libraries' code after the load, the heap after the warm-up and when idle:
        armserve/memory.py)."""
        backend = self.backend
        why = "the engine was shut down"
        try:
            tokenizer = self._release_tokenizer() if own_process else self.tokenizer
            if own_process:
                # The libraries' code that ran only for the imports and the load goes back to the
                # system now, before the warm-up, whose full-budget prefill is the engine's peak;
                # the warm-up faults in what a step runs.
                page_out_library_code()
            # On the loop's own thread: the kernels' per-thread scratch buffers and the memory a
            # large step touches are then in place before the first request.
            if warm_up:
                backend.warm_up()
            idle_trim = IdleTrim(release=backend.release_idle_memory) if own_process else None
            if idle_trim is not None:
                # The warm-up's largest steps (a full token budget of prefill) left ~35 MiB of freed
                # activations in the heap, which a usual step does not reuse: they go back (with
                # the step graphs' scratch), and a short request faults in ~5 MiB of them again.
                # The source lines torch's imports cached (linecache: ~2 MiB of text) go too, and
                # the library code only the warm-up ran (graph recording and packing: ~5 MiB).
                linecache.clearcache()
                page_out_library_code()
                idle_trim.trim()
            snap = self.snapshot()
            # NOTE: the front end gets the engine's own tokenizer (pickled, a few MB), parsed once
            # (a GGUF header takes seconds) and loaded there without transformers' Auto classes,
            # which import torch.
            self.emit(("ready", {"kv_cache_tokens": snap.kv_blocks_total * self.config.block_size,
                                 "input": self._input,
                                 "kv_cache_space": self.config.kv_cache_space,
                                 "tokenizer": tokenizer if send_tokenizer else None,
                                 "kernels": kernels.status()}))
            del tokenizer  # (sent; this frame lives as long as the engine)
            while True:
                idle = not backend.has_unfinished_requests()
                wake = idle_trim() if idle and idle_trim is not None else None
                if not self._drain(block=idle, timeout=wake):
                    break
                if backend.has_unfinished_requests():
                    self._step()
                    if idle_trim is not None:
                        idle_trim.worked()
        except BaseException as e:  # a bug in the engine: fail every request, report unhealthy
            logger.exception("engine loop crashed; failing all requests")
            why = f"the engine crashed: {type(e).__name__}: {e}"
        finally:
            structured = getattr(self.backend, "structured", None)
            if structured is not None:
                structured.close()  # kills the compile workers; waiting compiles are not answered
            self._compiling.clear()
            self.emit(("dead", why))

    def _release_tokenizer(self) -> bytes:
        """Let go of the tokenizer, keeping its pickle (a few MB, against tens for the live Rust
        object of a 150k-token vocabulary): the front end detokenizes, and xgrammar's token table
        is built from the pickle on the first structured request. Before the warm-up, so that the
        heap handed back is the tokenizer's, not the warm-up's working set."""
        blob = pickle.dumps(self.tokenizer)
        if self.backend.structured is not None:
            # (compressed: a 150k-token vocabulary's 5.4 MB pickle is kept in 2.2, for 50 ms once)
            self.backend.structured.tokenizer = zlib.compress(blob, 1)
        self.tokenizer = self.backend.tokenizer = None
        gc.collect()
        release_free_heap()
        return blob

    def _drain(self, block: bool, timeout: float | None = None) -> bool:
        """Apply queued commands; waits for one if `block` (at most `timeout` seconds, if sooner
        than the stats interval). Returns False on stop."""
        first = True
        while True:
            try:
                if block and first:
                    # Wake up at the stats interval even when idle, for the final stats line.
                    wait = self.stats_interval if timeout is None else max(0.0, min(timeout, self.stats_interval))
                    cmd = self.inbox.get(timeout=wait)
                else:
                    cmd = self.inbox.get_nowait()
            except queue.Empty:
                if block and first:
                    self.emit(("stats", self.snapshot()))
                return True
            first = False
            if isinstance(cmd, StopCommand):
                return False
            if isinstance(cmd, AddCommand):
                self._add(cmd)
            elif isinstance(cmd, LoRACommand):
                try:
                    if cmd.remove is not None:
                        lora_manager(self.backend).remove(cmd.remove)
                    else:
                        lora_manager(self.backend).add(cmd.lora_request)
                except Exception as e:  # a bad adapter folder: named, the engine untouched
                    self.emit(("lora", cmd.token, portable_error(e)))
                else:
                    self.emit(("lora", cmd.token, None))
            elif isinstance(cmd, _CompileDone):
                if self._compiling.pop(cmd.command.request.request_id, None) is None:
                    continue  # aborted: answered when the abort cancelled the compile
                if cmd.error is not None:
                    self.emit(("accepted", cmd.command.request.request_id, portable_error(cmd.error, frontend=True)))
                else:
                    self._add(cmd.command)
            else:
                self._abort(cmd)

    def _add(self, cmd: AddCommand) -> None:
        request = cmd.request
        rid = request.request_id
        so = request.params.structured_outputs
        structured = self.backend.structured
        # (a backend without structured outputs refuses the request in add_request)
        if so is not None and not cmd.compiled and structured is not None:
            # NOTE: compiled off the loop (in the manager's worker processes, within a time and
            # memory budget), so a large schema never stalls the steps nor, past its budget, the
            # other requests' grammars; the engine then finds the grammar in its cache. A cache
            # hit (or a bounded inline compile) returns None and the request is added now.
            cmd.compiled = True
            try:
                handle = structured.compile_async(so, lambda _, err, cmd=cmd: self.inbox.put(_CompileDone(cmd, err)))
            except Exception as e:  # an invalid inline grammar, xgrammar missing
                self.emit(("accepted", rid, portable_error(e, frontend=True)))
                return
            if handle is not None:
                self._compiling[rid] = handle
                return
        try:
            check_request(self.config, request)
            self.backend.add_request(request)
        except Exception as e:  # errors name the problem (what the backend cannot carry); the engine is untouched
            self.emit(("accepted", rid, portable_error(e, frontend=True)))
            return
        self.emit(("accepted", rid, None))

    def _abort(self, cmd: AbortCommand) -> None:
        for rid in cmd.request_ids:
            handle = self._compiling.pop(rid, None)
            if handle is not None:
                # Its worker is killed unless another request waits on the same grammar.
                self.backend.structured.cancel(handle)
                self.emit(("accepted", rid, ValueError("the request was aborted while its grammar compiled")))
            self.backend.abort_request(rid)
        for rid, index in cmd.sequences:  # completions a stop string ended (the front end's output processor)
            self.backend.abort_request(rid, [index])
        if cmd.request_ids:
            self.emit(("aborted", cmd.request_ids, self.snapshot()))

    def _step(self) -> None:
        scheduled = time.time()
        out = self.backend.step()
        for seq in out.sequences:
            if seq.pooled is not None:  # a numpy vector: unpickling it needs no torch in the front end
                seq.pooled = seq.pooled.float().numpy()
        self.emit(("outputs", out, scheduled, self.snapshot()))

    def snapshot(self) -> SchedulerStats:
        """The engine's state now (call from the loop's thread, or before `run`)."""
        return self.backend.scheduler_stats()


# ---- the core in its own process -------------------------------------------------------------


def core_process_main(commands, messages, config: EngineConfig, log_level: int, stats_interval: float,
                      warm_up: bool, env: dict[str, str], send_tokenizer: bool = False) -> None:
    """Entry point of the engine-core process (engine/core_client.py: ProcessCore starts it): load,
    then loop until told to stop or until the frontend goes away (its end of the command pipe closes)."""
    # Ctrl-C reaches the whole process group; the frontend decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    send_lock = threading.Lock()

    def emit(msg: tuple) -> None:
        with send_lock:
            try:
                messages.send(msg)
            except (BrokenPipeError, EOFError, OSError):
                pass  # the frontend is gone; the command reader stops the loop

    # The imports' code that ran once goes back before the load too, so that the load's peak is
    # not the steady state plus what `import torch` left resident (again after the load, in `run`).
    page_out_library_code()
    try:
        core = EngineCore(config, emit, stats_interval)
    except BaseException as e:
        emit(("failed", portable_error(e)))
        return

    def read_commands() -> None:
        while True:
            try:
                cmd = commands.recv()
            except (EOFError, OSError):  # the frontend exited: stop
                core.put(StopCommand())
                return
            core.put(cmd)
            if isinstance(cmd, StopCommand):
                return

    threading.Thread(target=read_commands, name="armserve-core-commands", daemon=True).start()
    core.run(warm_up, send_tokenizer, own_process=True)
    # NOTE: no interpreter teardown: with the kernels' worker threads and the OpenMP runtime
    # still up it can hang at exit, and there is nothing left to clean up.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)
