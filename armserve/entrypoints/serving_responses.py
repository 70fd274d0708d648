"""POST /v1/responses: served as the equivalent chat request, answered as a Response object with
output items (reasoning, a message, function calls) or as the Responses API's SSE events.

Responses are stored unless `store` is false (OpenAI's default), in a bounded ResponseStore
(response_store.py): GET / DELETE /v1/responses/{id} read and remove them, and
`previous_response_id` continues from a stored response's conversation (its input and output; not
its instructions, as in OpenAI's API). An unknown id is a 404.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from armserve.engine.async_llm import RequestStream
from armserve.engine.exceptions import RequestFailedError
from armserve.entrypoints.protocol import APIError, ResponsesRequest
from armserve.entrypoints.reasoning import ReasoningParser
from armserve.entrypoints.response_store import ResponseStore
from armserve.entrypoints.serving import EngineStreamingResponse, OpenAIServing, collect, dumps, run_unless_disconnected
from armserve.entrypoints.tool_parsers import ToolCall


class OpenAIServingResponses:
    """The Responses API endpoint over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    def _stored(self, response_id: str, param: str | None = None) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found.", 404, param)
        return entry

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}: the stored Response object."""
        return self._stored(response_id)["response"]

    async def delete(self, response_id: str) -> dict[str, Any]:
        """DELETE /v1/responses/{id}."""
        if not self.store.delete(response_id):
            raise APIError(f"Response with id '{response_id}' not found.", 404)
        return {"id": response_id, "object": "response", "deleted": True}

    async def create_response(self, body: ResponsesRequest, raw: Request) -> Response:
        """POST /v1/responses, served as the equivalent chat request."""
        body.warn_ignored_fields()
        model = self.serving.model_name(body.model)
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            history = self._stored(body.previous_response_id, "previous_response_id")["messages"]
        try:
            chat = body.to_chat_request(history)
        except ValidationError as e:
            raise APIError("Invalid request: " + "; ".join(
                str(err.get("msg", "")).removeprefix("Value error, ") for err in e.errors()), 400) from None
        rid = f"resp_{uuid.uuid4().hex}"
        _, stream, num_prompt, tool = await self.serving.submit_chat(chat, raw, rid, "input", "max_output_tokens")
        base = {
            "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
            "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {}, "error": None,
            "incomplete_details": None, "previous_response_id": body.previous_response_id, "reasoning": None,
            "store": body.store is not False, "truncation": "disabled", "user": body.user,
        }
        conversation = history + body.input_messages() if base["store"] else None
        if body.stream:
            return EngineStreamingResponse(self._stream(stream, base, num_prompt, tool, conversation), [stream])

        async def full() -> Response:
            (c,), last = await collect(stream, 1)
            output = self._items(c.text, tool)
            obj = _response_object(base, output, c.finish_reason, num_prompt, len(c.token_ids), last.num_cached_tokens)
            self._keep(obj, conversation)
            return JSONResponse(obj)

        return await run_unless_disconnected(raw, full())

    def _keep(self, obj: dict[str, Any], conversation: list[dict[str, Any]] | None) -> None:
        """Store a finished response (when its request asked to) with its conversation: the input
        so far, then its output as an assistant turn."""
        if conversation is None:
            return
        items = obj["output"]
        text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
        calls = [{"id": it["call_id"], "type": "function",
                  "function": {"name": it["name"], "arguments": it["arguments"]}}
                 for it in items if it["type"] == "function_call"]
        turn: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            turn["tool_calls"] = calls
        self.store.put(obj["id"], {"response": obj, "messages": conversation + [turn]})

    def _items(self, text: str, tool: tuple[str, str | None]) -> list[dict[str, Any]]:
        """Output items of a whole completion: reasoning, a message, then function calls."""
        items: list[dict[str, Any]] = []
        reasoning, content, calls = self.serving.parse_output(text, tool)
        if reasoning:
            items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": reasoning}]})
        if content:
            items.append(_message_item(f"msg_{uuid.uuid4().hex}", content, "completed"))
        items.extend(_function_call_item(call, "completed") for call in calls)
        return items

    async def _stream(self, stream: RequestStream, base: dict[str, Any], num_prompt: int,
                      tool: tuple[str, str | None], conversation: list[dict[str, Any]] | None) -> AsyncIterator[str]:
        """The Responses API's events: created, in_progress, the message's output_text deltas,
        function-call items (arguments sent whole once the call is known), completed."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        ts = self.serving.tool_stream(*tool)
        name = self.serving.reasoning_parser
        reasoning = ReasoningParser(name) if name else None
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
                        _, delta = reasoning.feed(delta, final)
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
            final_obj = _response_object(base, items, finish, num_prompt, num_output, cached)
            self._keep(final_obj, conversation)
            yield event("response.completed" if final_obj["status"] == "completed" else "response.incomplete",
                        response=final_obj)
        except RequestFailedError as e:
            yield event("error", code="timeout" if e.status == 504 else "engine_dead", message=str(e), param=None)


def _response_object(base: dict[str, Any], output: list[dict[str, Any]], finish: str | None, num_prompt: int,
                     num_output: int, cached: int) -> dict[str, Any]:
    """The Response object; cut short by max_output_tokens it is "incomplete"."""
    done = finish != "length"
    return {**base, "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"}, "output": output,
            "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": num_prompt + num_output}}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _function_call_item(call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}
