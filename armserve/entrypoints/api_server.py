"""The OpenAI-compatible HTTP server (`armserve serve`): FastAPI app, middleware, routes, runner.

Routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, /version, /tokenize,
/detokenize, /metrics. The chat and completion logic lives in `serving.py`.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import armserve
from armserve.prompts import PromptError, encode_text
from armserve.engine.async_llm import AsyncLLM, EngineDeadError
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


class ServerMiddleware:
    """API-key check, one access-log line per request and HTTP metrics.

    A plain ASGI middleware (not BaseHTTPMiddleware) so streamed responses pass through
    untouched and the line is written when the stream really ends.
    """

    def __init__(self, app, metrics: PrometheusMetrics, api_key: str | None, access_log: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.access_log = access_log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path: str = scope["path"]
        status = 500
        done = False
        disconnected = False

        async def send_wrapper(message: dict[str, Any]) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        async def receive_wrapper() -> dict[str, Any]:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not done:
                disconnected = True
            return message

        try:
            if self.api_key and scope["method"] != "OPTIONS" and path.startswith(_PROTECTED_PREFIXES) \
                    and not self._authorized(scope):
                err = APIError("Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                               None, "invalid_api_key")
                await JSONResponse(err.body(), 401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send_wrapper)
                return
            await self.app(scope, receive_wrapper, send_wrapper)
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
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(token.strip(), self.api_key)
        return False


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
) -> FastAPI:
    """The FastAPI app over a running `AsyncLLM`; the engine is shut down with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="armserve", version=armserve.__version__, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None)
    serving = OpenAIServing(engine, served_model_names, reasoning_parser, tool_call_parser, enable_auto_tool_choice)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(e)
        return JSONResponse(APIError(msg, 400, param).body(), 400)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> JSONResponse:
        return JSONResponse(APIError(str(e), 503).body(), 503)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, e: ValueError) -> JSONResponse:
        # Engine and sampling-parameter errors: the message names the problem.
        return JSONResponse(APIError(str(e), 400, _value_error_param(str(e))).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(str(e.detail), e.status_code).body(), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(APIError(f"internal server error: {type(e).__name__}: {e}", 500).body(), 500)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(APIError(f"the engine is not running: {engine.dead_error}", 503).body(), 503)
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

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completion(body, raw)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request) -> Response:
        return await serving.responses(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.model_name(body.model)
        tok = engine.tokenizer
        if body.messages is not None:
            add_gen = body.add_generation_prompt and not body.continue_final_message
            ids = serving.render_chat(body.messages, add_gen, body.continue_final_message, None,
                                      body.chat_template_kwargs)
        else:
            try:
                ids = encode_text(tok, body.prompt, "prompt", body.add_special_tokens)
            except PromptError as e:
                raise APIError(str(e), 400, "prompt") from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

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

    app.add_middleware(ServerMiddleware, metrics=metrics, api_key=api_key, access_log=access_log)
    # Outermost, so browser preflight requests are answered before the API-key check.
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"], allow_credentials=True,
                       allow_methods=["*"], allow_headers=["*"])
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


def run_server(args: argparse.Namespace) -> int:
    """`armserve serve`: load the model, then serve until SIGINT/SIGTERM."""
    import uvicorn

    from armserve.cli import engine_kwargs
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
    metrics = PrometheusMetrics(names[0], args.data_parallel_size)
    engine = AsyncLLM(EngineConfig(model=model, served_model_name=names[0],
                                   data_parallel_size=args.data_parallel_size, **engine_kwargs(args)),
                      log_stats=not args.disable_log_stats, stat_loggers=[metrics])
    app = build_app(engine, names, metrics, api_key, args.reasoning_parser,
                    access_log=not args.disable_access_log, allowed_origins=args.allowed_origins,
                    tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice)
    config = uvicorn.Config(app, log_config=None, access_log=False, log_level=args.uvicorn_log_level,
                            timeout_keep_alive=5, timeout_graceful_shutdown=5)
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    logger.info("serving %s as %s on http://%s:%d (API key %s)", model, ", ".join(names), shown_host,
                args.port, "required" if api_key else "off")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
    return 0
