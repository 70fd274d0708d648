"""The HTTP layer in front of the routes: how much of a request the server reads and for how long
(ServerLimits, the header timeout in uvicorn's protocol, the body limits), the API key, refusal
while draining, one access-log line per request, and the HTTP metrics.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from armserve.entrypoints.anthropic_protocol import error_body
from armserve.entrypoints.metrics import PrometheusMetrics
from armserve.entrypoints.protocol import APIError

logger = logging.getLogger("armserve")
access_logger = logging.getLogger("armserve.access")

# Routes that need the API key when one is set. /health, /version and /metrics stay open so
# load balancers and Prometheus need no secret (as in vLLM).
_PROTECTED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/pooling", "/score", "/rerank")
_KNOWN_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
                "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                "/v1/models", "/health", "/version", "/tokenize", "/detokenize", "/metrics", "/ping", "/load",
                "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
LOGGED_TARGET_CHARS = 2048  # of a request's path and query in its access-log line


def route_path(scope) -> str:
    """The path the routes see: behind a proxy prefix (--root-path), a path under it loses it, as
    Starlette's router strips it; so the API-key check and the metrics see the same route."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


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


class BodyRefused(StarletteHTTPException):
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
        path = route_path(scope)
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
                    raise BodyRefused(408, f"the request body did not arrive within {limits.body_read_timeout:g} s",
                                      "body_timeout") from None
                if message["type"] == "http.request":
                    body_read += len(message.get("body", b""))
                    if body_read > limits.max_request_body_bytes:
                        raise BodyRefused(413, self._too_large(), "body_too_large")
                    body_done = not message.get("more_body", False)
            if message["type"] == "http.disconnect" and not done:
                disconnected = True
            return message

        async def refuse(status_code: int, err: APIError, headers: dict[str, str] | None = None) -> None:
            await JSONResponse(error_body(path, err), status_code, headers=headers)(scope, receive, send_wrapper)

        try:
            if self.api_key and scope["method"] != "OPTIONS" and path.startswith(_PROTECTED_PREFIXES) \
                    and not self._authorized(scope):
                await refuse(401, APIError("Invalid or missing API key: send 'Authorization: Bearer <key>' (or "
                                           "'x-api-key: <key>', as Anthropic's clients do).", 401,
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
            # Server load (GET /load, vLLM's): generation requests in flight, until their stream ends.
            counted = scope["method"] == "POST" and path.startswith("/v1/")
            if counted:
                self.state.server_load = getattr(self.state, "server_load", 0) + 1
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except BodyRefused as e:  # raised where the app's handlers do not see it
                self.metrics.record_rejection(e.reason)
                if started:
                    raise
                await refuse(e.status_code, APIError(str(e.detail), e.status_code), e.headers)
            finally:
                if counted:
                    self.state.server_load -= 1
        finally:
            seconds = time.perf_counter() - start
            handler = path if path in _KNOWN_PATHS else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                         else "/v1/responses/{id}" if path.startswith("/v1/responses/")
                                                         else "other")
            self.metrics.record_http(scope["method"], handler, status, seconds)
            if self.access_log:
                client = scope.get("client")
                who = f"{client[0]}:{client[1]}" if client else "-"
                query = scope.get("query_string", b"").decode("latin-1")
                target = scope["path"] + (f"?{query}" if query else "")
                if len(target) > LOGGED_TARGET_CHARS:  # (the HTTP parser takes URLs of up to ~64 KB)
                    target = target[:LOGGED_TARGET_CHARS] + f"...({len(target)} characters)"
                access_logger.info('%s "%s %s HTTP/%s" %d %.3fs%s', who, scope["method"], target,
                                   scope.get("http_version", "1.1"), status, seconds,
                                   " (client disconnected)" if disconnected else "")

    def _authorized(self, scope) -> bool:
        # NOTE: compared as bytes: a header may carry any byte, and compare_digest refuses non-ASCII str.
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.api_key):
                    return True
            elif name == b"x-api-key" and secrets.compare_digest(value.strip(), self.api_key):  # Anthropic's header
                return True
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

