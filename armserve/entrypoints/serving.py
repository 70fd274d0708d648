"""The serving base every endpoint (serving_chat.py, serving_completion.py, serving_responses.py)
shares: request parsing, model names, chat rendering, the engine request (the engine's input
processor, its refusals as 400s before any byte is sent), tool setup, and the response helpers
(SSE, usage, reading a stream to its end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Sequence, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from fastapi.responses import Response, StreamingResponse

from armserve.prompts import PromptError, PromptTooLongError, render_chat
from armserve.engine.async_llm import AsyncLLM, RequestStream
from armserve.engine.exceptions import EngineDeadError
from armserve.memory import release_free_heap
from armserve.model_source import generation_defaults
from armserve.engine.input_processor import ContextLengthError, EngineCoreRequest, LogprobsLimitError, PromptTokensError
from armserve.entrypoints.serving_models import ServingModels
from armserve.entrypoints.protocol import APIError, ChatCompletionRequest, ChatMessage
from armserve.entrypoints.reasoning import ReasoningParser
from armserve.entrypoints.tool_parsers import ToolCall, ToolCallStream, get_tool_parser
from armserve.outputs import CompletionOutput, Logprob, RequestOutput
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")

# JSON has no -inf; a token the model rules out gets this instead (as vLLM does).
_MIN_LOGPROB = -9999.0

# --enable-log-requests: a request's parameters are cut to this many characters in its log line (a
# structured-output schema may be megabytes).
LOGGED_PARAMS_CHARS = 2000

# Request bodies at least this large are templated and tokenized on a worker thread, so that the
# event loop keeps answering /health and streaming everyone else's tokens meanwhile (a 2 MB
# prompt takes ~2 s to tokenize); smaller ones stay inline, where a thread hop costs more than it saves.
OFF_LOOP_BODY_BYTES = 32 * 1024

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


def shares_tokenizer(tokenizer: Any, generates: bool) -> bool:
    """Whether the large-body worker thread may encode with the event loop's own `tokenizer`: only a
    transformers fast tokenizer whose Rust state no call changes. Its truncation, padding and
    special-token splitting are state that transformers sets before an encode when they differ from
    the call's (a setter needs the Rust object to itself and raises "Already borrowed" while another
    thread encodes, and its setting would apply to that thread's text): a generating model's prompts
    are encoded without truncation or padding and with the tokenizer's own splitting, set here once
    for all, while a pooling model truncates its inputs (`generates` False), so its worker keeps a
    copy of its own."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not generates or backend is None:
        return False
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    split = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split:
        backend.encode_special_tokens = split
    return True


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def finite(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def decode_json(data: bytes) -> Any:
    """A request body's JSON. A large one is parsed with Python-level hooks for its objects and
    integers: the parse then runs bytecode every few values, where the interpreter lets other
    threads in (the event loop's). json.loads alone holds the interpreter lock throughout: ~100 ms
    for a 10 MB body of 300k messages, during which /health could not answer (with the hooks ~20)."""
    if len(data) < OFF_LOOP_BODY_BYTES:
        return json.loads(data)
    return json.loads(data, object_pairs_hook=_json_object, parse_int=_json_int)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's own object (the last of duplicate keys wins), made in Python: see decode_json."""
    return dict(pairs)


def _json_int(text: str) -> int:
    """json's own integer (ValueError past 4300 digits), made in Python: see decode_json."""
    return int(text)


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that closes its engine streams however the response ends (the body
    generators leave that to it).

    NOTE: if the client disconnects before the body generator even starts, the generator's
    own `finally` would never run; closing here still aborts the requests and frees their blocks.
    """

    def __init__(self, content: AsyncIterator[str], streams: Sequence[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.close()


async def run_unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler, cancelling it (and so aborting its engine requests) if the
    client disconnects first."""
    task = asyncio.ensure_future(work)

    async def client_gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(client_gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return Response(status_code=499)  # nobody reads it; the access log shows the disconnect


class OpenAIServing:
    """What every endpoint shares: one per server, handed to each endpoint (serving_chat.py and
    the others), so that all of them use one tokenizing worker."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 request_timeout: float | None = None, log_requests: bool = False,
                 lora_modules: list[tuple[str, str, str | None]] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
        # the base's names and the LoRA adapters' (--lora-modules, /v1/load_lora_adapter)
        self.models = ServingModels(engine, served_model_names, lora_modules)
        self.reasoning_parser = reasoning_parser
        if reasoning_parser is not None:
            ReasoningParser(reasoning_parser)  # fail at startup on an unknown name
        self.tool_call_parser = tool_call_parser
        if tool_call_parser is not None:
            get_tool_parser(tool_call_parser)  # likewise
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        # Seconds a request may take from arrival to its last token (None: no deadline).
        self.request_timeout = request_timeout
        self.log_requests = log_requests
        # Defaults of the sampling fields a request leaves out (--generation-config), checked now so
        # that a bad generation_config.json fails the start, not every request.
        self.default_sampling: dict[str, Any] = generation_defaults(engine.config.model,
                                                                                engine.config.generation_config)
        if self.default_sampling:
            SamplingParams(**self.default_sampling)
            logger.info("default sampling parameters from the model's generation config: %s (--generation-config "
                        "vllm to ignore them)", self.default_sampling)
        self._prep_pool = ThreadPoolExecutor(1, thread_name_prefix="armserve-tokenize")
        self._prep_tokenizer: Any = None
        if shares_tokenizer(self.tokenizer, engine.input_processor.pooler is None):
            # NOTE: one tokenizer for the loop and the worker (~40 MiB less than a copy each): the
            # Rust tokenizer encodes with the GIL released (transformers calls its encode_batch), and
            # two threads may encode at once, so a small request is tokenized on the loop while a
            # large one is on the worker (tests/test_server_units.py shows it).
            self._prep_tokenizer = self.tokenizer
            self._prep_ready = self._prep_pool.submit(lambda: None)
        else:
            # The worker's own copy, unpickled off the event loop (seconds for a 150k vocabulary,
            # holding the GIL): a deep copy here left ~70 MiB of copying scratch in the heap.
            self._prep_ready = self._prep_pool.submit(self._worker_tokenizer, pickle.dumps(self.tokenizer))

    async def parse(self, raw: Request, model: type[_M]) -> _M:
        """The request body as `model`: JSON parsing and validation, on the worker thread when the
        body is large (validating a 10 MB body of 300k messages held the event loop for 0.9 s).
        Errors are FastAPI's RequestValidationError, as for a typed body parameter."""
        data = await raw.body()

        def parse_body(_: Any = None) -> _M:
            if not data.strip():
                raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
            try:
                obj = decode_json(data)
            except ValueError as e:
                raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                               "ctx": {"error": getattr(e, "msg", str(e))}}]) from None
            if len(data) >= OFF_LOOP_BODY_BYTES and isinstance(obj, dict):
                self._refuse_what_cannot_fit(obj)
            try:
                return model.model_validate(obj)
            except ValidationError as e:
                raise RequestValidationError(
                    [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors(include_input=False)]) from None

        if len(data) < OFF_LOOP_BODY_BYTES:
            return parse_body()
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, parse_body)

    def _refuse_what_cannot_fit(self, obj: dict[str, Any]) -> None:
        """A 400 before validating a large body whose messages or token-id prompt cannot fit
        max_model_len however they tokenize (every message renders to at least one token).
        NOTE: validating 300k messages (a 10 MB body) holds the interpreter lock for ~0.8 s, on
        whatever thread: the event loop would stop for that long."""
        limit = self.engine.max_model_len
        messages = obj.get("messages")
        if isinstance(messages, list) and len(messages) > limit:
            raise self.context_error(f"the conversation has {len(messages)} messages, each at least one token. "
                                     "Shorten the conversation.", "messages")
        prompt = obj.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
        for p in prompts:
            if isinstance(p, list) and len(p) > limit:
                raise self.context_error(f"the prompt has {len(p)} tokens. Shorten the prompt.", "prompt")

    async def prepare(self, raw: Request | None, fn: Callable[[Any], _T]) -> _T:
        """`fn(tokenizer)` (templating and tokenizing), on a worker thread when the request body is
        large or of unknown size."""
        size = raw.headers.get("content-length") if raw is not None else None
        if size is not None and size.isdigit() and int(size) < OFF_LOOP_BODY_BYTES:
            return fn(self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, self._on_worker, fn)

    def _on_worker(self, fn: Callable[[Any], _T]) -> _T:
        self._prep_ready.result()  # (done: the pool's one thread ran it first; raises if it failed)
        return fn(self._prep_tokenizer)

    def _worker_tokenizer(self, pickled: bytes) -> None:
        """Make the worker's tokenizer (on the worker thread, the only one that touches it)."""
        self._prep_tokenizer = pickle.loads(pickled)
        release_free_heap()  # what pickling and unpickling it left behind

    def context_error(self, but: str, param: str) -> APIError:
        """The 400 of a request that cannot fit max_model_len; `but` says why, then what to do."""
        return APIError(f"This model's maximum context length is {self.engine.max_model_len} tokens, but {but}",
                        400, param, "context_length_exceeded")

    @contextmanager
    def prompt_errors(self, param: str) -> Iterator[None]:
        """A PromptError inside as a 400 naming `param` (context_length_exceeded if too long)."""
        try:
            yield
        except PromptTooLongError as e:
            raise self.context_error(f"the prompt has at least {e.num_tokens} tokens. Shorten the prompt.",
                                     param) from None
        except PromptError as e:
            raise APIError(str(e), 400, param) from None

    def process(self, request_id: str, ids: list[int], params: SamplingParams, prompt_param: str,
                max_param: str = "max_tokens", text: str | None = None,
                logprobs_param: str = "logprobs") -> EngineCoreRequest:
        """The engine request of a prompt's token ids (engine/input_processor.py); a 400 naming
        `prompt_param` (or `max_param`, or `logprobs_param` past --max-logprobs) when the prompt
        cannot be served as asked."""
        try:
            return self.engine.input_processor.process(request_id, {"prompt": text, "prompt_token_ids": ids}, params)
        except ContextLengthError as e:
            n, max_tokens = e.num_prompt_tokens, e.max_tokens
            if max_tokens is None:
                raise self.context_error(f"the prompt has {n} tokens, which leaves no room to generate. "
                                         "Shorten the prompt.", prompt_param) from None
            raise self.context_error(f"{n + max_tokens} were requested ({n} in the prompt, {max_tokens} for the "
                                     f"completion). Lower {max_param} or shorten the prompt.", max_param) from None
        except PromptTokensError as e:
            raise APIError(str(e), 400, prompt_param) from None
        except LogprobsLimitError as e:
            field = logprobs_param if e.field == "logprobs" else e.field
            raise APIError(e.message(field, e.asked, e.limit), 400, field) from None

    async def submit(self, request: EngineCoreRequest, model: str | None = None) -> RequestStream:
        """`engine.add_processed_request` with the server's deadline; `model`: the request's, which
        may name a LoRA adapter to run with."""
        request.lora_request = self.models.lora_request(model)
        if self.log_requests:
            # A pooling request's SamplingParams are a placeholder: show what it really asks for.
            shown = repr(request.params if request.pooling is None else request.pooling)
            if len(shown) > LOGGED_PARAMS_CHARS:
                shown = shown[:LOGGED_PARAMS_CHARS] + f"... ({len(shown)} characters)"
            logger.info("Received request %s: %d prompt tokens, params: %s", request.request_id,
                        len(request.prompt_token_ids), shown)
        return await self.engine.add_processed_request(request, deadline=self.request_timeout)

    # ---- shared checks -------------------------------------------------------------------

    @property
    def task(self) -> str:
        """What this server's model does: "generate", "embed" or "classify" (a cross-encoder)."""
        pooler = self.engine.input_processor.pooler
        return "generate" if pooler is None else pooler.task

    def check_task(self, endpoint: str, *tasks: str) -> None:
        """A 400 (code `model_not_supported`) when this server's model does none of `tasks`: text
        endpoints on a pooling model, embeddings on a generating model or a cross-encoder, ..."""
        task = self.task
        if task in tasks:
            return
        what = {"generate": "generates text", "embed": "is an embedding model",
                "classify": "is a cross-encoder (classification) model"}[task]
        use = {"generate": "/v1/chat/completions, /v1/completions", "embed": "/v1/embeddings, /pooling, /score",
               "classify": "/score, /rerank, /pooling"}[task]
        need = {"generate": "a text-generation model", "embed": "an embedding model",
                "classify": "a cross-encoder"}
        raise APIError(f"{endpoint} needs {' or '.join(need[t] for t in tasks)}; the model "
                       f"'{self.served_model_names[0]}' {what}: use {use}.", 400, "model", "model_not_supported")

    def check_token_ids(self, ids: list[int], what: str, param: str) -> None:
        """A 400 naming the first id outside the vocabulary; `what` names the ids in the message."""
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{what} {bad[0]} is out of range for the vocabulary size {vocab}", 400, param)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with (the base's or an adapter's); 404 for a model this server does not serve."""
        return self.models.model_name(requested)

    def render_chat(
        self,
        messages: list[ChatMessage] | list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tokenizer: Any = None,
        limit: bool = True,
    ) -> list[int]:
        """Token ids of a conversation rendered with the chat template (armserve/prompts.py); a 400
        naming the message on bad input, or past max_model_len tokens when `limit`. `tokenizer`:
        another copy of the model's (a worker's)."""
        tokenizer = tokenizer or self.tokenizer
        if not (chat_template or tokenizer.chat_template):
            raise APIError("this model has no chat template; start the server with --chat-template "
                           "or use /v1/completions", 400, "messages")
        convo = [m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else m for m in messages]
        with self.prompt_errors("messages"):
            return render_chat(tokenizer, convo, tools=tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs,
                               max_tokens=self.engine.max_model_len if limit else None)

    def tool_setup(self, body: ChatCompletionRequest, params: SamplingParams) -> tuple[str, list[dict[str, Any]] | None]:
        """A chat request's tool mode (tool_mode) and its tools as the template takes them."""
        mode = self.tool_mode(body.effective_tool_choice, bool(body.tools))
        if mode == "auto":
            # NOTE: the parser needs the call markers, which some tokenizers (Qwen's from GGUF) count
            # as special tokens and would drop from the text (vLLM's parsers do the same).
            params.skip_special_tokens = False
        return mode, [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None

    async def submit_chat(self, body: ChatCompletionRequest, raw: Request, rid: str, prompt_param: str,
                          max_param: str, logprobs_param: str = "logprobs",
                          ) -> tuple[SamplingParams, RequestStream, int, tuple[str, str | None]]:
        """A chat request (with the server's default sampling) rendered, checked and sent to the
        engine: its sampling parameters, its stream, its prompt's length and its tool mode
        (tool_mode) with the forced function's name."""
        params = body.to_sampling_params(self.default_sampling)
        mode, tools = self.tool_setup(body, params)
        request = await self.prepare(raw, lambda tok: self.process(rid, self.render_chat(
            body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template,
            body.chat_template_kwargs, tools, tok), params, prompt_param, max_param, logprobs_param=logprobs_param))
        stream = await self.submit(request, body.model)
        return params, stream, len(request.prompt_token_ids), (mode, body.forced_function)

    def tool_mode(self, tool_choice: str | dict[str, Any], has_tools: bool, param: str = "tool_choice") -> str:
        """How tool calls come out: "named" / "required" (forced by the grammar), "auto" (parsed
        from free text), or "none"."""
        if not has_tools or tool_choice == "none":
            return "none"
        if isinstance(tool_choice, dict):
            return "named"
        if tool_choice == "required":
            return "required"
        if not self.enable_auto_tool_choice or self.tool_call_parser is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                           400, param)
        return "auto"

    def tool_stream(self, mode: str, forced_name: str | None) -> ToolCallStream | None:
        if mode == "none":
            return None
        parser = get_tool_parser(self.tool_call_parser) if mode == "auto" else None  # type: ignore[arg-type]
        return ToolCallStream(mode, parser, forced_name)

    def parse_output(self, text: str, tool: tuple[str, str | None]) -> tuple[str | None, str | None, list[ToolCall]]:
        """A whole completion's text as (reasoning, content, tool calls); `tool`: (mode, forced name)."""
        reasoning, content = None, text
        if self.reasoning_parser:
            reasoning, content = ReasoningParser(self.reasoning_parser).parse(text)
        calls: list[ToolCall] = []
        ts = self.tool_stream(*tool)
        if ts is not None:
            content, calls = ts.extract(content or "")
        return reasoning, content, calls

    def token_text(self, token_id: int, lp: Logprob | None) -> str:
        """A logprob's token as text (the engine's decoding when it sent one)."""
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])


async def collect(stream: RequestStream, n: int) -> tuple[list[CompletionOutput], RequestOutput]:
    """Read a stream to the end: each completion whole; raises EngineDeadError if the engine stopped meanwhile."""
    choices = [CompletionOutput(i, "", [], None, None) for i in range(n)]
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
            for c in out.outputs:
                ch = choices[c.index]
                ch.text += c.text
                ch.token_ids.extend(c.token_ids)
                if c.logprobs is not None:
                    ch.logprobs = (ch.logprobs or []) + list(c.logprobs)
                if c.finish_reason is not None:
                    ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
    finally:
        stream.close()
    if last is None or any(c.finish_reason == "abort" for c in choices):
        raise EngineDeadError("the request was aborted (is the server shutting down?)")
    return choices, last
