"""Where an engine core runs, as the async engine sees it: on a thread of this process (`ThreadCore`)
or in a child process of its own (`ProcessCore`, the default). Both take commands (`send`) and
hand every message of the core (engine/core.py) to `on_message`."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from typing import Any, Callable

from armserve.config import EngineConfig
from armserve.engine.commands import StopCommand
from armserve.engine.exceptions import EngineDeadError

logger = logging.getLogger("armserve")


def _core_process(*args: Any) -> None:
    """The core process's entry point (engine/core.py: core_process_main). The engine's modules
    (torch, kernels, models) load here, in the child: the front end that spawns it never imports them."""
    from armserve.engine.core import core_process_main

    core_process_main(*args)


def engine_process_default() -> bool:
    """ARMSERVE_ENGINE_PROCESS, else vLLM's VLLM_ENABLE_V1_MULTIPROCESSING, else on."""
    for var in ("ARMSERVE_ENGINE_PROCESS", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        v = os.environ.get(var, "").strip().lower()
        if v:
            if v not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"{var} must be 0 or 1, got {v!r}")
            return v in ("1", "true", "yes", "on")
    return True


class ThreadCore:
    """An engine core on a thread of this process (the model loads in the caller's thread)."""

    def __init__(self, config: EngineConfig, on_message: Callable[[tuple], None], stats_interval: float,
                 warm_up: bool) -> None:
        from armserve.engine.core import EngineCore  # the engine runs in this process: it loads here

        self._ready = threading.Event()

        def emit(msg: tuple) -> None:
            on_message(msg)
            if msg[0] in ("ready", "dead"):
                self._ready.set()

        self.core = EngineCore(config, emit, stats_interval)
        self._thread = threading.Thread(target=self.core.run, args=(warm_up,), name="armserve-engine", daemon=True)

    def start(self) -> None:
        """Start the loop; returns once it has warmed up."""
        self._thread.start()
        self._ready.wait()

    def send(self, cmd: Any) -> None:
        self.core.put(cmd)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        if self._thread.is_alive():
            self.core.put(StopCommand())
            self._thread.join(timeout)


class ProcessCore:
    """An engine core in a child process (spawned: no fork of a threaded, OpenMP-initialised
    parent). Commands go down one pipe, messages come back up another, read by a thread here."""

    def __init__(self, config: EngineConfig, on_message: Callable[[tuple], None], stats_interval: float,
                 warm_up: bool, env: dict[str, str], index: int = 0, send_tokenizer: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._msg_recv, msg_send = ctx.Pipe(duplex=False)
        self._on_message = on_message
        self._send_lock = threading.Lock()
        self._dead_sent = False
        level = logging.getLogger("armserve").getEffectiveLevel()
        self.proc = ctx.Process(
            target=_core_process, name=f"armserve-engine-core-{index}",
            args=(config, cmd_recv, msg_send, level, stats_interval, warm_up, env, send_tokenizer),
        )
        self.proc.start()
        # Only the child holds these ends now: when it exits, this side sees EOF at once.
        cmd_recv.close()
        msg_send.close()

    def start(self) -> None:
        """Wait until the core has loaded and warmed up (raises its loading error), then read its
        messages on a thread."""
        def died() -> EngineDeadError:
            self.proc.join(5)
            return EngineDeadError(
                f"the engine core process exited with code {self.proc.exitcode} while loading the model (see its "
                "log above; a script that starts one must do so under `if __name__ == \"__main__\":`, as with "
                "any spawned process)")

        while not self._msg_recv.poll(0.5):
            if not self.proc.is_alive():
                raise died()
        try:
            msg = self._msg_recv.recv()
        except (EOFError, OSError):
            raise died() from None
        if msg[0] == "failed":
            self.proc.join(10)
            raise msg[1]
        self._on_message(msg)
        threading.Thread(target=self._read, name="armserve-core-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._msg_recv.recv()
            except (EOFError, OSError):
                self.proc.join(5)
                if not self._dead_sent:
                    self._on_message(("dead", f"the engine core process exited unexpectedly "
                                              f"(exit code {self.proc.exitcode})"))
                return
            if msg[0] == "dead":
                self._dead_sent = True
            self._on_message(msg)

    def send(self, cmd: Any) -> None:
        with self._send_lock:
            try:
                self._cmd_send.send(cmd)
            except (BrokenPipeError, OSError):
                pass  # the core is gone; the reader reports it

    def alive(self) -> bool:
        return self.proc.is_alive() and not self._dead_sent

    def stop(self, timeout: float) -> None:
        if self.proc.is_alive():
            self.send(StopCommand())
            self.proc.join(timeout)
            if self.proc.is_alive():
                logger.warning("the engine core process did not stop in %.0f s; terminating it", timeout)
                self.proc.terminate()
                self.proc.join(5)
            if self.proc.is_alive():  # (seen on a 2-core machine loaded 8 deep: a core never outlives shutdown)
                logger.warning("the engine core process did not exit on SIGTERM in 5 s; killing it")
                self.proc.kill()
                self.proc.join(5)
        self._cmd_send.close()
