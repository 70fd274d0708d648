"""The OpenAI-compatible FastAPI app (`build_app`): error handlers and routes.

Routes: /v1/chat/completions, /v1/completions, /v1/responses (and GET / DELETE /v1/responses/{id}),
/v1/messages and /v1/messages/count_tokens (Anthropic's API; their errors in its shape), /v1/embeddings,
/pooling, /score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /v1/models, /health, /ping, /load, /version,
/tokenize, /detokenize, /metrics. Each endpoint's logic lives in its serving_*.py; what happens before a route
(API key, body limits, drain) in middleware.py; the server process (`armserve serve`) in server_process.py.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import armserve
from armserve.prompts import encode_text
from armserve.engine.async_llm import AsyncLLM
from armserve.engine.exceptions import EngineOverloadedError, RequestFailedError
from armserve.entrypoints.anthropic_protocol import CountTokensRequest, MessagesRequest, error_body
from armserve.entrypoints.metrics import CONTENT_TYPE_LATEST, PrometheusMetrics
from armserve.entrypoints.middleware import BodyRefused, ServerLimits, ServerMiddleware
from armserve.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from armserve.entrypoints.response_store import ResponseStore
from armserve.entrypoints.serving import OpenAIServing
from armserve.entrypoints.serving_chat import OpenAIServingChat
from armserve.entrypoints.serving_completion import OpenAIServingCompletion
from armserve.entrypoints.serving_embedding import OpenAIServingEmbedding
from armserve.entrypoints.serving_score import OpenAIServingScore
from armserve.entrypoints.serving_messages import AnthropicServingMessages
from armserve.entrypoints.serving_models import runtime_lora_updating
from armserve.entrypoints.serving_responses import OpenAIServingResponses
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")


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


async def _json_body(raw: Request) -> Any:
    try:
        return json.loads(await raw.body())
    except ValueError:
        raise APIError("the body is not valid JSON", 400) from None


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
    root_path: str = "",
    log_requests: bool = False,
    responses_store: str | None = None,
    lora_modules: list[tuple[str, str, str | None]] | None = None,
) -> FastAPI:
    """The FastAPI app over a running `AsyncLLM`; the engine is shut down with the app.

    CORS takes vLLM's flags; by default any origin may call it without credentials (no cookies or
    auth headers sent by a browser on the user's behalf), and a wildcard origin is never echoed
    back together with `access-control-allow-credentials`. `root_path`: the path prefix of a proxy in
    front (vLLM's --root-path); `log_requests`: one log line per engine request (--enable-log-requests).
    Stored Responses live in memory, or in the SQLite file `responses_store`. `lora_modules`: the
    (name, path, base model name) of each LoRA adapter served by name (entrypoints/serving_models.py)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await serving.models.check_adapters()  # a bad --lora-modules folder fails the start, named
        yield
        engine.shutdown()
        store.close()

    app = FastAPI(title="armserve", version=armserve.__version__, lifespan=lifespan,
                  docs_url="/docs", redoc_url=None, root_path=root_path)
    serving = OpenAIServing(engine, served_model_names, reasoning_parser, tool_call_parser, enable_auto_tool_choice,
                            request_timeout, log_requests, lora_modules)
    app.state.serving = serving
    chat_serving = OpenAIServingChat(serving)
    completion_serving = OpenAIServingCompletion(serving)
    store = ResponseStore(responses_store)
    responses_serving = OpenAIServingResponses(serving, store)
    messages_serving = AnthropicServingMessages(serving)
    embedding_serving = OpenAIServingEmbedding(serving)
    score_serving = OpenAIServingScore(serving)
    app.state.draining = False
    app.state.server_load = 0  # generation requests in flight (the middleware counts them)

    @app.exception_handler(APIError)
    async def _api_error(req: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(req.url.path, e), e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(req: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(e)
        return JSONResponse(error_body(req.url.path, APIError(msg, 400, param)), 400)

    @app.exception_handler(RequestFailedError)
    async def _request_failed(req: Request, e: RequestFailedError) -> JSONResponse:
        # 503 engine dead, 429 overloaded (with Retry-After), 504 past the request's deadline
        headers = None
        if isinstance(e, EngineOverloadedError):
            metrics.record_rejection("overloaded")
            headers = {"Retry-After": str(e.retry_after)}
        return JSONResponse(error_body(req.url.path, APIError(str(e), e.status)), e.status, headers=headers)

    @app.exception_handler(ValueError)
    async def _value_error(req: Request, e: ValueError) -> JSONResponse:
        # Engine and sampling-parameter errors: the message names the problem.
        return JSONResponse(error_body(req.url.path, APIError(str(e), 400, _value_error_param(str(e)))), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, e: StarletteHTTPException) -> JSONResponse:
        if isinstance(e, BodyRefused):
            metrics.record_rejection(e.reason)
        return JSONResponse(error_body(req.url.path, APIError(str(e.detail), e.status_code)), e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal_error(req: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return JSONResponse(error_body(req.url.path, APIError(f"internal server error: {type(e).__name__}: {e}", 500)),
                            500)

    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return JSONResponse(APIError("the server is shutting down", 503).body(), 503)
        if not engine.is_running:
            why = "it is restarting" if engine.restarting else engine.dead_error
            return JSONResponse(APIError(f"the engine is not running: {why}", 503).body(), 503)
        return Response(status_code=200)

    # SageMaker's health check (vLLM's /ping): /health's answer, to GET and POST.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/load")
    async def load() -> dict[str, int]:
        """vLLM's server load: generation requests (/v1/... POSTs) being answered now, streams included."""
        return {"server_load": app.state.server_load}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": armserve.__version__}

    started = int(time.time())

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": serving.models.cards(started)}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        return serving.models.card(model, started)

    if runtime_lora_updating():  # vLLM's: the routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request) -> Response:
            return PlainTextResponse(await serving.models.load(await _json_body(raw)))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request) -> Response:
            return PlainTextResponse(await serving.models.unload(await _json_body(raw)))

    # NOTE: the routes parse their bodies themselves (serving.parse: large ones off the event
    # loop); _with_body_schemas puts each body's schema in /openapi.json all the same.
    bodies = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
              "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
              "/v1/messages/count_tokens": CountTokensRequest, "/tokenize": TokenizeRequest,
              "/v1/embeddings": EmbeddingRequest, "/pooling": EmbeddingRequest, "/score": ScoreRequest,
              "/v1/score": ScoreRequest, "/rerank": RerankRequest, "/v1/rerank": RerankRequest,
              "/v2/rerank": RerankRequest}
    _with_body_schemas(app, bodies)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        serving.check_task("/v1/chat/completions", "generate")
        return await chat_serving.create_chat_completion(await serving.parse(raw, ChatCompletionRequest), raw)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        serving.check_task("/v1/completions", "generate")
        return await completion_serving.create_completion(await serving.parse(raw, CompletionRequest), raw)

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        serving.check_task("/v1/responses", "generate")
        return await responses_serving.create_response(await serving.parse(raw, ResponsesRequest), raw)

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request) -> dict[str, Any]:
        serving.check_task("/v1/embeddings", "embed")
        return await embedding_serving.create_embedding(await serving.parse(raw, EmbeddingRequest), raw)

    @app.post("/pooling")
    async def pooling(raw: Request) -> dict[str, Any]:
        serving.check_task("/pooling", "embed", "classify")
        return await embedding_serving.create_embedding(await serving.parse(raw, EmbeddingRequest), raw, pooling=True)

    @app.post("/score")
    @app.post("/v1/score")
    async def score(raw: Request) -> dict[str, Any]:
        serving.check_task(raw.url.path, "embed", "classify")
        return await score_serving.create_score(await serving.parse(raw, ScoreRequest), raw)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(raw: Request) -> dict[str, Any]:
        serving.check_task(raw.url.path, "embed", "classify")
        return await score_serving.create_rerank(await serving.parse(raw, RerankRequest), raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return await responses_serving.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await responses_serving.delete(response_id)

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        serving.check_task("/v1/messages", "generate")
        return await messages_serving.create_message(await serving.parse(raw, MessagesRequest), raw)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(raw: Request) -> dict[str, int]:
        return await messages_serving.count_tokens(await serving.parse(raw, CountTokensRequest), raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        body = await serving.parse(raw, TokenizeRequest)
        serving.model_name(body.model)

        def count(tok: Any) -> dict[str, Any]:  # (the whole prompt: /tokenize counts past max_model_len too)
            if body.messages is not None:
                add_gen = body.add_generation_prompt and not body.continue_final_message
                # (the tools as a chat request hands them to the template: serving.tool_setup)
                tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
                ids = serving.render_chat(body.messages, add_gen, body.continue_final_message, None,
                                          body.chat_template_kwargs, tools, tokenizer=tok, limit=False)
            else:
                with serving.prompt_errors("prompt"):
                    ids = encode_text(tok, body.prompt, "prompt", body.add_special_tokens)
            return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

        return await serving.prepare(raw, count)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving.model_name(body.model)
        serving.check_token_ids(body.tokens, "token id", "tokens")
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
