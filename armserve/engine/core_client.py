"""Where an engine core runs, as the async engine sees it: on a thread of this process (`ThreadCore`)
or in a child process of its own (`ProcessCore`, the default). Both take commands (`send`) and
hand every message of the core (engine/core.py) to `on_message`."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from typing import Any, Callable

from armserve.config import EngineConfig
from armserve.engine.child import start_child
from armserve.engine.commands import StopCommand
from armserve.engine.exceptions import EngineDeadError

logger = logging.getLogger("armserve")


# The core process's program: it takes this process's sys.path (the first message on its command
# pipe: the checkout or virtualenv armserve comes from), then the core's arguments (engine/core.py:
# core_process_main). The tag after `-c` names the process in `ps` (and for the tests).
PROCESS_TAG = "armserve-engine-core"
_BOOT = ("import sys; from multiprocessing.connection import Connection; "
         "commands = Connection(int(sys.argv[2]), writable=False); sys.path[:] = commands.recv(); "
         "from armserve.engine.core import core_process_main; "
         "core_process_main(commands, Connection(int(sys.argv[3]), readable=False), *commands.recv())")


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
    """An engine core in a child process: a fresh interpreter (no fork of a threaded, OpenMP-
    initialised parent), started as a plain subprocess, not by multiprocessing's spawn, so that no
    __main__ module is imported again (no `if __name__ == "__main__":` needed) and no resource-tracker
    process runs beside it. Commands go down one pipe, messages come back up another, read by a
    thread here (multiprocessing.connection's framing, pickled)."""

    def __init__(self, config: EngineConfig, on_message: Callable[[tuple], None], stats_interval: float,
                 warm_up: bool, env: dict[str, str], index: int = 0, send_tokenizer: bool = False) -> None:
        self.proc, self._cmd_send, self._msg_recv = start_child(
            lambda r, w: ["-c", _BOOT, f"{PROCESS_TAG}-{index}", str(r), str(w)])
        self._on_message = on_message
        self._send_lock = threading.Lock()
        self._dead_sent = False
        level = logging.getLogger("armserve").getEffectiveLevel()
        self.send(list(sys.path))
        self.send((config, level, stats_interval, warm_up, env, send_tokenizer))

    def _join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def _alive(self) -> bool:
        return self.proc.poll() is None

    def start(self) -> None:
        """Wait until the core has loaded and warmed up (raises its loading error), then read its
        messages on a thread."""
        def died() -> EngineDeadError:
            self._join(5)
            return EngineDeadError(
                f"the engine core process exited with code {self.proc.returncode} while loading the model (see its "
                "log above)")

        while not self._msg_recv.poll(0.5):
            if not self._alive():
                raise died()
        try:
            msg = self._msg_recv.recv()
        except (EOFError, OSError):
            raise died() from None
        if msg[0] == "failed":
            self._join(10)
            raise msg[1]
        self._on_message(msg)
        threading.Thread(target=self._read, name="armserve-core-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._msg_recv.recv()
            except (EOFError, OSError):
                self._join(5)
                if not self._dead_sent:
                    self._on_message(("dead", f"the engine core process exited unexpectedly "
                                              f"(exit code {self.proc.returncode})"))
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
        return self._alive() and not self._dead_sent

    def stop(self, timeout: float) -> None:
        if self._alive():
            self.send(StopCommand())
            self._join(timeout)
            if self._alive():
                logger.warning("the engine core process did not stop in %.0f s; terminating it", timeout)
                self.proc.terminate()
                self._join(5)
            if self._alive():  # (seen on a 2-core machine loaded 8 deep: a core never outlives shutdown)
                logger.warning("the engine core process did not exit on SIGTERM in 5 s; killing it")
                self.proc.kill()
                self._join(5)
        self._cmd_send.close()
