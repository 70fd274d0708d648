"""`armserve serve` as a subprocess on a free loopback port, for the server tests (the shared
servers themselves are conftest.py's session fixtures)."""

from __future__ import annotations

import os
import re
import socket
import ssl
import subprocess
import sys
import time
from typing import Any

import httpx

API_KEY = "test-secret-key"  # auth_server's (conftest.py)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`armserve serve MODEL ...` on 127.0.0.1; `.url`, `.base_url` (/v1) and `.log()`."""

    def __init__(self, model: str, args: list[str], log_path: str, env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0, https_ca: str | None = None) -> None:
        """`https_ca`: the server serves HTTPS (--ssl-*), with a certificate this CA file vouches for."""
        self.port = free_port()
        # (an SSLContext: httpx takes no CA path)
        self.verify: Any = ssl.create_default_context(cafile=https_ca) if https_ca else True
        self.url = f"{'https' if https_ca else 'http'}://127.0.0.1:{self.port}"
        self.base_url = f"{self.url}/v1"
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.update({"OMP_NUM_THREADS": "1", "ARMSERVE_LOG_STATS_INTERVAL": "0.2"})
        full_env.pop("ARMSERVE_API_KEY", None)
        full_env.update(env or {})
        # NOTE: one thread per server (OMP_NUM_THREADS above): the machine has 2 shared cores (see
        # conftest). The server's front end imports no torch (test_frontend_memory.py checks it).
        code = "import sys; from armserve.cli import main; sys.exit(main())"
        cmd = [sys.executable, "-c", code, "serve", model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2, verify=self.verify).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy:\n{self.log()[-3000:]}")
            time.sleep(0.3)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self, per_engine: bool = False) -> dict[str, float]:
        """Prometheus samples of the `armserve:` and `vllm:` metrics, keyed by name plus sorted labels;
        summed over data-parallel engines unless `per_engine` (then `engine` is a key label too)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10, verify=self.verify).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith(("armserve:", "vllm:")):
                continue
            m = re.match(r"^([^{ ]+)(\{.*\})? (\S+)$", line)
            assert m, line
            name, labels, value = m.groups()
            extra = [kv for kv in re.findall(r'(\w+="[^"]*")', labels or "")
                     if not kv.startswith("model_name=") and (per_engine or not kv.startswith("engine="))]
            key = name + (("{" + ",".join(sorted(extra)) + "}") if extra else "")
            out[key] = out.get(key, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
