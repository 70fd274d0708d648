"""Structured outputs on xgrammar: compile a request's constraint once, then each step mask the
logits of its rows to the tokens the grammar allows.

    add_request   StructuredOutputsParams -> CompiledGrammar (LRU cache) -> a GrammarMatcher per child
    each step     fill_bitmask(matchers of the sampling rows) [while the model runs, on a worker thread]
                  sampler: apply_grammar_bitmask(logits, bitmask, rows) before penalties and sampling
    update        matcher.accept_token(sampled); a terminated grammar finishes the request ("stop")

Compiles run in worker processes (GrammarCompilePool, engine/grammar_worker.py), because xgrammar
cannot cancel one and some schemas never finish (10,000 properties: 10+ minutes, +1.4 GB): each
compile has a time budget and a memory limit, past which its worker is killed and replaced and
the request fails with a ValueError naming "too complex"; an aborted request's compile is killed
the same way; `workers` compiles run at once, so one such schema does not hold up the others.
The compiled grammar comes back serialized (xgrammar's JSON, ~1.8 MB for a schema with a
bounded string on a 49k vocabulary): +35-40 ms for such a schema (~80 -> ~118 ms cold; ~40-60 ms
once the worker's xgrammar cache holds its parts), ~0.5 ms for a small one. The pool starts on
the first compile (a worker is ready in ~0.6 s: it imports xgrammar without torch).
The JSON-object grammar (fixed) and short choice lists compile in the engine: bounded (< 10 ms).

A preempted request keeps its output tokens and recomputes their KV, so its matcher (which has
accepted exactly those tokens) stays valid: nothing to roll back.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import pickle
import re
import subprocess
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from armserve import config as _config
from armserve.engine.child import start_child
from armserve.engine.exceptions import CompileAborted, GrammarTooComplex
from armserve.memory import release_free_heap
from armserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("armserve")

# Compiled grammars kept per (kind, spec, whitespace), also bounded in bytes (GRAMMAR_CACHE_MB);
# a JSON schema compiles in ~0.1 s, a hit is free.
GRAMMAR_CACHE_SIZE = 256

# Choice lists up to this many characters in all compile in the engine (64 x 64 characters:
# 8 ms on a 49k vocabulary); longer ones grow faster than linearly (1000 x 64: 0.28 s, 5000 x 64:
# 2.5 s) and go to the workers with the rest.
INLINE_CHOICE_CHARS = 4096

# Each worker's own xgrammar cache (GrammarCompiler cache_limit_bytes; part of its memory limit).
WORKER_CACHE_BYTES = 64 * 2**20

WORKER_START_TIMEOUT = 120.0  # seconds for a worker to import xgrammar and report ready

# A worker's process starts when it takes its first job, and one that has waited this long for
# another while a second process is up is stopped: each holds ~75 MiB (xgrammar, the token
# table, its cache), and overlapping compiles (a slow schema beside others) are the exception.
WORKER_IDLE_SECONDS = 60.0

_XGR_LOG_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h):\d+:\s*")

_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar (EBNF)", "choice": "choice",
         "json_object": "JSON grammar"}

# The callback of an asynchronous compile: (compiled grammar, None) or (None, ValueError).
OnCompiled = Callable[[Any, "BaseException | None"], None]


def _clean(e: Exception | str) -> str:
    """xgrammar's message without its C++ log prefix (timestamp, source file and line)."""
    return _XGR_LOG_PREFIX.sub("", str(e)).strip()


def _setting(value: float | None, name: str) -> float:
    """`value`, else $ARMSERVE_`name`, else armserve.config's `name`."""
    default = getattr(_config, name)
    raw = os.environ.get(f"ARMSERVE_{name}")
    if value is not None or not raw:
        return default if value is None else value
    try:
        return float(raw)
    except ValueError:
        logger.warning("ignoring ARMSERVE_%s=%r (not a number); using %s", name, raw, default)
        return default


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# ---- the worker processes --------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    """One compile, shared by every request waiting for the same constraint."""

    key: tuple[str, str, bool]
    spec: str  # what the worker compiles: the schema, regex or EBNF text
    waiters: list[OnCompiled] = field(default_factory=list)
    worker: "_Worker | None" = None  # the worker compiling it (under the pool's lock)
    cancelled: bool = False


class _Worker:
    """One compile process and the thread that feeds it jobs. The thread starts the process, so
    PR_SET_PDEATHSIG (set by the worker) kills it when this thread ends (pool closed) or the
    process does (the engine core ends with os._exit)."""

    def __init__(self, pool: "GrammarCompilePool", index: int) -> None:
        self.pool = pool
        self.waiting = False  # in the pool's `_take` (under its lock)
        self.retiring = False  # told to stop its process for idleness (under the pool's lock)
        self.proc: subprocess.Popen | None = None
        self._send = self._recv = None
        self.thread = threading.Thread(target=self._run, name=f"armserve-grammar-{index}", daemon=True)

    def _start(self) -> None:
        pool = self.pool
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grammar_worker.py")
        env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
        self.proc, self._send, self._recv = start_child(lambda r, w: [script, str(r), str(w)], env)
        self._send.send(("init", pool.tokenizer_info, int(pool.memory_mb * 2**20), WORKER_CACHE_BYTES))
        if not self._recv.poll(WORKER_START_TIMEOUT):
            raise RuntimeError(f"the grammar worker did not start within {WORKER_START_TIMEOUT:g} s")
        self._recv.recv()  # ("ready", pid); EOFError if it died

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        for conn in (self._send, self._recv):
            if conn is not None:
                conn.close()
        self._send = self._recv = None

    def kill(self) -> None:
        """Kill the process now (any thread): its thread sees the pipe close and replaces it."""
        proc = self.proc
        if proc is not None:
            proc.kill()

    def live(self) -> bool:
        """Whether its process is up (any thread)."""
        proc = self.proc
        return proc is not None and proc.poll() is None

    def _run(self) -> None:
        pool = self.pool
        failures = 0
        while not pool.closed:
            job = pool._take(self)
            if job is None:
                break
            if job is _RETIRE:
                self._stop()
                with pool._lock:
                    self.retiring = False
                continue
            if not self.live():  # not started yet, or killed (budget, abort) or died since
                self._stop()
                try:
                    self._start()
                    failures = 0
                except Exception as e:
                    self._stop()
                    pool._requeue(job)
                    if pool.closed:
                        break
                    failures += 1
                    logger.error("grammar compile worker failed to start: %s", e)
                    if failures >= 3:  # e.g. xgrammar broken: fail the queue rather than hang it
                        pool._fail_all(RuntimeError(f"the grammar compile workers cannot start: {e}"))
                    time.sleep(min(5.0, 0.5 * failures))
                    continue
            self._compile(job)
        self._stop()

    def _compile(self, job: _Job) -> None:
        pool = self.pool
        kind, _, disable_any_ws = job.key
        t0 = time.monotonic()
        status, payload = "died", ""
        try:
            self._send.send((id(job), kind, job.spec, not disable_any_ws))
            if self._recv.poll(pool.timeout if pool.timeout > 0 else None):  # 0: no time limit
                _, status, payload = self._recv.recv()
            else:
                status = "timeout"
                self.kill()
        except (EOFError, OSError):
            status = "died"
        with pool._lock:
            job.worker = None
            cancelled = job.cancelled
        if status in ("timeout", "died", "memory"):
            self._stop()  # replaced before the next job
        compiled, error, what = None, None, _WHAT[kind]
        if pool.closed:
            error = CompileAborted("the engine shut down while the grammar compiled")
        elif cancelled:  # (its waiters are gone: nobody is told)
            logger.info("grammar compile of an aborted request stopped after %.2f s", time.monotonic() - t0)
        elif status == "ok":
            try:
                compiled = pool.deserialize(payload)
            except Exception as e:  # a version skew between the worker and the engine
                error = ValueError(f"structured_outputs.{kind}: the compiled {what} could not be loaded: {_clean(e)}")
        elif status == "invalid":
            error = ValueError(f"structured_outputs.{kind}: invalid {what}: {_clean(payload)}")
        else:
            how = {"timeout": f"it did not compile within {pool.timeout:g} s",
                   "memory": f"compiling it needed more than {pool.memory_mb:g} MB"}.get(
                status, f"its compiler stopped (the limits are {pool.timeout:g} s and {pool.memory_mb:g} MB)")
            logger.warning("structured_outputs.%s: grammar compile killed after %.1f s: %s (%d characters)",
                           kind, time.monotonic() - t0, how, len(job.spec))
            error = GrammarTooComplex(f"structured_outputs.{kind}: the {what} is too complex: {how}")
        pool._finish(job, compiled, error)


_RETIRE = object()  # `_take`'s answer to a worker idle for WORKER_IDLE_SECONDS beside another


class GrammarCompilePool:
    """Up to `workers` compile processes over one tokenizer; jobs wait in a FIFO queue for a free
    one. Each process compiles one job at a time, so killing it (budget, abort) stops just that
    job. A worker's process starts with its first job; a job goes to an idle worker whose process
    is up before one whose is not; a process idle for WORKER_IDLE_SECONDS while another is up
    stops (one stays)."""

    def __init__(self, tokenizer_info_json: str, deserialize: Callable[[str], Any], workers: int,
                 timeout: float, memory_mb: float) -> None:
        # Kept for every worker's start, compressed: a 150k-token table is 5.1 MB of JSON, 2.3 here.
        self.tokenizer_info = zlib.compress(tokenizer_info_json.encode(), 1)
        self.deserialize = deserialize
        self.timeout = timeout
        self.memory_mb = memory_mb
        self.closed = False
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._queue: deque[_Job] = deque()
        # A weak reference: the manager (an engine's) may go while the workers still run.
        self._on_finish: weakref.WeakMethod | None = None
        self._workers = [_Worker(self, i) for i in range(max(1, workers))]
        for w in self._workers:
            w.thread.start()

    def submit(self, job: _Job) -> None:
        with self._lock:
            if self.closed:
                raise RuntimeError("the grammar compile pool is closed")
            self._queue.append(job)
            self._ready.notify_all()

    def cancel(self, job: _Job) -> None:
        """Drop `job` (its last waiter went): off the queue, or its worker killed mid-compile."""
        with self._lock:
            job.cancelled = True
            if job.worker is not None:
                job.worker.kill()
            elif job in self._queue:
                self._queue.remove(job)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None and w.proc.poll() is None]

    def _take(self, worker: _Worker) -> Any:
        """The next job for `worker`, None once the pool is closed, or _RETIRE when its process
        should stop."""
        with self._lock:
            worker.waiting = True
            try:
                since = time.monotonic()
                while not self.closed:
                    if self._queue and (worker.live() or not any(w.waiting and w.live() for w in self._workers)):
                        job = self._queue.popleft()
                        job.worker = worker
                        return job
                    idle = time.monotonic() - since
                    if idle >= WORKER_IDLE_SECONDS and worker.live() and not worker.retiring and any(
                            w.live() and not w.retiring for w in self._workers if w is not worker):
                        worker.retiring = True  # (so that two idle ones do not both stop)
                        return _RETIRE
                    # Until its idle time is up; past it (the only process up), until something
                    # changes: every worker leaving this wait wakes the others (notify_all below).
                    live_for = WORKER_IDLE_SECONDS - idle if worker.live() else 0.0
                    self._ready.wait(live_for if live_for > 0 else None)
                return None
            finally:
                worker.waiting = False
                self._ready.notify_all()

    def _requeue(self, job: _Job) -> None:
        with self._lock:
            job.worker = None
            if not job.cancelled and not self.closed:
                self._queue.appendleft(job)
                self._ready.notify_all()
                return
        if self.closed:
            self._finish(job, None, CompileAborted("the engine shut down while the grammar compiled"))

    def _finish(self, job: _Job, compiled: Any, error: BaseException | None) -> None:
        on_finish = self._on_finish() if self._on_finish is not None else None
        if on_finish is not None:
            on_finish(job, compiled, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:
            self._finish(job, None, error)

    def close(self) -> None:
        """Kill the workers; queued jobs fail. Their threads end on their own."""
        with self._lock:
            self.closed = True  # (nothing joins the queue from now on)
            self._ready.notify_all()
        for w in self._workers:
            w.kill()
        self._fail_all(CompileAborted("the engine shut down while the grammar compiled"))


# ---- the engine's structured-output state -----------------------------------------------------


class StructuredOutputManager:
    """One engine's xgrammar state: tokenizer info (built on first use), the compile pool, the
    grammar cache (bounded in entries and in bytes).

    `tokenizer`: the model's (transformers), or its pickle compressed by zlib (bytes), unpickled on
    first use: an engine core in its own process keeps only that (engine/core.py).
    `vocab_size` is the width of the model's logits, which may exceed the tokenizer's (padded
    embeddings): the ids past the tokenizer are never allowed. The compile budget, memory limit,
    worker count and cache size default to armserve.config's GRAMMAR_* (or their environment
    variables) when not given.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int], *,
                 compile_timeout: float | None = None, compile_memory_mb: float | None = None,
                 compile_workers: int | None = None, cache_mb: float | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout = _setting(compile_timeout, "GRAMMAR_COMPILE_TIMEOUT")
        self.compile_memory_mb = _setting(compile_memory_mb, "GRAMMAR_COMPILE_MEMORY_MB")
        self.compile_workers = int(_setting(compile_workers, "GRAMMAR_COMPILE_WORKERS"))
        self.cache_limit_bytes = int(_setting(cache_mb, "GRAMMAR_CACHE_MB") * 2**20)
        self._info = None
        self._compiler = None  # in-engine compiler for the bounded kinds
        self._preparing = False  # the compiler is being built (`_prepare`)
        self._pending: list[tuple[_Job, StructuredOutputsParams]] = []  # what waits for it
        self._pool: GrammarCompilePool | None = None
        self._cache: OrderedDict[tuple[str, str, bool], tuple[Any, int]] = OrderedDict()
        self.cache_bytes = 0
        self._jobs: dict[tuple[str, str, bool], _Job] = {}  # compiles under way, by key
        # Compiles finish on the pool's threads while the engine thread looks grammars up: the
        # lock guards the cache, the jobs and the creation of the compiler and pool.
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None

    def _xgr(self):
        try:
            import xgrammar as xgr
        except ImportError:
            raise ValueError("structured outputs need xgrammar: pip install --no-deps 'xgrammar>=0.2.8,<0.3' "
                             "'apache-tvm-ffi>=0.1.11' (no-deps: its wheel declares triton, for GPUs)") from None
        return xgr

    def _build_compiler(self) -> None:
        """Build xgrammar's token table and the in-engine compiler: seconds for a 150k-token
        vocabulary (and unpickling the tokenizer first when only its pickle is kept), so on a
        thread of its own (`_prepare`), never the engine loop's."""
        xgr = self._xgr()
        tokenizer = (pickle.loads(zlib.decompress(self.tokenizer)) if isinstance(self.tokenizer, bytes)
                     else self.tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=self.stop_token_ids or None)
        # It compiles only bounded grammars, which our LRU keeps: no cache of its own.
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        with self._lock:
            self._info, self._compiler = info, compiler
            if isinstance(self.tokenizer, bytes):
                self.tokenizer = None  # (the token table holds what xgrammar needs from here on)

    def _prepare(self) -> None:
        """The first constraints' thread: build the compiler, then compile what waited for it
        (inline kinds here, the others on the pool)."""
        error: BaseException | None = None
        try:
            self._build_compiler()
        except Exception as e:  # (xgrammar refusing this tokenizer)
            error = ValueError(f"structured outputs: cannot build xgrammar's token table: {_clean(e)}")
        if self.tokenizer is None:
            # The unpickled tokenizer is gone (only its token table stays): hand back its heap, ~100
            # MiB resident for a 150k-token vocabulary in this thread's malloc arena otherwise.
            gc.collect()
            release_free_heap()
        with self._lock:
            pending, self._pending, self._preparing = self._pending, [], False
        for job, so in pending:
            compiled = None
            err = error
            with self._lock:
                if self._jobs.get(job.key) is not job or not job.waiters:
                    continue  # every request waiting on it was aborted
                if err is None and not self._inline(so, job.key):
                    self._get_pool().submit(job)
                    continue
                if err is None:
                    try:
                        compiled = self._compile_inline(self._compiler, so, job.key)
                    except ValueError as e:
                        err = e
            self._job_done(job, compiled, err)

    def _get_pool(self) -> GrammarCompilePool:
        """The compile pool, started on first use; call under the lock."""
        if self._pool is None or self._pool.closed:
            xgr = self._xgr()
            info = self._info  # (built: the pool starts after the compiler)
            self._pool = GrammarCompilePool(info.serialize_json(),
                                            lambda js: xgr.CompiledGrammar.deserialize_json(js, info),
                                            self.compile_workers, self.compile_timeout, self.compile_memory_mb)
            self._pool._on_finish = weakref.WeakMethod(self._job_done)
            # LLM objects come and go (tests, notebooks): their workers go with them.
            weakref.finalize(self, self._pool.close)
        return self._pool

    @staticmethod
    def _inline(so: StructuredOutputsParams, key: tuple[str, str, bool]) -> bool:
        """Compiled in the engine: bounded in time and memory (see INLINE_CHOICE_CHARS)."""
        return key[0] == "json_object" or (key[0] == "choice" and sum(map(len, so.choice or ())) <= INLINE_CHOICE_CHARS)

    def _cache_put(self, key: tuple[str, str, bool], compiled: Any) -> None:
        """Under the lock: keep `compiled`, dropping the least recently used past either bound."""
        size = int(compiled.memory_size_bytes)
        if key in self._cache or size > self.cache_limit_bytes:
            return
        self._cache[key] = (compiled, size)
        self.cache_bytes += size
        while len(self._cache) > GRAMMAR_CACHE_SIZE or self.cache_bytes > self.cache_limit_bytes:
            _, (_, old) = self._cache.popitem(last=False)
            self.cache_bytes -= old

    def cached(self, so: StructuredOutputsParams):
        """The compiled grammar of `so` if cached (now the most recent), else None."""
        with self._lock:
            return self._cache_get(so.cache_key())

    def _cache_get(self, key: tuple[str, str, bool]):
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
        return None if hit is None else hit[0]

    def compile_async(self, so: StructuredOutputsParams, on_done: OnCompiled) -> "_Waiter | None":
        """Start compiling `so` unless it is cached or compiles inline (None: the grammar is now in
        the cache). Otherwise `on_done(compiled, error)` is called once, on a pool thread (or by
        `cancel`), error being a ValueError naming the problem; returns the handle for `cancel`."""
        return self._start(so, on_done)[1]

    def _start(self, so: StructuredOutputsParams, on_done: OnCompiled) -> tuple[Any, "_Waiter | None"]:
        """(compiled grammar, None) when cached or compiled inline, else (None, handle)."""
        key = so.cache_key()
        self._xgr()  # (xgrammar missing: a ValueError now)
        with self._lock:
            compiled = self._cache_get(key)
            if compiled is not None:
                return compiled, None
            if self._compiler is not None and self._inline(so, key):
                compiled = self._compile_inline(self._compiler, so, key)
                self._cache_put(key, compiled)
                return compiled, None
            job = self._jobs.get(key)
            if job is None:  # one compile for every request waiting on the same constraint
                spec = choice_grammar(so.choice) if key[0] == "choice" else (  # type: ignore[arg-type]
                    so.regex if key[0] == "regex" else so.grammar if key[0] == "grammar" else key[1])
                job = _Job(key, spec, [on_done])
                self._jobs[key] = job
                if self._compiler is None:
                    # NOTE: the first constraint waits for xgrammar's token table, built on a thread
                    # of its own: on the engine loop it stalled every request for seconds.
                    self._pending.append((job, so))
                    if not self._preparing:
                        self._preparing = True
                        threading.Thread(target=self._prepare, name="armserve-grammar-prepare", daemon=True).start()
                else:
                    self._get_pool().submit(job)
            else:
                job.waiters.append(on_done)
            return None, _Waiter(job, on_done)

    def cancel(self, handle: "_Waiter") -> None:
        """The request of `handle` went away: its callback gets CompileAborted now; the compile
        itself is dropped (its worker killed) when no other request waits on it."""
        job, on_done = handle.job, handle.on_done
        with self._lock:
            if on_done not in job.waiters:
                return  # finished already
            job.waiters.remove(on_done)
            last = not job.waiters
            if last and self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            pool = self._pool
        if last and pool is not None:
            pool.cancel(job)
        on_done(None, CompileAborted("the request was aborted while its grammar compiled"))

    def _job_done(self, job: _Job, compiled: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            waiters, job.waiters = job.waiters, []
            if compiled is not None:
                self._cache_put(job.key, compiled)
        for on_done in waiters:
            on_done(compiled, error)

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of `so` (blocking), from the LRU cache when seen before. Raises
        ValueError naming the field and the problem for an invalid or too complex constraint."""
        done: Future = Future()
        compiled, handle = self._start(so, lambda c, e: done.set_result(c) if e is None else done.set_exception(e))
        return compiled if handle is None else done.result()

    @staticmethod
    def _compile_inline(compiler, so: StructuredOutputsParams, key: tuple[str, str, bool]):
        try:
            if key[0] == "json_object":
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_grammar(choice_grammar(so.choice))  # type: ignore[arg-type]
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{key[0]}: invalid {_WHAT[key[0]]}: {_clean(e)}") from None

    def worker_pids(self) -> list[int]:
        """The live compile workers' process ids (for tests and diagnostics)."""
        pool = self._pool
        return pool.worker_pids() if pool is not None else []

    def close(self) -> None:
        """Stop the compile workers (a later compile starts new ones); waiting compiles fail."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def new_matcher(self, compiled):
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    # ---- per step ----------------------------------------------------------------------------

    def fill_bitmask(self, matchers: list) -> torch.Tensor:
        """The allowed-token bitmask [len(matchers), ceil(vocab / 32)] int32 of each matcher's
        next token (bit t of the row: token t allowed)."""
        words = -(-self.vocab_size // 32)
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        arr = bitmask.numpy()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(arr, i)
        return bitmask

    def fill_bitmask_async(self, matchers: list) -> Future:
        """`fill_bitmask` on a worker thread, so it overlaps the model's forward pass."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="armserve-grammar")
        return self._worker.submit(self.fill_bitmask, matchers)


@dataclass(slots=True, eq=False)
class _Waiter:
    """One request's wait on a compile (what `compile_async` returns, for `cancel`)."""

    job: _Job
    on_done: OnCompiled


# Byte value -> its 8 bits as additive logit masks (0 allowed, -inf not): one embedding lookup per
# bitmask byte unpacks a row (~30 us for a 50k vocabulary, 4x xgrammar's own CPU kernel here).
_BYTE_TO_MASK = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set, in place, the logits of tokens the grammar forbids to -inf in rows `rows` of `logits`
    [B, V] float32; row r of `bitmask` belongs to logits row rows[r]. Other rows are untouched."""
    # NOTE: the int32 words are little-endian on every platform we build for, so byte k of the
    # row covers tokens 8k..8k+7, bit b token 8k+b (xgrammar's layout).
    masks = torch.nn.functional.embedding(bitmask.view(torch.uint8).long(), _BYTE_TO_MASK)
    masks = masks.view(bitmask.shape[0], -1)[:, : logits.shape[1]]
    logits.index_add_(0, rows, masks)
