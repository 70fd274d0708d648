"""The server process of `armserve serve` (`run_server`): bind the port, load the engine, pin the
front end's threads, then serve the app (api_server.build_app) until a signal drains it or the
engine dies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import time

from fastapi import FastAPI

from armserve.engine.async_llm import AsyncLLM
from armserve.engine.exceptions import EngineDeadError
from armserve.entrypoints.api_server import build_app
from armserve.entrypoints.metrics import PrometheusMetrics
from armserve.entrypoints.middleware import ServerLimits, http_protocol
from armserve.memory import page_out_library_code

logger = logging.getLogger("armserve")


def _bind(host: str, port: int) -> socket.socket:
    """Bind the port before the model loads, so a busy port fails in a second, not after loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def default_served_name(model: str | None, path: str) -> str:
    """The model argument as given (vLLM's default); for the bundled model, its short name."""
    if model:
        return model
    name = os.path.basename(path)
    return name.split(".")[0] if name.endswith(".gguf") else name


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process to `cpus` (os.sched_setaffinity(0) moves only the caller)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just ended


class ArmServer:
    """uvicorn's server with an engine-aware life cycle.

    - SIGTERM: stop admitting (new requests and /health answer 503), let the requests in flight
      finish for up to `drain_timeout` s, end the rest with an error event / 503, then exit 0.
      SIGINT (Ctrl-C) does the same without waiting; a second signal exits at once.
    - The engine dies (and is not being restarted): its requests have failed already; the server
      exits with code 1 within a second, so that a supervisor starts it again.
    """

    def __init__(self, config, app: FastAPI, engine: AsyncLLM, drain_timeout: float) -> None:
        import uvicorn

        outer = self

        class _Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame) -> None:  # runs in the main thread (signal handler)
                if outer.draining or outer.loop is None:
                    super().handle_exit(sig, frame)
                    return
                outer.draining = True
                app.state.draining = True
                wait = drain_timeout if sig == signal.SIGTERM else 0.0
                outer.loop.call_soon_threadsafe(lambda: outer.loop.create_task(outer.drain(wait)))

        self.server = _Server(config)
        self.app = app
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.draining = False
        self.exit_code = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def drain(self, timeout: float) -> None:
        engine = self.engine
        n = engine.num_unfinished_requests
        logger.info("shutting down: refusing new requests; %d in flight%s", n,
                    f", waiting up to {timeout:g} s for them" if n and timeout else "")
        deadline = time.monotonic() + timeout
        while engine.num_unfinished_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = engine.num_unfinished_requests
        if left:
            logger.warning("shutting down: ending %d unfinished request(s) with an error", left)
            engine.fail_unfinished(EngineDeadError(
                f"the server is shutting down and the request did not finish within the drain timeout of "
                f"{timeout:g} s (--shutdown-timeout)"))
            await asyncio.sleep(0.2)  # let their streams write the error event and [DONE]
        self.server.should_exit = True

    async def watch_engine(self) -> None:
        engine = self.engine
        while not self.server.should_exit:
            await asyncio.sleep(0.2)
            if engine.dead_error is not None and not engine.restarting and not self.draining:
                logger.error("the engine is dead (%s): exiting so that a supervisor can restart the server",
                             engine.dead_error)
                self.exit_code = 1
                await asyncio.sleep(0.2)  # the failed requests' error events reach their clients
                self.server.should_exit = True
                return

    def run(self, sock: socket.socket) -> int:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            watcher = self.loop.create_task(self.watch_engine())
            try:
                await self.server.serve(sockets=[sock])
            finally:
                watcher.cancel()

        asyncio.run(main())
        return self.exit_code


def check_https_and_root_path(args) -> str:
    """A ValueError naming a bad --ssl-* or --root-path flag (before anything loads); the root
    path without its trailing slash."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if getattr(args, flag) and not os.path.isfile(getattr(args, flag)):
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: no such file")
    root_path = args.root_path.rstrip("/")
    if root_path and not root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    return root_path


def run_server(args: argparse.Namespace) -> int:
    """`armserve serve`: load the model, then serve until SIGTERM (drained) or SIGINT; exits 1
    if the engine dies."""
    import uvicorn

    from armserve.engine_args import engine_kwargs
    from armserve.config import EngineConfig
    from armserve.entrypoints.reasoning import ReasoningParser
    from armserve.entrypoints.serving_models import parse_lora_modules
    from armserve.entrypoints.response_store import ResponseStore
    from armserve.entrypoints.tool_parsers import get_tool_parser
    from armserve.model_source import bundled_model_path

    if args.reasoning_parser:
        ReasoningParser(args.reasoning_parser)  # unknown name: fail before loading anything
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)  # likewise
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if args.responses_store:
        ResponseStore(args.responses_store).close()  # an unusable file: fail before loading anything
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))  # a bad value: fail before loading
    if lora_modules and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules needs --enable-lora")
    api_key = args.api_key or os.environ.get("ARMSERVE_API_KEY") or None
    sock = _bind(args.host, args.port)
    model = args.model or bundled_model_path()
    names = args.served_model_name or [default_served_name(args.model, model)]
    root_path = check_https_and_root_path(args)
    if args.allow_credentials and not args.allowed_origins:
        raise ValueError("--allow-credentials needs --allowed-origins (the origins trusted with credentials)")
    metrics = PrometheusMetrics(names[0], args.data_parallel_size)
    engine = AsyncLLM(EngineConfig(model=model, served_model_name=names[0],
                                   data_parallel_size=args.data_parallel_size,
                                   max_waiting_requests=args.max_waiting_requests,
                                   max_waiting_tokens=args.max_waiting_tokens, **engine_kwargs(args)),
                      log_stats=not args.disable_log_stats, stat_loggers=[metrics],
                      restart_on_failure=args.restart_engine_on_failure)
    try:
        metrics.set_cache_config(engine)
        if engine.frontend_cpus:
            pin_process(engine.frontend_cpus)
            logger.info("the HTTP front end runs on CPU(s) %s, apart from the engine's",
                        ",".join(map(str, engine.frontend_cpus)))
        given = {"max_request_body_bytes": args.max_request_body_bytes, "body_read_timeout": args.body_read_timeout,
                 "header_read_timeout": args.header_read_timeout}
        limits = ServerLimits(**{k: v for k, v in given.items() if v is not None})
        app = build_app(engine, names, metrics, api_key, args.reasoning_parser,
                        access_log=not args.disable_access_log, allowed_origins=args.allowed_origins,
                        tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                        limits=limits, request_timeout=args.request_timeout, allow_credentials=args.allow_credentials,
                        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                        root_path=root_path, log_requests=args.log_requests,
                        responses_store=args.responses_store, lora_modules=lora_modules)
        # Imports, the tokenizer's load and the app built: the code that ran only for them goes back
        # (what a request runs faults in again at the first ones), as the engine core's does.
        page_out_library_code()
        # NOTE: uvicorn's own graceful timeout only bounds the connections still open after the drain
        # (ArmServer.drain) has ended every request.
        # (ws="none": no endpoint speaks WebSocket, so uvicorn loads no WebSocket protocol, ~1 MiB)
        config = uvicorn.Config(app, log_config=None, access_log=False, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5, timeout_graceful_shutdown=5, ws="none",
                                http=http_protocol(limits.header_read_timeout), ssl_keyfile=args.ssl_keyfile,
                                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
        shown_host = f"[{args.host}]" if ":" in args.host else args.host
        scheme = "https" if args.ssl_certfile else "http"
        logger.info("serving %s as %s on %s://%s:%d%s (API key %s)", model, ", ".join(names), scheme, shown_host,
                    args.port, root_path, "required" if api_key else "off")
        code = ArmServer(config, app, engine, args.shutdown_timeout).run(sock)
    finally:
        engine.shutdown()
        sock.close()
    return code
