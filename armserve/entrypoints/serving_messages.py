"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens, served on the chat
pipeline: the body becomes the equivalent chat request (anthropic_protocol.py), which is templated,
tokenized, checked and run exactly as /v1/chat/completions runs it (serving.py); the output comes
back as a `message` with content blocks (text, tool_use, thinking) or as Anthropic's SSE events:

    message_start, then per block: content_block_start, content_block_delta (text_delta,
    input_json_delta, thinking_delta)..., content_block_stop; then message_delta (stop_reason,
    stop_sequence, output_tokens) and message_stop. One `ping` follows the first block's start, as
    Anthropic's own streams have it. A failure mid-stream is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from armserve.engine.async_llm import RequestStream
from armserve.engine.exceptions import RequestFailedError
from armserve.entrypoints.anthropic_protocol import CountTokensRequest, MessagesRequest, anthropic_error_body
from armserve.entrypoints.protocol import APIError, ChatCompletionRequest
from armserve.entrypoints.reasoning import ReasoningParser
from armserve.entrypoints.serving import EngineStreamingResponse, OpenAIServing, collect, dumps, run_unless_disconnected


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id prefix on a tool call's id (clients send it back as tool_use_id)."""
    return "toolu_" + call_id.removeprefix("call_")


def _stop_reason(finish: str | None, stop: int | str | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class AnthropicServingMessages:
    """The Messages endpoints over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    @staticmethod
    def _bad_request(e: ValueError) -> APIError:
        if isinstance(e, ValidationError):
            msg = "; ".join(str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors())
        else:
            msg = str(e)
        return APIError(f"Invalid request: {msg}", 400)

    async def count_tokens(self, body: CountTokensRequest, raw: Request) -> dict[str, int]:
        """POST /v1/messages/count_tokens: the prompt's tokens as /v1/messages renders it (tools
        included), counted past max_model_len too."""
        self.serving.model_name(body.model)
        try:
            messages, tools = body.chat_messages(), body.chat_tools()
        except ValueError as e:
            raise self._bad_request(e) from None
        ids = await self.serving.prepare(raw, lambda tok: self.serving.render_chat(
            messages, tools=tools, tokenizer=tok, limit=False))
        return {"input_tokens": len(ids)}

    async def create_message(self, body: MessagesRequest, raw: Request) -> Response:
        """POST /v1/messages: one `message` object, or its SSE events when `stream`."""
        body.warn_ignored_fields()
        model = self.serving.model_name(body.model)
        try:
            chat: ChatCompletionRequest = body.to_chat_request()
        except ValueError as e:  # (pydantic's ValidationError is one)
            raise self._bad_request(e) from None
        rid = f"msg_{uuid.uuid4().hex}"
        _, stream, num_prompt, tool = await self.serving.submit_chat(chat, raw, rid, "messages", "max_tokens")
        base = {"id": rid, "type": "message", "role": "assistant", "model": model}
        if body.stream:
            return EngineStreamingResponse(self._stream(stream, base, num_prompt, tool), [stream])

        async def full() -> Response:
            (c,), _ = await collect(stream, 1)
            reasoning, content, calls = self.serving.parse_output(c.text, tool)
            blocks: list[dict[str, Any]] = []
            if reasoning:
                blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
            if content:
                blocks.append({"type": "text", "text": content})
            blocks.extend({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                           "input": json.loads(call.arguments)} for call in calls)
            stop_reason, stop_sequence = _stop_reason(c.finish_reason, c.stop_reason, bool(calls))
            return JSONResponse({**base, "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                                 "usage": {"input_tokens": num_prompt, "output_tokens": len(c.token_ids)}})

        return await run_unless_disconnected(raw, full())

    async def _stream(self, stream: RequestStream, base: dict[str, Any], num_prompt: int,
                      tool: tuple[str, str | None]) -> AsyncIterator[str]:
        def event(kind: str, **fields: Any) -> str:
            return f"event: {kind}\ndata: {dumps({'type': kind, **fields})}\n\n"

        ts = self.serving.tool_stream(*tool)
        name = self.serving.reasoning_parser
        reasoning = ReasoningParser(name) if name else None
        index, open_kind = -1, None  # the content block being streamed, and its type

        def start(kind: str, block: dict[str, Any]) -> list[str]:
            """The events that close the open block (if any) and open a new one."""
            nonlocal index, open_kind
            out = [event("content_block_stop", index=index)] if open_kind is not None else []
            index, open_kind = index + 1, kind
            return out + [event("content_block_start", index=index, content_block=block)] + \
                ([event("ping")] if index == 0 else [])

        num_output = 0
        finish: str | None = None
        stop: int | str | None = None
        yield event("message_start", message={**base, "content": [], "stop_reason": None, "stop_sequence": None,
                                              "usage": {"input_tokens": num_prompt, "output_tokens": 0}})
        try:
            async for out in stream:
                for c in out.outputs:
                    num_output += len(c.token_ids)
                    final = c.finish_reason is not None
                    if final:
                        finish, stop = c.finish_reason, c.stop_reason
                    delta = c.text
                    if reasoning is not None:
                        thought, delta = reasoning.feed(delta, final)
                        if thought:
                            if open_kind != "thinking":
                                for e in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                                    yield e
                            yield event("content_block_delta", index=index,
                                        delta={"type": "thinking_delta", "thinking": thought})
                    calls: list[dict[str, Any]] = []
                    if ts is not None:
                        delta, calls = ts.feed(delta, final)
                    if delta:
                        if open_kind != "text":
                            for e in start("text", {"type": "text", "text": ""}):
                                yield e
                        yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": delta})
                    for call in calls:  # OpenAI-shaped deltas: id and name first, then argument text
                        fn = call["function"]
                        if "id" in call:
                            for e in start("tool_use", {"type": "tool_use", "id": _tool_use_id(call["id"]),
                                                        "name": fn["name"], "input": {}}):
                                yield e
                        if fn.get("arguments"):
                            yield event("content_block_delta", index=index,
                                        delta={"type": "input_json_delta", "partial_json": fn["arguments"]})
            if open_kind is not None:
                yield event("content_block_stop", index=index)
            stop_reason, stop_sequence = _stop_reason(finish, stop, ts is not None and ts.called)
            yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        usage={"output_tokens": num_output})
            yield event("message_stop")
        except RequestFailedError as e:
            yield event("error", error=anthropic_error_body(e.status, str(e))["error"])
        finally:
            stream.close()
