"""Chat and text completions: request -> prompt token ids -> engine stream -> OpenAI JSON / SSE.

One request's path: validate the body (pydantic) -> `SamplingParams` -> prompt token ids
(chat template or tokenizer) -> length check -> `AsyncLLM.add_request` (engine errors become
400s before any byte is sent) -> either collect the deltas into one response or stream them
as SSE chunks ending in `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from armserve.prompts import PromptError, PromptTooLongError, encode_text, render_chat
from armserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from armserve.entrypoints.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ResponsesRequest,
)
from armserve.entrypoints.reasoning import ReasoningParser
from armserve.entrypoints.tool_parsers import ToolCall, ToolParser, get_tool_parser
from armserve.outputs import Logprob, PositionLogprobs, RequestOutput
from armserve.sampling_params import SamplingParams

logger = logging.getLogger("armserve")

# JSON has no -inf; a token the model rules out gets this instead (as vLLM does).
_MIN_LOGPROB = -9999.0

# Request bodies at least this large are templated and tokenized on a worker thread, so that the
# event loop keeps answering /health and streaming everyone else's tokens meanwhile (a 2 MB
# prompt takes ~2 s to tokenize); smaller ones stay inline, where a thread hop costs more than it saves.
OFF_LOOP_BODY_BYTES = 32 * 1024

_T = TypeVar("_T")
_M = TypeVar("_M", bound=BaseModel)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_dumps(obj)}\n\n"


def _finite(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that closes its engine streams however the response ends.

    NOTE: if the client disconnects before the body generator even starts, the generator's
    own `finally` never runs; closing here still aborts the requests and frees their blocks.
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


@dataclass
class _Choice:
    """Accumulated state of one completion while collecting or streaming."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    """Turns validated API requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 request_timeout: float | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names
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
        # NOTE: the worker has a tokenizer of its own: the event loop's keeps tokenizing small
        # requests meanwhile, and one Rust tokenizer is not meant to be used by two threads at once.
        self._prep_pool = ThreadPoolExecutor(1, thread_name_prefix="armserve-tokenize")
        self._prep_tokenizer = copy.deepcopy(self.tokenizer)

    async def parse(self, raw: Request, model: type[_M]) -> _M:
        """The request body as `model`: JSON parsing and validation, on the worker thread when the
        body is large (validating a 10 MB body of 300k messages held the event loop for 0.9 s).
        Errors are FastAPI's RequestValidationError, as for a typed body parameter."""
        data = await raw.body()

        def parse_body(_: Any = None) -> _M:
            if not data.strip():
                raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
            try:
                obj = json.loads(data)
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
        return await asyncio.get_running_loop().run_in_executor(self._prep_pool, fn, self._prep_tokenizer)

    def context_error(self, but: str, param: str) -> APIError:
        """The 400 of a request that cannot fit max_model_len; `but` says why, then what to do."""
        return APIError(f"This model's maximum context length is {self.engine.max_model_len} tokens, but {but}",
                        400, param, "context_length_exceeded")

    def too_long(self, e: PromptTooLongError, param: str) -> APIError:
        return self.context_error(f"the prompt has at least {e.num_tokens} tokens. Shorten the prompt.", param)

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestStream:
        """`engine.add_request` with the server's deadline."""
        return await self.engine.add_request(request_id, prompt, params, deadline=self.request_timeout)

    # ---- shared checks -------------------------------------------------------------------

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise APIError(
                f"The model '{requested}' does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.served_model_names)}.",
                404, "model", "model_not_found",
            )
        return requested

    def check_length(self, num_prompt: int, max_tokens: int | None, prompt_param: str, max_param: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt >= limit:
            raise self.context_error(f"the prompt has {num_prompt} tokens, which leaves no room to generate. "
                                     "Shorten the prompt.", prompt_param)
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise self.context_error(f"{num_prompt + max_tokens} were requested ({num_prompt} in the prompt, "
                                     f"{max_tokens} for the completion). Lower {max_param} or shorten the prompt.",
                                     max_param)

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
        try:
            return render_chat(tokenizer, convo, tools=tools, add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs,
                               max_tokens=self.engine.max_model_len if limit else None)
        except PromptTooLongError as e:
            raise self.too_long(e, "messages") from None
        except PromptError as e:
            raise APIError(str(e), 400, "messages") from None

    def tool_setup(self, body: ChatCompletionRequest, params: SamplingParams) -> tuple[str, list[dict[str, Any]] | None]:
        """A chat request's tool mode (tool_mode) and its tools as the template takes them."""
        mode = self.tool_mode(body.effective_tool_choice, bool(body.tools))
        if mode == "auto":
            # NOTE: the parser needs the call markers, which some tokenizers (Qwen's from GGUF) count
            # as special tokens and would drop from the text (vLLM's parsers do the same).
            params.skip_special_tokens = False
        return mode, [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None

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

    def tool_stream(self, mode: str, forced_name: str | None) -> "ToolCallStream | None":
        if mode == "none":
            return None
        parser = get_tool_parser(self.tool_call_parser) if mode == "auto" else None  # type: ignore[arg-type]
        return ToolCallStream(mode, parser, forced_name)

    # ---- chat ------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        body.warn_ignored_fields()
        model = self.model_name(body.model)
        params = body.to_sampling_params()
        mode, tools = self.tool_setup(body, params)
        ids = await self.prepare(raw, lambda tok: self.render_chat(
            body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template,
            body.chat_template_kwargs, tools, tok))
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        self.check_length(len(ids), params.max_tokens, "messages", max_param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.add_request(rid, ids, params)
        created = int(time.time())
        tool = (mode, body.forced_function)
        if body.stream:
            opts = body.stream_options
            return EngineStreamingResponse(
                self._chat_stream(stream, rid, model, created, params, len(ids),
                                  bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats),
                                  tool),
                [stream],
            )
        return await run_unless_disconnected(raw, self._chat_full(stream, rid, model, created, params, len(ids),
                                                                  tool))

    async def _chat_full(self, stream: RequestStream, rid: str, model: str, created: int,
                         params: SamplingParams, num_prompt: int, tool: tuple[str, str | None]) -> Response:
        choices, last = await _collect(stream, params.n)
        out_choices = []
        for i, c in enumerate(choices):
            reasoning, content = None, c.text
            if self.reasoning_parser:
                reasoning, content = ReasoningParser(self.reasoning_parser).parse(c.text)
            calls: list[ToolCall] = []
            ts = self.tool_stream(*tool)
            if ts is not None:
                content, calls = ts.extract(content or "")
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            out_choices.append({
                "index": i,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                            "tool_calls": [call.to_openai() for call in calls]},
                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            })
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": out_choices,
            "usage": _usage(num_prompt, sum(len(c.token_ids) for c in choices), last.num_cached_tokens),
            "system_fingerprint": None,
        })

    async def _chat_stream(self, stream: RequestStream, rid: str, model: str, created: int,
                           params: SamplingParams, num_prompt: int, include_usage: bool,
                           continuous_usage: bool, tool: tuple[str, str | None]) -> AsyncIterator[str]:
        n = params.n
        parsers = [ReasoningParser(self.reasoning_parser) for _ in range(n)] if self.reasoning_parser else None
        tool_streams = [self.tool_stream(*tool) for _ in range(n)]
        num_tokens = [0] * n
        cached = 0

        def chunk(choice: dict[str, Any] | None) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": [choice] if choice is not None else []}
            if include_usage:
                obj["usage"] = _usage(num_prompt, sum(num_tokens), cached) if continuous_usage else None
            return _sse(obj)

        try:
            for i in range(n):  # OpenAI's first chunk of each choice carries only the role
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    num_tokens[c.index] += len(c.token_ids)
                    delta: dict[str, Any] = {}
                    if parsers is not None:
                        reasoning, content = parsers[c.index].feed(c.text)
                        if c.finish_reason is not None:
                            r2, c2 = parsers[c.index].finish()
                            reasoning, content = reasoning + r2, content + c2
                        if reasoning:
                            delta["reasoning_content"] = reasoning
                        if content:
                            delta["content"] = content
                    elif c.text:
                        delta["content"] = c.text
                    finish = c.finish_reason
                    ts = tool_streams[c.index]
                    if ts is not None:
                        # Tool calls: content only up to where a call may start; then one chunk per
                        # tool-call delta (id and name first, then argument fragments), as OpenAI sends.
                        content, calls = ts.feed(delta.pop("content", ""), c.finish_reason is not None)
                        if content:
                            delta["content"] = content
                        if ts.called and finish == "stop":
                            finish = "tool_calls"
                        for call in calls:
                            if delta:
                                yield chunk({"index": c.index, "delta": delta, "logprobs": None,
                                             "finish_reason": None})
                            delta = {"tool_calls": [call]}
                    logprobs = self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs)
                    if not delta and c.finish_reason is None and not (logprobs and logprobs["content"]):
                        continue  # text held back (stop-string prefix, partial UTF-8)
                    yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish, "stop_reason": c.stop_reason})
            if include_usage:
                final = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": [], "usage": _usage(num_prompt, sum(num_tokens), cached)}
                yield _sse(final)
        except RequestFailedError as e:
            yield _sse(APIError(str(e), e.status).body())
        finally:
            stream.close()
        yield "data: [DONE]\n\n"

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs] | None,
                       top_k: int | None) -> dict[str, Any] | None:
        if logprobs is None or top_k is None:
            return None
        content = []
        for tid, pos in zip(token_ids, logprobs):
            chosen = pos[tid]
            text = self._token_text(tid, chosen)
            top = sorted((lp.rank, t, lp) for t, lp in pos.items() if lp.rank <= top_k)
            content.append({
                "token": text, "logprob": _finite(chosen.logprob), "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (s := self._token_text(t, lp)), "logprob": _finite(lp.logprob), "bytes": list(s.encode())}
                    for _, t, lp in top
                ],
            })
        return {"content": content}

    def _token_text(self, token_id: int, lp: Logprob | None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    # ---- responses (stateless) --------------------------------------------------------------

    async def responses(self, body: ResponsesRequest, raw: Request) -> Response:
        """POST /v1/responses, served as the equivalent chat request."""
        body.warn_ignored_fields()
        model = self.model_name(body.model)
        try:
            chat = body.to_chat_request()
        except ValidationError as e:
            raise APIError("Invalid request: " + "; ".join(
                str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors()), 400) from None
        params = chat.to_sampling_params()
        mode, tools = self.tool_setup(chat, params)
        ids = await self.prepare(raw, lambda tok: self.render_chat(chat.messages, tools=tools, tokenizer=tok))
        self.check_length(len(ids), params.max_tokens, "input", "max_output_tokens")
        rid = f"resp_{uuid.uuid4().hex}"
        stream = await self.add_request(rid, ids, params)
        base = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {}, "error": None,
            "incomplete_details": None, "previous_response_id": None, "reasoning": None, "store": False,
            "truncation": "disabled", "user": body.user,
        }
        tool = (mode, chat.forced_function)
        if body.stream:
            return EngineStreamingResponse(self._responses_stream(stream, base, len(ids), tool), [stream])

        async def full() -> Response:
            (c,), last = await _collect(stream, 1)
            output = self._response_items(c.text, tool)
            return JSONResponse(self._response_object(base, output, c.finish_reason, len(ids), len(c.token_ids),
                                                      last.num_cached_tokens))

        return await run_unless_disconnected(raw, full())

    def _response_items(self, text: str, tool: tuple[str, str | None]) -> list[dict[str, Any]]:
        """Output items of a whole completion: reasoning, a message, then function calls."""
        items: list[dict[str, Any]] = []
        reasoning, content = None, text
        if self.reasoning_parser:
            reasoning, content = ReasoningParser(self.reasoning_parser).parse(text)
        if reasoning:
            items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": reasoning}]})
        calls: list[ToolCall] = []
        ts = self.tool_stream(*tool)
        if ts is not None:
            content, calls = ts.extract(content or "")
        if content:
            items.append(_message_item(f"msg_{uuid.uuid4().hex}", content, "completed"))
        items.extend(_function_call_item(call, "completed") for call in calls)
        return items

    @staticmethod
    def _response_object(base: dict[str, Any], output: list[dict[str, Any]], finish: str | None, num_prompt: int,
                         num_output: int, cached: int) -> dict[str, Any]:
        done = finish != "length"
        return {**base, "status": "completed" if done else "incomplete",
                "incomplete_details": None if done else {"reason": "max_output_tokens"}, "output": output,
                "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": num_prompt + num_output}}

    async def _responses_stream(self, stream: RequestStream, base: dict[str, Any], num_prompt: int,
                                tool: tuple[str, str | None]) -> AsyncIterator[str]:
        """The Responses API's events: created, in_progress, the message's output_text deltas,
        function-call items (arguments sent whole once the call is known), completed."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {_dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        ts = self.tool_stream(*tool)
        reasoning = ReasoningParser(self.reasoning_parser) if self.reasoning_parser else None
        msg_id = f"msg_{uuid.uuid4().hex}"
        text_sent = ""
        opened = False
        num_output = cached = 0
        finish: str | None = None
        yield event("response.created", response={**base, "status": "in_progress", "output": [], "usage": None})
        yield event("response.in_progress", response={**base, "status": "in_progress", "output": [], "usage": None})
        try:
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    num_output += len(c.token_ids)
                    final = c.finish_reason is not None
                    finish = c.finish_reason or finish
                    delta = c.text
                    if reasoning is not None:
                        _, delta = reasoning.feed(delta)
                        if final:
                            delta += reasoning.finish()[1]
                    if ts is not None:
                        delta, _ = ts.feed(delta, final)
                    if delta:
                        if not opened:
                            opened = True
                            yield event("response.output_item.added", output_index=0,
                                        item=_message_item(msg_id, None, "in_progress"))
                            yield event("response.content_part.added", item_id=msg_id, output_index=0,
                                        content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                        text_sent += delta
                        yield event("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                    delta=delta, logprobs=[])
            items: list[dict[str, Any]] = []
            if opened:
                part = {"type": "output_text", "text": text_sent, "annotations": []}
                yield event("response.output_text.done", item_id=msg_id, output_index=0, content_index=0,
                            text=text_sent, logprobs=[])
                yield event("response.content_part.done", item_id=msg_id, output_index=0, content_index=0, part=part)
                items.append(_message_item(msg_id, text_sent, "completed"))
                yield event("response.output_item.done", output_index=0, item=items[-1])
            calls = ts.extract(ts.text)[1] if ts is not None else []
            for call in calls:
                idx = len(items)
                item = _function_call_item(call, "in_progress")
                yield event("response.output_item.added", output_index=idx, item={**item, "arguments": ""})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                            delta=call.arguments)
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                            name=call.name, arguments=call.arguments)
                items.append({**item, "status": "completed"})
                yield event("response.output_item.done", output_index=idx, item=items[-1])
            final_obj = self._response_object(base, items, finish, num_prompt, num_output, cached)
            yield event("response.completed" if final_obj["status"] == "completed" else "response.incomplete",
                        response=final_obj)
        except RequestFailedError as e:
            yield event("error", code="timeout" if e.status == 504 else "engine_dead", message=str(e), param=None)
        finally:
            stream.close()

    # ---- completions ---------------------------------------------------------------------

    async def completion(self, body: CompletionRequest, raw: Request) -> Response:
        body.warn_ignored_fields()
        model = self.model_name(body.model)
        params = body.to_sampling_params()

        def tokenize(tok: Any) -> list[tuple[str, list[int]]]:
            prompts: list[tuple[str, list[int]]] = []
            for p in body.prompts():
                if isinstance(p, str):
                    try:
                        ids = encode_text(tok, p, max_tokens=self.engine.max_model_len)
                    except PromptTooLongError as e:
                        raise self.too_long(e, "prompt") from None
                    except PromptError as e:
                        raise APIError(str(e), 400, "prompt") from None
                    prompts.append((p, ids))
                else:
                    prompts.append((self._decode_prompt(p), list(p)))
                self.check_length(len(prompts[-1][1]), params.max_tokens, "prompt", "max_tokens")
            return prompts

        prompts = await self.prepare(raw, tokenize)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                sub_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                streams.append(await self.add_request(sub_id, {"prompt": text, "prompt_token_ids": ids}, params))
        except BaseException:
            for s in streams:  # one bad prompt in a batch: leave nothing running
                s.close()
            raise
        created = int(time.time())
        if body.stream:
            opts = body.stream_options
            return EngineStreamingResponse(
                self._completion_stream(streams, prompts, rid, model, created, params, body.echo,
                                        bool(opts and opts.include_usage),
                                        bool(opts and opts.continuous_usage_stats)),
                streams,
            )
        return await run_unless_disconnected(
            raw, self._completion_full(streams, prompts, rid, model, created, params, body.echo))

    def _decode_prompt(self, ids: list[int]) -> str:
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"prompt token id {bad[0]} is out of range for the vocabulary size {vocab}", 400, "prompt")
        return self.tokenizer.decode(ids)

    async def _completion_full(self, streams: list[RequestStream], prompts: list[tuple[str, list[int]]],
                               rid: str, model: str, created: int, params: SamplingParams,
                               echo: bool) -> Response:
        try:
            results = await asyncio.gather(*[_collect(s, params.n) for s in streams])
        finally:
            for s in streams:
                s.close()
        out_choices = []
        num_generated = cached = 0
        for p_idx, ((choices, last), (ptext, pids)) in enumerate(zip(results, prompts)):
            cached += last.num_cached_tokens
            for i, c in enumerate(choices):
                num_generated += len(c.token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self._legacy_logprobs(c.token_ids, c.logprobs or [], params.logprobs,
                                                     len(ptext) if echo else 0)
                    if echo:
                        logprobs = _join_legacy(self._prompt_legacy_logprobs(pids, last.prompt_logprobs,
                                                                             params.logprobs), logprobs)
                out_choices.append({
                    "index": p_idx * params.n + i,
                    "text": (ptext + c.text) if echo else c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out_choices,
            "usage": _usage(sum(len(ids) for _, ids in prompts), num_generated, cached),
            "system_fingerprint": None,
        })

    async def _completion_stream(self, streams: list[RequestStream], prompts: list[tuple[str, list[int]]],
                                 rid: str, model: str, created: int, params: SamplingParams, echo: bool,
                                 include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        n = params.n
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_tokens = [0] * (n * len(prompts))
        text_offset = [0] * (n * len(prompts))
        echoed = [False] * (n * len(prompts))
        cached = [0] * len(prompts)

        def chunk(choice: dict[str, Any]) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                   "model": model, "choices": [choice]}
            if include_usage:
                obj["usage"] = _usage(num_prompt, sum(num_tokens), sum(cached)) if continuous_usage else None
            return _sse(obj)

        try:
            async for p_idx, out in _merge_streams(streams):
                cached[p_idx] = out.num_cached_tokens
                ptext, pids = prompts[p_idx]
                for c in out.outputs:
                    idx = p_idx * n + c.index
                    num_tokens[idx] += len(c.token_ids)
                    text = c.text
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = self._legacy_logprobs(c.token_ids, c.logprobs or [], params.logprobs,
                                                         text_offset[idx])
                    if echo and not echoed[idx]:
                        if params.logprobs is not None:
                            # NOTE: complete by now: the engine fills them before the first token.
                            plp = self._prompt_legacy_logprobs(pids, out.prompt_logprobs, params.logprobs)
                            logprobs = _join_legacy(plp, self._legacy_logprobs(
                                c.token_ids, c.logprobs or [], params.logprobs, len(ptext)))
                        text = ptext + text
                        echoed[idx] = True
                    if logprobs is not None and logprobs["tokens"]:
                        text_offset[idx] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    if not text and c.finish_reason is None and not (logprobs and logprobs["tokens"]):
                        continue
                    yield chunk({"index": idx, "text": text, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(num_prompt, sum(num_tokens), sum(cached))})
        except RequestFailedError as e:
            yield _sse(APIError(str(e), e.status).body())
        finally:
            for s in streams:
                s.close()
        yield "data: [DONE]\n\n"

    def _legacy_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs], top_k: int,
                         offset: int) -> dict[str, Any]:
        """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, pos in zip(token_ids, logprobs):
            chosen = pos[tid]
            text = self._token_text(tid, chosen)
            tokens.append(text)
            token_lps.append(_finite(chosen.logprob))
            tops.append({self._token_text(t, lp): _finite(lp.logprob)
                         for t, lp in sorted(pos.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_k}
                        if top_k > 0 else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_legacy_logprobs(self, ids: list[int], prompt_logprobs: list[PositionLogprobs | None] | None,
                                top_k: int) -> dict[str, Any]:
        # The first prompt token has no logprob (nothing precedes it).
        first = self.tokenizer.decode([ids[0]])
        rest = self._legacy_logprobs(ids[1:], [p or {} for p in (prompt_logprobs or [None])[1:]], top_k, len(first))
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}


# ---- helpers ---------------------------------------------------------------------------------


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


class ToolCallStream:
    """One choice's tool calls, whole (`extract`) or as streamed deltas (`feed`).

    "named": the text is the forced function's arguments (the grammar makes it that object), so
    its deltas stream as argument fragments after a first delta with the call's id and name.
    "required": the text is `[{"name": .., "parameters": {..}}, ...]`; held back to the end.
    "auto": the parser's format; text before a possible call streams as content, the rest is
    held back until the end and then parsed (text that is no call goes out as content).
    """

    def __init__(self, mode: str, parser: ToolParser | None, forced_name: str | None) -> None:
        self.mode = mode
        self.parser = parser
        self.forced_name = forced_name
        self.text = ""
        self.sent = 0  # characters of `text` sent as content
        self.called = False
        self._named_call: ToolCall | None = None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole completion's text."""
        if self.mode == "named":
            try:
                args = json.loads(text)
            except ValueError:
                return text, []  # cut short (max_tokens): give the text back as it is
            return None, [ToolCall(self.forced_name, json.dumps(args, ensure_ascii=False))]  # type: ignore[arg-type]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(d["name"], json.dumps(d["parameters"], ensure_ascii=False)) for d in items]
            except (ValueError, KeyError, TypeError):
                return text, []
        assert self.parser is not None
        return self.parser.extract(text)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) to send for this text delta."""
        self.text += delta
        if self.mode == "named":
            out = []
            if self._named_call is None and (delta or final):
                self._named_call = ToolCall(self.forced_name, "")  # type: ignore[arg-type]
                self.called = True
                out.append({"index": 0, "id": self._named_call.id, "type": "function",
                            "function": {"name": self.forced_name, "arguments": ""}})
            if delta:
                out.append({"index": 0, "function": {"arguments": delta}})
            return "", out
        if not final:
            if self.mode == "required":
                return "", []
            assert self.parser is not None
            start = max(self.parser.call_start(self.text), self.sent)
            content, self.sent = self.text[self.sent:start], start
            return content, []
        content, calls = self.extract(self.text)
        if not calls:
            rest, self.sent = self.text[self.sent:], len(self.text)
            return rest, []
        self.called = True
        start = self.parser.call_start(self.text) if self.parser is not None else self.sent
        rest = self.text[self.sent:max(start, self.sent)].rstrip() if content else ""
        out = []
        for i, call in enumerate(calls):
            out.append({"index": i, "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}})
            out.append({"index": i, "function": {"arguments": call.arguments}})
        return rest, out


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _join_legacy(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a[k] + b[k] for k in a}


async def _collect(stream: RequestStream, n: int) -> tuple[list[_Choice], RequestOutput]:
    """Read a stream to the end; raises EngineDeadError if the engine stopped meanwhile."""
    choices = [_Choice() for _ in range(n)]
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


async def _merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams' outputs as they arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:
            q.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
