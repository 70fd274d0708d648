"""A child Python process with two pipes for multiprocessing.connection messages, passed to it by fd:
how an engine core (engine/core_client.py) and a grammar-compile worker (engine/structured_output.py)
start. A plain subprocess, not multiprocessing's spawn: no __main__ module is imported again and
no resource-tracker process runs beside it."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Callable


def start_child(argv: Callable[[int, int], list[str]], env: dict[str, str] | None = None,
                ) -> tuple[subprocess.Popen, Connection, Connection]:
    """Start `sys.executable` with the arguments `argv(read_fd, write_fd)` gives for the child's
    ends of two pipes; returns (process, connection to send it messages, connection to read its)."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, *argv(to_r, from_w)], pass_fds=(to_r, from_w),
                                stdin=subprocess.DEVNULL, env=env, close_fds=True)
    except BaseException:
        os.close(to_w)
        os.close(from_r)
        raise
    finally:
        # Only the child holds these ends now: when it exits, this side sees EOF at once.
        os.close(to_r)
        os.close(from_w)
    return proc, Connection(to_w, readable=False), Connection(from_r, writable=False)
