"""The async engine: its engine core in a child process (the server's default) and on a thread,
data-parallel engines, and what happens when a core process dies or cannot load."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import pickle
import time
from dataclasses import replace

import pytest

from armserve import LLM, SamplingParams
from armserve.config import EngineConfig
from armserve.cpu import allowed_cpus, data_parallel_envs, physical_cores
from armserve.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloadedError,
    RequestTimeoutError,
    engine_process_default,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "The best way to learn", "Hello, my name is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _core_processes() -> list:
    """This process's engine-core children still running (core_client.ProcessCore's)."""
    import psutil

    from armserve.engine.core_client import PROCESS_TAG

    out = []
    for p in psutil.Process().children():
        try:
            if PROCESS_TAG in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass  # gone meanwhile
    return out


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, kv_cache_space=0.02, max_model_len=512, **kw)


async def _collect(llm: AsyncLLM, prompts: list, params: SamplingParams) -> list[tuple[list[int], str, list[int]]]:
    """(output token ids, text, prompt token ids) per prompt, all submitted at once."""

    async def one(p):
        ids: list[int] = []
        text = ""
        prompt_ids = None
        async for out in llm.generate(p, params):
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
            prompt_ids = out.prompt_token_ids
        return ids, text, prompt_ids

    return await asyncio.gather(*(one(p) for p in prompts))


class _PerEngine:
    """A stat logger counting finished requests and generated tokens per engine."""

    def __init__(self) -> None:
        self.finished: dict[int, int] = {}
        self.tokens: dict[int, int] = {}

    def record(self, scheduler, iteration, engine: int = 0) -> None:
        self.finished[engine] = self.finished.get(engine, 0) + len(iteration.finished)
        self.tokens[engine] = self.tokens.get(engine, 0) + iteration.num_generation_tokens


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama, kv_cache_space=0.02, max_model_len=512)


@pytest.fixture(scope="module")
def reference(offline):
    outs = offline.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, list(o.prompt_token_ids)) for o in outs]


def _stop_params(reference) -> SamplingParams:
    # a stop string from the middle of some prompts' greedy text (with temperature 0 both of a
    # request's 2 completions are the same): those requests end early, the others run to 24 tokens
    stops = [reference[0][1][8:11], reference[2][1][12:14]]
    return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2, stop=stops)


@pytest.fixture(scope="module")
def stop_reference(offline, reference):
    outs = offline.generate(PROMPTS, _stop_params(reference), use_tqdm=False)
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "core-thread"])
def test_async_engine_equals_offline_engine(tiny_llama, reference, engine_process):
    llm = AsyncLLM(_config(tiny_llama), log_stats=False, engine_process=engine_process)
    try:
        assert llm.max_model_len == 512
        got = asyncio.run(_collect(llm, PROMPTS, GREEDY))
        # Same engine, same batch: the same greedy tokens and text, prompt ids restored by the frontend.
        assert got == reference
        # A request the engine refuses names the problem, and the engine keeps serving.
        with pytest.raises(ValueError, match="max_model_len"):
            asyncio.run(llm.add_request(None, "Hi", SamplingParams(max_tokens=5000)))
        assert asyncio.run(_collect(llm, PROMPTS[:1], GREEDY)) == reference[:1]
        assert llm.is_running
    finally:
        llm.shutdown()
    assert not llm.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.add_request(None, "Hi", GREEDY))
    assert not _core_processes()


@pytest.mark.parametrize("engine_process", [True, False], ids=["core-process", "core-thread"])
def test_stop_strings_found_by_the_front_end_stop_their_sequences(tiny_llama, reference, stop_reference,
                                                                  engine_process):
    """The front end's output processor finds the stop strings (the core sees token ids only) and has
    the core stop those sequences: the same outputs as the offline engine, n=2 completions included,
    and afterwards no sequence runs and no KV block is held."""
    params, want = _stop_params(reference), stop_reference
    assert any(c[2] == "stop" for o in want for c in o) and any(c[2] == "length" for o in want for c in o)
    steps: list[bool] = []  # per record of the stat loggers: was it an engine step?

    class Steps:
        def record(self, scheduler, iteration, engine: int = 0) -> None:
            steps.append(iteration.step)

    # (an idle core reports its state every stats_interval: short, so that the waits below are too)
    llm = AsyncLLM(_config(tiny_llama), log_stats=False, engine_process=engine_process, stat_loggers=[Steps()],
                   stats_interval=0.1)
    try:
        async def one(prompt, params=params):
            comps: dict[int, list] = {}
            async for out in llm.generate(prompt, params):
                for c in out.outputs:
                    got = comps.setdefault(c.index, [[], "", None, None])
                    got[0] += c.token_ids
                    got[1] += c.text
                    got[2:] = [c.finish_reason, c.stop_reason]
            return [tuple(comps[i]) for i in sorted(comps)]

        async def settled():
            for _ in range(200):  # (the core stops the last sequences after the front end saw them end)
                if llm.scheduler_stats.num_running == 0 and llm.scheduler_stats.kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            return llm.scheduler_stats

        async def main():
            got = await asyncio.gather(*(one(p) for p in PROMPTS))
            stats = await settled()
            # A request the stop string ends 450 tokens before max_tokens: its sequences are stopped
            # in the core then, not stepped on to the end with their tokens dropped.
            long = await one(PROMPTS[0], replace(params, max_tokens=480))
            before = len(steps)
            await settled()
            return got, stats, long, steps[before:]

        got, stats, long, after = asyncio.run(main())
        assert got == want
        assert stats.num_running == 0 and stats.kv_blocks_used == 0
        assert [c[2] for c in long] == ["stop", "stop"]
        assert sum(after) < 50, f"{sum(after)} steps after the stop string ended the request"
    finally:
        llm.shutdown()


def test_a_core_in_its_own_process_keeps_only_its_tokenizers_pickle(tiny_llama):
    """An engine core whose front end detokenizes lets go of its tokenizer once it has pickled it
    for the front end (nothing refers to the object any more), and still compiles a structured
    request's grammar, from the pickle."""
    import gc
    import pickle
    import queue
    import threading
    import weakref

    from armserve.engine.commands import AddCommand, StopCommand
    from armserve.engine.core import EngineCore
    from armserve.sampling_params import StructuredOutputsParams

    messages: queue.SimpleQueue = queue.SimpleQueue()
    core = EngineCore(_config(tiny_llama), messages.put)
    held = weakref.ref(core.tokenizer)
    loop = threading.Thread(target=core.run, args=(False, True, True))
    loop.start()
    try:
        kind, ready = messages.get(timeout=120)
        assert kind == "ready"
        gc.collect()
        assert held() is None and core.tokenizer is None
        tokenizer = pickle.loads(ready["tokenizer"])
        choices = ["alpha", "beta"]
        params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices))
        core.put(AddCommand(replace(ready["input"], tokenizer=tokenizer).process("r", "Pick one:", params)))
        ids: list[int] = []
        while True:
            msg = messages.get(timeout=120)
            if msg[0] == "accepted":
                assert msg[2] is None, msg[2]
            elif msg[0] == "outputs":
                seqs = [q for q in msg[1].sequences if q.request_id == "r"]
                ids += [t for q in seqs for t in q.token_ids]
                if any(q.finish_reason for q in seqs):
                    break
        assert tokenizer.decode(ids, skip_special_tokens=True) in choices
    finally:
        core.put(StopCommand())
        loop.join(60)


def test_an_idle_core_hands_back_its_step_scratch_and_serves_on(tiny_llama, monkeypatch):
    """An engine core in a process of its own (`own_process`) hands its step scratch and free heap
    back once idle for IdleTrim's delay after a step (here 0.2 s), never while a request runs, and
    the next request's tokens equal the first's."""
    import functools
    import queue
    import threading

    from armserve.engine import core as core_module
    from armserve.engine.commands import AddCommand, StopCommand
    from armserve.engine.core import EngineCore

    monkeypatch.setattr(core_module, "IdleTrim", functools.partial(core_module.IdleTrim, delay=0.2))
    messages: queue.SimpleQueue = queue.SimpleQueue()
    core = EngineCore(_config(tiny_llama), messages.put)
    releases: list[int] = []  # how many requests were unfinished at each release
    real = core.backend.release_idle_memory

    def release() -> None:
        releases.append(len(core.backend.scheduler.running) + len(core.backend.scheduler.waiting))
        real()

    core.backend.release_idle_memory = release
    loop = threading.Thread(target=core.run, args=(False, True, True))
    loop.start()
    try:
        kind, ready = messages.get(timeout=120)
        assert kind == "ready"
        tokenizer = pickle.loads(ready["tokenizer"])
        processor = replace(ready["input"], tokenizer=tokenizer)
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

        def generate(rid: str) -> list[int]:
            core.put(AddCommand(processor.process(rid, "Once upon a time", params)))
            ids: list[int] = []
            while True:
                msg = messages.get(timeout=120)
                if msg[0] == "outputs":
                    seqs = [q for q in msg[1].sequences if q.request_id == rid]
                    ids += [t for q in seqs for t in q.token_ids]
                    if any(q.finish_reason for q in seqs):
                        return ids

        # (one release at the start, before "ready", with the trim after the warm-up's place)
        before = len(releases)
        assert before == 1, releases
        first = generate("a")
        for _ in range(400):  # (up to 20 s; the delay is 0.2 s)
            if len(releases) > before:
                break
            threading.Event().wait(0.05)
        assert len(releases) == before + 1, releases
        assert generate("b") == first
        assert releases and all(n == 0 for n in releases), releases
    finally:
        core.put(StopCommand())
        loop.join(60)


def test_abort_frees_the_request_in_the_core_process(tiny_llama):
    llm = AsyncLLM(_config(tiny_llama), log_stats=False, engine_process=True)
    try:
        async def main():
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            gen = llm.generate("Tell me a long story", long)
            first = await gen.__anext__()
            assert first.outputs[0].token_ids
            await gen.aclose()  # the reader goes away: the core aborts the request
            for _ in range(200):
                if llm.scheduler_stats.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            return llm.scheduler_stats

        stats = asyncio.run(main())
        assert stats.num_running == 0 and stats.kv_blocks_used == 0
    finally:
        llm.shutdown()


def test_a_dead_core_process_fails_its_requests(tiny_llama):
    llm = AsyncLLM(_config(tiny_llama), log_stats=False, engine_process=True)
    try:
        async def main():
            long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
            stream = await llm.add_request(None, "Tell me a long story", long)
            await stream.get()  # the request is running
            os.kill(llm._cores[0].proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                while True:
                    out = await asyncio.wait_for(stream.get(), timeout=60)
                    assert not out.finished, "the request cannot finish: its engine was killed"

        asyncio.run(main())
        assert not llm.is_running
        assert "exited unexpectedly" in str(llm.dead_error)
        with pytest.raises(EngineDeadError):
            asyncio.run(llm.add_request(None, "Hi", GREEDY))
    finally:
        llm.shutdown()


def test_core_process_loading_error_names_the_problem(tiny_llama, tmp_path):
    bad = tmp_path / "bad-model"
    bad.mkdir()
    for name in os.listdir(tiny_llama):
        if name != "config.json":
            os.symlink(os.path.join(tiny_llama, name), bad / name)
    cfg = json.load(open(os.path.join(tiny_llama, "config.json")))
    cfg["architectures"] = ["NoSuchForCausalLM"]
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(ValueError, match="NoSuchForCausalLM"):
        AsyncLLM(_config(str(bad)), log_stats=False, engine_process=True)
    with pytest.raises(ValueError, match="does not exist"):
        AsyncLLM(_config(str(tmp_path / "missing")), log_stats=False, engine_process=True)
    assert not _core_processes()


def test_data_parallel_engines_share_the_load(tiny_llama, reference):
    counts = _PerEngine()
    llm = AsyncLLM(_config(tiny_llama, data_parallel_size=2), log_stats=False, stat_loggers=[counts])
    try:
        prompts = PROMPTS * 11  # 66 streams at once
        got = asyncio.run(_collect(llm, prompts, GREEDY))
        # Whichever engine served it, each request gets the single engine's greedy output.
        assert got == reference * 11
        assert sum(counts.finished.values()) == len(prompts)
        assert sum(counts.tokens.values()) == len(prompts) * GREEDY.max_tokens
        # Balanced by requests in flight: both engines took a large share.
        assert min(counts.finished.get(0, 0), counts.finished.get(1, 0)) >= len(prompts) // 4, counts.finished
        assert [s.num_running for s in llm.engine_stats] == [0, 0]
    finally:
        llm.shutdown()


def test_data_parallel_engines_get_their_own_cores(monkeypatch):
    monkeypatch.delenv("ARMSERVE_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert data_parallel_envs(1) == [{}]
    cores = physical_cores()
    envs = data_parallel_envs(2)  # every test machine has 2 cores or more
    groups = [set(map(int, e["ARMSERVE_THREADS_BIND"].split(","))) for e in envs]
    assert groups[0] and groups[1] and not groups[0] & groups[1]
    assert groups[0] | groups[1] <= set(cores if len(cores) >= 2 else allowed_cpus())
    with pytest.raises(ValueError, match="at least one core per engine"):
        data_parallel_envs(len(allowed_cpus()) + 1)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert data_parallel_envs(2) == [{"ARMSERVE_THREADS_BIND": "0"}, {"ARMSERVE_THREADS_BIND": "1"}]
    with pytest.raises(ValueError, match="needs one per engine"):
        data_parallel_envs(3)
    monkeypatch.setenv("ARMSERVE_THREADS_BIND", "0-x|1")
    with pytest.raises(ValueError, match="ARMSERVE_THREADS_BIND"):
        data_parallel_envs(2)


def test_engine_process_setting(monkeypatch):
    monkeypatch.delenv("ARMSERVE_ENGINE_PROCESS", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert engine_process_default() is True
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert engine_process_default() is False
    monkeypatch.setenv("ARMSERVE_ENGINE_PROCESS", "1")  # armserve's own name wins
    assert engine_process_default() is True
    monkeypatch.setenv("ARMSERVE_ENGINE_PROCESS", "maybe")
    with pytest.raises(ValueError, match="ARMSERVE_ENGINE_PROCESS"):
        engine_process_default()
    with pytest.raises(ValueError, match="data_parallel_size"):
        AsyncLLM(EngineConfig(model="unused", data_parallel_size=2), engine_process=False)


class _PromptTokensPerStep:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def record(self, scheduler, iteration, engine: int = 0) -> None:
        if iteration.num_prompt_tokens:
            self.steps.append(iteration.num_prompt_tokens)


@pytest.mark.parametrize("budget", [None, 1024], ids=["server-default", "explicit"])
def test_a_servers_steps_carry_at_most_its_token_budget(tiny_llama, budget):
    """A server's default step budget is smaller than offline generation's (time to first token
    under load, config.py): six 300-token prompts sent together are prefilled in steps of at most
    512 tokens in the core process; an explicit budget is kept."""
    from armserve.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, SERVING_MAX_NUM_BATCHED_TOKENS

    steps = _PromptTokensPerStep()
    llm = AsyncLLM(_config(tiny_llama, max_num_batched_tokens=budget, enable_prefix_caching=False),
                   log_stats=False, stat_loggers=[steps], engine_process=True)
    try:
        want = budget or SERVING_MAX_NUM_BATCHED_TOKENS
        assert llm.config.max_num_batched_tokens == want < OFFLINE_MAX_NUM_BATCHED_TOKENS
        prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 500 for i in range(300)]} for j in range(6)]
        got = asyncio.run(_collect(llm, prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)))
        assert all(len(ids) == 2 for ids, _, _ in got)
        assert sum(steps.steps) == 6 * 300 and max(steps.steps) <= want, steps.steps
    finally:
        llm.shutdown()
    assert LLM(tiny_llama, kv_cache_space=0.02, max_model_len=512).llm_engine.config.max_num_batched_tokens \
        == OFFLINE_MAX_NUM_BATCHED_TOKENS


def test_a_deadline_aborts_the_request_and_frees_its_blocks(smollm2_gguf):
    """`deadline`: a request not finished in time ends with RequestTimeoutError, its KV blocks
    freed; others keep being served. (SmolLM2: 400 tokens take seconds even on a fast core.)"""
    llm = AsyncLLM(EngineConfig(model=smollm2_gguf, kv_cache_space=0.05, max_model_len=1024), log_stats=False,
                   engine_process=False)
    try:
        async def main() -> int:
            stream = await llm.add_request(None, "Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True),
                                           deadline=0.5)
            got = 0
            with pytest.raises(RequestTimeoutError, match="deadline of 0.5 s"):
                async for out in stream:
                    got += len(out.outputs[0].token_ids)
            return got

        got = asyncio.run(main())
        assert got < 400
        deadline = time.monotonic() + 30
        while llm.scheduler_stats.kv_blocks_used or llm.num_unfinished_requests:
            assert time.monotonic() < deadline, "the expired request kept its blocks"
            time.sleep(0.05)
        out = asyncio.run(_collect(llm, ["Hello"], SamplingParams(max_tokens=4, ignore_eos=True)))
        assert len(out[0][0]) == 4
    finally:
        llm.shutdown()


def test_admission_bounds_refuse_with_retry_after(tiny_llama):
    """Past max_waiting_requests (requests with no output yet) new requests are refused at once."""
    llm = AsyncLLM(_config(tiny_llama, max_waiting_requests=3, max_num_seqs=1), log_stats=False,
                   engine_process=False)
    try:
        async def main():
            # One slot: while this long request runs, everything sent after it waits.
            first = await llm.add_request(None, PROMPTS[0], SamplingParams(max_tokens=480, ignore_eos=True))
            await first.get()
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            results = await asyncio.gather(*(llm.add_request(None, p, params) for p in PROMPTS[1:]),
                                           return_exceptions=True)
            refused = [r for r in results if isinstance(r, EngineOverloadedError)]
            streams = [r for r in results if not isinstance(r, BaseException)]
            for s in [first, *streams]:
                async for _ in s:
                    pass
            return refused, streams

        refused, streams = asyncio.run(main())
        assert len(streams) == 3 and len(refused) == 2
        assert all(e.status == 429 and e.retry_after >= 1 and "max_waiting_requests 3" in str(e) for e in refused)
        assert llm.num_waiting_requests == 0 and llm.num_unfinished_requests == 0
    finally:
        llm.shutdown()


def test_a_core_that_ignores_stop_and_sigterm_is_killed():
    """shutdown's last resort: a core process that neither stops on its command nor exits on
    SIGTERM (a loaded machine made one take longer than both waits) is killed, never left running."""
    import subprocess
    import sys

    from armserve.engine.core_client import ProcessCore

    core = ProcessCore.__new__(ProcessCore)  # (its process only: the stand-in below never reads commands)
    core.proc = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\n"
                                  "time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    assert core.proc.stdout.readline().strip() == "ready"  # (its SIGTERM handler is in place)
    core.send = lambda command: None
    core._cmd_send, ours = multiprocessing.Pipe(duplex=False)  # (stop closes the command pipe last)
    t0 = time.monotonic()
    core.stop(0.5)
    assert core.proc.poll() == -signal.SIGKILL
    assert time.monotonic() - t0 < 30
    ours.close()
    core.proc.stdout.close()
