"""POST /v1/chat/completions: a conversation -> chat template -> engine -> OpenAI chat JSON or SSE chunks.

Reasoning text (`--reasoning-parser`) goes out as `reasoning_content`, tool calls (the mode from
OpenAIServing.tool_mode, parsed or streamed by ToolCallStream) as `tool_calls`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from armserve.engine.async_llm import RequestStream
from armserve.engine.exceptions import RequestFailedError
from armserve.entrypoints.protocol import APIError, ChatCompletionRequest
from armserve.entrypoints.reasoning import ReasoningParser
from armserve.entrypoints.serving import (
    EngineStreamingResponse,
    OpenAIServing,
    collect,
    finite,
    run_unless_disconnected,
    sse,
    usage,
)
from armserve.outputs import PositionLogprobs
from armserve.sampling_params import SamplingParams


class OpenAIServingChat:
    """The chat completions endpoint over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_chat_completion(self, body: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions: one JSON response, or SSE chunks when `stream`."""
        body.warn_ignored_fields()
        model = self.serving.model_name(body.model)
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        params, stream, num_prompt, tool = await self.serving.submit_chat(body, raw, rid, "messages", max_param,
                                                                          "top_logprobs")
        created = int(time.time())
        if body.stream:
            opts = body.stream_options
            return EngineStreamingResponse(
                self._stream(stream, rid, model, created, params, num_prompt,
                             bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats), tool),
                [stream],
            )
        return await run_unless_disconnected(raw, self._full(stream, rid, model, created, params, num_prompt, tool))

    async def _full(self, stream: RequestStream, rid: str, model: str, created: int,
                    params: SamplingParams, num_prompt: int, tool: tuple[str, str | None]) -> Response:
        choices, last = await collect(stream, params.n)
        out_choices = []
        for i, c in enumerate(choices):
            reasoning, content, calls = self.serving.parse_output(c.text, tool)
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            out_choices.append({
                "index": i,
                "message": {"role": "assistant", "content": content, "reasoning_content": reasoning,
                            "tool_calls": [call.to_openai() for call in calls]},
                "logprobs": self._logprobs(c.token_ids, c.logprobs, params.logprobs),
                "finish_reason": finish,
                "stop_reason": c.stop_reason,
            })
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": out_choices,
            "usage": usage(num_prompt, sum(len(c.token_ids) for c in choices), last.num_cached_tokens),
            "system_fingerprint": None,
        })

    async def _stream(self, stream: RequestStream, rid: str, model: str, created: int,
                      params: SamplingParams, num_prompt: int, include_usage: bool,
                      continuous_usage: bool, tool: tuple[str, str | None]) -> AsyncIterator[str]:
        n = params.n
        name = self.serving.reasoning_parser
        parsers = [ReasoningParser(name) for _ in range(n)] if name else None
        tool_streams = [self.serving.tool_stream(*tool) for _ in range(n)]
        num_tokens = [0] * n
        cached = 0

        def chunk(choice: dict[str, Any] | None, final: bool = False) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": [choice] if choice is not None else []}
            if include_usage:
                obj["usage"] = usage(num_prompt, sum(num_tokens), cached) if continuous_usage or final else None
            return sse(obj)

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
                        reasoning, content = parsers[c.index].feed(c.text, final=c.finish_reason is not None)
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
                    logprobs = self._logprobs(c.token_ids, c.logprobs, params.logprobs)
                    if not delta and c.finish_reason is None and not (logprobs and logprobs["content"]):
                        continue  # text held back (stop-string prefix, partial UTF-8)
                    yield chunk({"index": c.index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish, "stop_reason": c.stop_reason})
            if include_usage:
                yield chunk(None, final=True)
        except RequestFailedError as e:
            yield sse(APIError(str(e), e.status).body())
        yield "data: [DONE]\n\n"

    def _logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs] | None,
                  top_k: int | None) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: per token its text, logprob, bytes and top_logprobs."""
        if logprobs is None or top_k is None:
            return None
        content = []
        for tid, pos in zip(token_ids, logprobs):
            chosen = pos[tid]
            text = self.serving.token_text(tid, chosen)
            top = sorted((lp.rank, t, lp) for t, lp in pos.items() if lp.rank <= top_k)
            content.append({
                "token": text, "logprob": finite(chosen.logprob), "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (s := self.serving.token_text(t, lp)), "logprob": finite(lp.logprob),
                     "bytes": list(s.encode())}
                    for _, t, lp in top
                ],
            })
        return {"content": content}

