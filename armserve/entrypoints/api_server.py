"""The OpenAI-compatible HTTP server (`armserve serve`): FastAPI app, middleware, routes, runner.

Routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, /version, /tokenize,
/detokenize, /metrics. The chat and completion logic lives in `serving.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import armserve
from armserve.prompts import PromptError, encode_text
from armserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestFailedError
from armserve.entrypoints.metrics import CONTENT_TYPE_LATEST, PrometheusMetrics
from armserve.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from armserve.entrypoints.serving import OpenAIServing
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")
access_logger = logging.getLogger("armserve.access")

# Routes that need the API key when one is set. /health, /version and /metrics stay open so
# load balancers and Prometheus need no secret (as in vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_KNOWN_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/version",
                "/tokenize", "/detokenize", "/metrics"}


@dataclass
class ServerLimits:
    """How much of a request the server reads, and for how long (the flags of `armserve serve`)."""

    # Larger bodies are refused with 413 before they are read (from Content-Length, or as soon as
    # a chunked body passes it). 32 MiB: a whole 128k-token context in JSON several times over.
    max_request_body_bytes: int = 32 * 1024 * 1024
    # A body whose next part takes longer than this to arrive is answered 408.
    body_read_timeout: float = 30.0
    # A connection whose request line and headers are not complete this long after they began is
    # closed (slowloris: headers sent a byte at a time hold a connection forever otherwise).
    header_read_timeout: float = 30.0


def http_protocol(timeout: float) -> type:
    """uvicorn's httptools protocol, closing a connection whose headers take longer than `timeout`
    s to arrive (uvicorn has no such timeout of its own)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            logger.info("closing a connection whose request headers took over %g s", timeout)
            self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


class _Refused(StarletteHTTPException):
    """Raised inside the body reader: answer with this status and message. An HTTPException, so
    FastAPI's body parsing passes it on instead of turning it into a 400."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(status, message, headers={"Connection": "close"})
        self.reason = reason


class ServerMiddleware:
    """API-key check, request-body limits, refusal while draining, one access-log line per request
    and HTTP metrics.

    A plain ASGI middleware (not BaseHTTPMiddleware) so streamed responses pass through
    untouched and the line is written when the stream really ends.
    """

    def __init__(self, app, metrics: PrometheusMetrics, api_key: str | None, access_log: bool,
                 limits: ServerLimits, state: Any) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.access_log = access_log
        self.limits = limits
        self.state = state  # the app's state: .draining is set on SIGTERM

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path: str = scope["path"]
        status = 500
        started = False
        done = False
        disconnected = False
        body_done = scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE")
        body_read = 0
        limits = self.limits

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status, done, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        async def receive_wrapper() -> dict[str, Any]:
            nonlocal disconnected, body_done, body_read
            if body_done:
                message = await receive()
            else:
                # NOTE: only while the body is arriving; afterwards the server waits on receive()
                # for as long as a response streams, to see the client leave.
                try:
                    message = await asyncio.wait_for(receive(), limits.body_read_timeout)
                except asyncio.TimeoutError:
                    raise _Refused(408, f"the request body did not arrive within {limits.body_read_timeout:g} s",
                                   "body_timeout") from None
                if message["type"] == "http.request":
                    body_read += len(message.get("body", b""))
                    if body_read > limits.max_request_body_bytes:
                        raise _Refused(413, self._too_large(), "body_too_large")
                    body_done = not message.get("more_body", False)
            if message["type"] == "http.disconnect" and not done:
                disconnected = True
            return message

        async def refuse(status_code: int, err: APIError, headers: dict[str, str] | None = None) -> None:
            await JSONResponse(err.body(), status_code, headers=headers)(scope, receive, send_wrapper)

        try:
            if self.api_key and scope["method"] != "OPTIONS" and path.startswith(_PROTECTED_PREFIXES) \
                    and not self._authorized(scope):
                await refuse(401, APIError("Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                                           None, "invalid_api_key"), {"WWW-Authenticate": "Bearer"})
                return
            if getattr(self.state, "draining", False) and scope["method"] == "POST":
                self.metrics.record_rejection("draining")
                await refuse(503, APIError("the server is shutting down; send the request to another replica",
                                           503), {"Connection": "close", "Retry-After": "1"})
                return
            length = self._content_length(scope)
            if length is not None and length > limits.max_request_body_bytes:
                # Refused before reading a byte of it; the connection is closed (the body is not drained).
                self.metrics.record_rejection("body_too_large")
                await refuse(413, APIError(self._too_large(), 413), {"Connection": "close"})
                return
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except _Refused as e:  # raised where the app's handlers do not see it
                self.metrics.record_rejection(e.reason)
                if started:
                    raise
                await refuse(e.status_code, APIError(str(e.detail), e.status_code), e.headers)
        finally:
            seconds = time.perf_counter() - start
            handler = path if path in _KNOWN_PATHS else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                         else "other")
            self.metrics.record_http(scope["method"], handler, status, seconds)
            if self.access_log:
                client = scope.get("client")
                who = f"{client[0]}:{client[1]}" if client else "-"
                query = scope.get("query_string", b"").decode("latin-1")
                target = path + (f"?{query}" if query else "")
                access_logger.info('%s "%s %s HTTP/%s" %d %.3fs%s', who, scope["method"], target,
                                   scope.get("http_version", "1.1"), status, seconds,
                                   " (client disconnected)" if disconnected else "")

    def _authorized(self, scope) -> bool:
        # NOTE: compared as bytes: a header may carry any byte, and compare_digest refuses non-ASCII str.
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key)
        return False

    def _too_large(self) -> str:
        return (f"the request body is larger than this server's limit of {self.limits.max_request_body_bytes} bytes "
                "(--max-request-body-bytes)")

    @staticmethod
    def _content_length(scope) -> int | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                return int(value) if value.isdigit() else None
        return None


def _with_body_schemas(app: FastAPI, bodies: dict[str, type]) -> None:
    """/openapi.json with the request-body schema of each POST route in `bodies` (routes that read
    their body themselves have none otherwise)."""
    default = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming the bad field(s), and the first field as `param`."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            why = (err.get("ctx") or {}).get("error", "invalid JSON")
            return f"The request body is not valid JSON: {why}.", None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "missing" and not loc:
            msg = "the request body is missing (send a JSON object)"
        field = ".".join(loc)
        param = param or (field or None)
        parts.append(f"{field}: {msg}" if field else msg)
    return "Invalid request: " + "; ".join(parts), param


def _value_error_param(message: str) -> str | None:
    """SamplingParamsError messages start with the field name."""
    word = message.split(" ", 1)[0]
    return word if word in SamplingParams.__dataclass_fields__ else None  # type: ignore[attr-defined]


def build_app(
    engine: AsyncLLM,
    served_model_names: list[str],
    metrics: PrometheusMetrics,
    api_key: str | None = None,
    reasoning_parser: str | None = None,
    access_log: bool = True,
    allowed_origins: list[str] | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    limits: ServerLimits | None = None,
    request_timeout: float | None = None,
    allow_credentials: bool = False,
    allowed_methods: list[str] | None = None,
    allowed_headers: list[str] | None = None,
) -> FastAPI:
    """The FastAPI app over a running `AsyncLLM`; the engine is shut down with the app.

    CORS takes vLLM's flags; by default any origin may call it without credentials (no cookies or
    auth headers sent by a browser on the user's behalf), and a wildcard origin is never echoed
    back together with `access-control-allow-credentials`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="armserve", version=armserve.__version__, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    serving = OpenAIServing(engine, served_model_names, reasoning_parser, tool_call_parser, enable_auto_tool_choice,
                            request_timeout)
    app.state.serving = serving
    app.state.draining = False

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(e)
        return JSONResponse(APIError(msg, 400, param).body(), 400)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(_: Request, e: RequestFailedError) -> JSONResponse:
        # 503 engine dead, 429 overloaded (with Retry-After), 504 past the request's deadline
        headers = None
        if isinstance(e, EngineOverloadedError):
            metrics.record_rejection("overloaded")
            headers = {"Retry-After": str(e.retry_after)}
        return JSONResponse(APIError(str(e), e.status).body(), e.status, headers=headers)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError) -> JSONResponse:
        # Engine and sampling-parameter errors: the message names the problem.
        return JSONResponse(APIError(str(e), 400, _value_error_param(str(e))).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        if isinstance(e, _Refused):
            metrics.record_rejection(e.reason)
        return JSONResponse(APIError(str(e.detail), e.status_code).body(), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(APIError(f"internal server error: {type(e).__name__}: {e}", 500).body(), 500)

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return JSONResponse(APIError("the server is shutting down", 503).body(), 503)
        if not engine.is_running:
            why = "it is restarting" if engine.restarting else engine.dead_error
            return JSONResponse(APIError(f"the engine is not running: {why}", 503).body(), 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": armserve.__version__}

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "armserve",
                "root": engine.config.model, "parent": None, "max_model_len": engine.max_model_len}

    started = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in served_model_names]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        return model_card(serving.model_name(model))

    # NOTE: the routes parse their bodies themselves (serving.parse: large ones off the event
    # loop); _with_body_schemas puts each body's schema in /openapi.json all the same.
    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
              "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest}
    _with_body_schemas(app, bodies)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(await serving.parse(raw, ChatCompletionRequest), raw)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await serving.completion(await serving.parse(raw, CompletionRequest), raw)

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await serving.responses(await serving.parse(raw, ResponsesRequest), raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        body = await serving.parse(raw, TokenizeRequest)
        serving.model_name(body.model)

        def count(tok: Any) -> dict[str, Any]:  # (the whole prompt: /tokenize counts past max_model_len too)
            if body.messages is not None:
                add_gen = body.add_generation_prompt and not body.continue_final_message
                ids = serving.render_chat(body.messages, add_gen, body.continue_final_message, None,
                                          body.chat_template_kwargs, tokenizer=tok, limit=False)
            else:
                try:
                    ids = encode_text(tok, body.prompt, "prompt", body.add_special_tokens)
                except PromptError as e:
                    raise APIError(str(e), 400, "prompt") from None
            return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

        return await serving.prepare(raw, count)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.model_name(body.model)
        vocab = len(engine.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is out of range for the vocabulary size {vocab}", 400, "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(ServerMiddleware, metrics=metrics, api_key=api_key, access_log=access_log,
                       limits=limits or ServerLimits(), state=app.state)
    # Outermost, so browser preflight requests are answered before the API-key check.
    # NOTE: Starlette echoes the caller's Origin when credentials are allowed with "*"; a browser
    # would then send cookies to any site's script. So "*" with credentials is refused at start-up.
    origins = allowed_origins or ["*"]
    if allow_credentials and "*" in origins:
        raise ValueError("--allow-credentials needs explicit --allowed-origins: with '*' any web page could "
                         "call this server with its visitors' credentials")
    app.add_middleware(CORSMiddleware, allow_origins=origins, allow_credentials=allow_credentials,
                       allow_methods=allowed_methods or ["*"], allow_headers=allowed_headers or ["*"])
    return app


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


def run_server(args: argparse.Namespace) -> int:
    """`armserve serve`: load the model, then serve until SIGTERM (drained) or SIGINT; exits 1
    if the engine dies."""
    import uvicorn

    from armserve.engine_args import engine_kwargs
    from armserve.config import EngineConfig
    from armserve.entrypoints.reasoning import ReasoningParser
    from armserve.entrypoints.tool_parsers import get_tool_parser
    from armserve.model_loader import bundled_model_path

    if args.reasoning_parser:
        ReasoningParser(args.reasoning_parser)  # unknown name: fail before loading anything
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)  # likewise
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    api_key = args.api_key or os.environ.get("ARMSERVE_API_KEY") or None
    sock = _bind(args.host, args.port)
    model = args.model or bundled_model_path()
    names = args.served_model_name or [default_served_name(args.model, model)]
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
                        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers)
        # NOTE: uvicorn's own graceful timeout only bounds the connections still open after the drain
        # (ArmServer.drain) has ended every request.
        config = uvicorn.Config(app, log_config=None, access_log=False, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5, timeout_graceful_shutdown=5,
                                http=http_protocol(limits.header_read_timeout))
        shown_host = f"[{args.host}]" if ":" in args.host else args.host
        logger.info("serving %s as %s on http://%s:%d (API key %s)", model, ", ".join(names), shown_host,
                    args.port, "required" if api_key else "off")
        code = ArmServer(config, app, engine, args.shutdown_timeout).run(sock)
    finally:
        engine.shutdown()
        sock.close()
    return code
