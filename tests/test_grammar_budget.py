"""Grammar compiles under a budget: a schema too complex to compile (10,000 properties: 10+
minutes and +1.4 GB in xgrammar 0.2.8) fails with a ValueError naming "too complex" once its
time budget is spent, without holding up other requests' grammars; an aborted request's compile
is killed; the compiled-grammar cache stays bounded; no compile process outlives its engine."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
import time

import jsonschema
import psutil
import pytest

from armserve import SamplingParams, StructuredOutputsParams
from armserve.config import EngineConfig
from armserve.engine import structured_output
from armserve.engine.async_llm import AsyncLLM

from structured_schemas import SCHEMAS

xgr = pytest.importorskip("xgrammar")

SO = StructuredOutputsParams
BOMB = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}
COLOUR = dict(SCHEMAS)["Give a colour."]
SLACK = 15.0  # seconds on top of a budget: the machine may be shared and busy


def _manager(tokenizer_dir: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return structured_output.StructuredOutputManager(tok, len(tok), {tok.eos_token_id})


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return all(_gone(p) for p in pids)


def _grammar_workers() -> list[psutil.Process]:
    """This test process's grammar-compile workers (children, or grandchildren via a core process)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any("grammar_worker" in part for part in p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _busy_worker(seconds: float = 0.3, share: float = 0.5) -> psutil.Process | None:
    """The worker that burns CPU (more than `share` of a core over `seconds`), if any."""
    procs = _grammar_workers()
    before = {}
    for p in procs:
        try:
            before[p.pid] = sum(p.cpu_times()[:2])
        except psutil.Error:
            pass
    time.sleep(seconds)
    for p in procs:
        try:
            if p.pid in before and sum(p.cpu_times()[:2]) - before[p.pid] > share * seconds:
                return p
        except psutil.Error:
            pass
    return None


# ---- the manager on its own ----------------------------------------------------------------------


def test_bomb_fails_within_its_budget_while_other_grammars_compile(tokenizer_dir, monkeypatch):
    monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_TIMEOUT", "2")
    monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_WORKERS", "2")
    mgr = _manager(tokenizer_dir)
    try:
        mgr.compile(SO(regex="[a-c]+"))  # starts the pool: the budget below is the compile's own
        mgr.compile(SO(regex="[d-f]+"))
        # One after the other, compiles take the worker whose process is up: no second process.
        first = set(mgr.worker_pids())
        assert len(first) == 1
        result: dict = {}

        def bomb() -> None:
            t0 = time.monotonic()
            try:
                mgr.compile(SO(json=BOMB))
            except Exception as e:  # noqa: BLE001 - the test checks what it is
                result["error"] = e
            result["seconds"] = time.monotonic() - t0

        thread = threading.Thread(target=bomb, daemon=True)
        thread.start()
        time.sleep(0.3)
        # Other grammars compile meanwhile, each on the free worker, and all before the bomb's
        # budget is up; they go to the workers (not inline) and are valid.
        others = [SO(regex=r"\d{3}-\d{4}"), SO(json=SCHEMAS[0][1]),
                  SO(choice=[f"option number {i:04d} of a long list" for i in range(200)])]
        for so in others:
            m = mgr.new_matcher(mgr.compile(so))
            assert not m.is_terminated()
        assert thread.is_alive(), "the other grammars had to wait for the bomb"
        workers = set(mgr.worker_pids())
        assert len(workers) == 2 and first < workers  # the second started for the overlap
        thread.join(2.0 + SLACK)
        assert not thread.is_alive(), "the bomb's compile was not stopped at its budget"
        err = result["error"]
        assert isinstance(err, ValueError) and "too complex" in str(err) and "2 s" in str(err), err
        assert result["seconds"] < 2.0 + SLACK
        # Its worker was killed (and is being replaced); the other one lives on.
        killed = workers - set(mgr.worker_pids())
        assert len(killed) == 1 and _wait_gone(killed, 5.0)
        assert mgr.cached(SO(json=BOMB)) is None
        mgr.compile(SO(regex="[x-z]+"))  # the pool still serves
    finally:
        mgr.close()
    assert _wait_gone(workers | set(mgr.worker_pids()), 5.0)


def test_an_idle_second_worker_stops_and_the_first_serves_on(tokenizer_dir, monkeypatch):
    """The second process (started when two compiles overlapped) stops after WORKER_IDLE_SECONDS
    without a job; one process stays up however long it idles, and compiles on. A worker maps
    xgrammar but neither torch nor the tokenizer libraries."""
    monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_WORKERS", "2")
    monkeypatch.setattr(structured_output, "WORKER_IDLE_SECONDS", 1.0)
    mgr = _manager(tokenizer_dir)
    try:
        gate = threading.Event()
        # (its process starts, ~0.6 s, then compiles it, ~0.2 s: the regex below comes meanwhile)
        slow = SO(json={"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(400)}})
        t = threading.Thread(target=lambda: (mgr.compile(slow), gate.set()), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while not mgr.worker_pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        mgr.compile(SO(regex="[0-9]{2}"))  # while the slow one compiles: on a second process
        both = set(mgr.worker_pids())
        assert len(both) == 2, both  # (the first was busy: a second process started)
        for pid in both:  # a worker loads xgrammar's compiler only: no torch, no tokenizer libraries
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            assert "libxgrammar" in maps and "libtorch" not in maps and "tokenizers" not in maps
        t.join(120)
        assert gate.is_set()
        deadline = time.monotonic() + 1.0 + SLACK
        while len(mgr.worker_pids()) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        left = set(mgr.worker_pids())
        assert len(left) == 1 and left < both
        assert _wait_gone(both - left, 5.0)
        time.sleep(1.5)  # past the idle time again: the last one stays
        assert set(mgr.worker_pids()) == left
        assert mgr.new_matcher(mgr.compile(SO(regex="[x-z]{3}"))) is not None
        assert set(mgr.worker_pids()) == left
    finally:
        mgr.close()


def test_the_token_table_is_built_off_the_callers_thread(tokenizer_dir, monkeypatch):
    """xgrammar's token table (seconds for a large vocabulary) is built on a thread of its own, from
    the tokenizer's compressed pickle when only that is kept: the first constraints return a handle at once and
    are answered when it is ready, one build for all of them; one aborted meanwhile is never compiled."""
    import pickle
    import zlib

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    manager = structured_output.StructuredOutputManager(zlib.compress(pickle.dumps(tok), 1), len(tok),
                                                        {tok.eos_token_id})
    built_on: list[threading.Thread] = []
    gate = threading.Event()
    real = xgr.TokenizerInfo.from_huggingface

    def slow(*args, **kw):
        built_on.append(threading.current_thread())
        gate.wait(60)  # (held until the caller has checked it got its handles at once)
        return real(*args, **kw)

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", slow)
    answers: dict[str, tuple] = {}
    done = threading.Event()

    def on_done(name):
        def f(compiled, error):
            answers[name] = (compiled, error)
            if len(answers) == 3:
                done.set()
        return f

    try:
        handles = {name: manager.compile_async(so, on_done(name)) for name, so in
                   (("choice", SO(choice=["yes", "no"])), ("regex", SO(regex=r"\d{3}")),
                    ("aborted", SO(regex=r"[a-z]{5}")))}
        assert all(h is not None for h in handles.values()) and not answers
        manager.cancel(handles["aborted"])
        gate.set()
        assert done.wait(120), answers
        assert built_on and threading.current_thread() not in built_on and len(built_on) == 1
        assert answers["choice"][1] is None and answers["regex"][1] is None
        assert isinstance(answers["aborted"][1], structured_output.CompileAborted)
        assert manager.tokenizer is None  # (the pickle is dropped once the table is built)
        # Built: an inline kind compiles at once, a cache hit too.
        assert manager.compile_async(SO(choice=["left", "right"]), on_done("late")) is None
        assert manager.compile_async(SO(regex=r"\d{3}"), on_done("late")) is None
    finally:
        gate.set()
        manager.close()


def test_compile_cache_is_bounded_in_bytes_and_entries(tokenizer_dir, monkeypatch):
    monkeypatch.setenv("ARMSERVE_GRAMMAR_CACHE_MB", "3")
    monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_WORKERS", "1")
    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_SIZE", 8)
    mgr = _manager(tokenizer_dir)
    try:
        # Schemas with a bounded string compile to ~1.2 MB each (xgrammar's memory_size_bytes).
        schemas = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 10 + i}},
                    "required": ["name"]} for i in range(5)]
        sizes = []
        for s in schemas:
            sizes.append(mgr.compile(SO(json=s)).memory_size_bytes)
            assert mgr.cache_bytes <= 3 * 2**20
        assert min(sizes) > 2**20
        assert mgr.cached(SO(json=schemas[-1])) is not None and mgr.cached(SO(json=schemas[0])) is None
        assert mgr.cache_bytes == sum(c.memory_size_bytes for c, _ in mgr._cache.values())
        for i in range(12):
            mgr.compile(SO(regex=f"[a-z]{{{i + 1}}}"))
            assert len(mgr._cache) <= 8
        assert mgr.cached(SO(regex="[a-z]{12}")) is not None and mgr.cached(SO(regex="[a-z]{1}")) is None
    finally:
        mgr.close()


# ---- through the engine core (its own process, or a thread) ---------------------------------------


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "core-thread"])
def test_engine_bomb_is_refused_others_served_abort_kills_no_leaks(tiny_llama, monkeypatch, engine_process):
    budget = 5.0
    extra = {}
    if engine_process:
        monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_TIMEOUT", str(budget))
    else:  # the engine argument (--grammar-compile-timeout) instead of the environment
        monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_TIMEOUT", "600")
        extra = {"grammar_compile_timeout": budget}
    monkeypatch.setenv("ARMSERVE_GRAMMAR_COMPILE_WORKERS", "2")
    # The workers of engines that earlier tests in this process left to the garbage collector (an
    # engine's pool closes when the engine is collected) are not this engine's.
    gc.collect()
    earlier = {p.pid for p in _grammar_workers()}
    llm = AsyncLLM(EngineConfig(model=tiny_llama, kv_cache_space=0.02, max_model_len=512, **extra), log_stats=False,
                   engine_process=engine_process)
    workers: set[int] = set()
    try:
        async def text_of(so: SO, max_tokens: int = 16) -> str:
            p = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
            return "".join([o.outputs[0].text async for o in llm.generate("Answer:", p)])

        async def main() -> None:
            # The first structured request starts the compile pool.
            assert (await text_of(SO(regex="[a-c]{3}"))) in {a + b + c for a in "abc" for b in "abc" for c in "abc"}
            t0 = time.monotonic()
            bomb = asyncio.ensure_future(text_of(SO(json=BOMB)))
            await asyncio.sleep(0.5)
            # Requests after it, with grammars to compile and a cache hit, finish while it compiles.
            colour, digits, choice = await asyncio.wait_for(asyncio.gather(
                text_of(SO(json=COLOUR)), text_of(SO(regex=r"\d{4}")),
                text_of(SO(choice=["yes", "no", "maybe"]))), budget + SLACK)
            jsonschema.validate(json.loads(colour), COLOUR)
            assert len(digits) == 4 and digits.isdigit() and choice in ("yes", "no", "maybe")
            assert not bomb.done(), "the other requests had to wait for the bomb"
            with pytest.raises(ValueError, match=f"too complex.*within {budget:g} s"):
                await asyncio.wait_for(bomb, budget + SLACK)
            assert time.monotonic() - t0 < budget + SLACK

            # Abort while compiling: the worker compiling it is killed at once (before its budget).
            await asyncio.sleep(3.0)  # the killed worker's replacement has started
            bomb2 = asyncio.ensure_future(text_of(SO(json=dict(BOMB, title="again"))))
            t1 = time.monotonic()
            busy = None
            # (a tenth of a core: an idle worker takes none, and on a machine loaded 8 deep on 2
            # cores the compiling one may get only a quarter)
            while busy is None and time.monotonic() - t1 < 3.0:
                busy = await asyncio.to_thread(_busy_worker, 0.3, 0.1)
            assert busy is not None, "no worker compiles the bomb"
            bomb2.cancel()  # the caller goes away: AsyncLLM aborts the request
            t_abort = time.monotonic()
            assert await asyncio.to_thread(_wait_gone, [busy.pid], 2.0), "the aborted compile goes on"
            assert time.monotonic() - t1 < budget, "killed by its budget, not by the abort"
            assert time.monotonic() - t_abort < 2.0
            with pytest.raises(asyncio.CancelledError):
                await bomb2
            # Nothing burns CPU afterwards (the replacement worker has had time to start).
            await asyncio.sleep(3.0)
            assert await asyncio.to_thread(_busy_worker, 0.5) is None
            # The engine serves structured requests as before: inline, and on a worker (both were
            # killed, by the budget and by the abort: a process starts again for this compile).
            assert (await text_of(SO(choice=["left", "right"]))) in ("left", "right")
            three = await text_of(SO(regex="[0-9]{3}"))
            assert len(three) == 3 and three.isdigit()

        asyncio.run(main())
        workers = {p.pid for p in _grammar_workers()} - earlier
        assert len(workers) == 1
    finally:
        llm.shutdown()
    assert _wait_gone(workers, 10.0), "grammar workers outlived their engine"
