"""POST /v1/completions: a prompt (text or token ids, one or a batch) -> engine -> OpenAI text_completion
JSON or SSE chunks, with OpenAI's legacy logprobs format and `echo`; `suffix` (fill-in-the-middle on
models with FIM tokens), `best_of` (the n best of best_of by cumulative logprob) and vLLM's
`return_token_ids`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from armserve.prompts import NoFIMError, PromptError, encode_text, fim_prompt
from armserve.engine.async_llm import RequestStream
from armserve.engine.exceptions import RequestFailedError
from armserve.engine.input_processor import EngineCoreRequest
from armserve.entrypoints.protocol import APIError, CompletionRequest
from armserve.entrypoints.serving import (
    EngineStreamingResponse,
    OpenAIServing,
    collect,
    finite,
    run_unless_disconnected,
    sse,
    usage,
)
from armserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from armserve.sampling_params import SamplingParams


class OpenAIServingCompletion:
    """The text completions endpoint over the shared `OpenAIServing`."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create_completion(self, body: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions: one prompt or a batch of them; one JSON response, or SSE chunks when `stream`."""
        body.warn_ignored_fields()
        model = self.serving.model_name(body.model)
        params = body.to_sampling_params(self.serving.default_sampling)
        # best_of > n: the engine runs best_of completions (logprobs on, to rank them); n are returned.
        n = params.n
        rank = body.best_of is not None and body.best_of > n
        hide_logprobs = rank and params.logprobs is None
        if rank:
            params.n = body.best_of  # type: ignore[assignment]
            if hide_logprobs:
                params.logprobs = 0

        rid = f"cmpl-{uuid.uuid4().hex}"
        texts = body.prompts()
        suffix = body.suffix or None
        limit = self.serving.engine.max_model_len

        def process(tok: Any) -> list[EngineCoreRequest]:
            requests = []
            for i, p in enumerate(texts):
                sub_id = rid if len(texts) == 1 else f"{rid}-{i}"
                try:
                    if suffix is not None:
                        ids = fim_prompt(tok, p, suffix, max_tokens=limit)
                    else:
                        ids = encode_text(tok, p, max_tokens=limit) if isinstance(p, str) else p
                except NoFIMError as e:
                    raise APIError(str(e), 400, "suffix") from None
                except PromptError as e:  # a 400 naming its field (context_length_exceeded if too long)
                    with self.serving.prompt_errors("suffix" if str(e).startswith("suffix") else "prompt"):
                        raise
                request = self.serving.process(sub_id, ids, params, "prompt", text=p if isinstance(p, str) else None)
                if not isinstance(p, str):  # (for echo; decoded once the ids are checked: -5 or 2**40 is a 400)
                    request.prompt = tok.decode(p)
                requests.append(request)
            return requests

        requests = await self.serving.prepare(raw, process)
        prompts = [(r.prompt, r.prompt_token_ids) for r in requests]
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(await self.serving.submit(request, body.model))
        except BaseException:
            for s in streams:  # one bad prompt in a batch: leave nothing running
                s.close()
            raise
        created = int(time.time())
        if body.stream:
            opts = body.stream_options
            return EngineStreamingResponse(
                self._stream(streams, prompts, rid, model, created, params, body.echo,
                             bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats),
                             body.return_token_ids),
                streams,
            )
        return await run_unless_disconnected(
            raw, self._full(streams, prompts, rid, model, created, params, body.echo, n, hide_logprobs,
                            body.return_token_ids))

    async def _full(self, streams: list[RequestStream], prompts: list[tuple[str, list[int]]], rid: str, model: str,
                    created: int, params: SamplingParams, echo: bool, n: int, hide_logprobs: bool,
                    return_token_ids: bool) -> Response:
        """`n` of each prompt's `params.n` completions: with best_of, those of highest cumulative logprob."""
        try:
            results = await asyncio.gather(*[collect(s, params.n) for s in streams])
        finally:
            for s in streams:
                s.close()
        out_choices = []
        num_generated = cached = 0
        for p_idx, ((choices, last), (ptext, pids)) in enumerate(zip(results, prompts)):
            cached += last.num_cached_tokens
            if len(choices) > n:
                choices = sorted(choices, key=_cumulative_logprob, reverse=True)[:n]
            for i, c in enumerate(choices):
                num_generated += len(c.token_ids)
                out_choices.append({
                    "index": p_idx * n + i,
                    "text": (ptext + c.text) if echo else c.text,
                    "logprobs": None if hide_logprobs else self._logprobs(
                        c, params.logprobs, len(ptext) if echo else 0, (pids, last.prompt_logprobs) if echo else None),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                })
                if return_token_ids:
                    out_choices[-1].update(prompt_token_ids=pids, token_ids=c.token_ids)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": out_choices,
            "usage": usage(sum(len(ids) for _, ids in prompts), num_generated, cached),
            "system_fingerprint": None,
        })

    async def _stream(self, streams: list[RequestStream], prompts: list[tuple[str, list[int]]], rid: str, model: str,
                      created: int, params: SamplingParams, echo: bool, include_usage: bool,
                      continuous_usage: bool, return_token_ids: bool = False) -> AsyncIterator[str]:
        n = params.n
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_tokens = [0] * (n * len(prompts))
        text_offset = [0] * (n * len(prompts))
        echoed = [False] * (n * len(prompts))
        ids_sent = [False] * (n * len(prompts))  # return_token_ids: the prompt's ids go in a choice's first chunk
        cached = [0] * len(prompts)

        def chunk(choice: dict[str, Any] | None, final: bool = False) -> str:
            obj: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                   "model": model, "choices": [choice] if choice is not None else []}
            if include_usage:
                obj["usage"] = usage(num_prompt, sum(num_tokens), sum(cached)) if continuous_usage or final else None
            return sse(obj)

        try:
            async for p_idx, out in _merge_streams(streams):
                cached[p_idx] = out.num_cached_tokens
                ptext, pids = prompts[p_idx]
                for c in out.outputs:
                    idx = p_idx * n + c.index
                    num_tokens[idx] += len(c.token_ids)
                    text = c.text
                    # NOTE: the prompt's logprobs are complete by now: the engine fills them before the first token.
                    echo_now = echo and not echoed[idx]
                    logprobs = self._logprobs(c, params.logprobs, len(ptext) if echo_now else text_offset[idx],
                                              (pids, out.prompt_logprobs) if echo_now else None)
                    if echo_now:
                        text = ptext + text
                        echoed[idx] = True
                    if logprobs is not None and logprobs["tokens"]:
                        text_offset[idx] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    if not text and c.finish_reason is None and not (logprobs and logprobs["tokens"]):
                        continue
                    choice = {"index": idx, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if return_token_ids:
                        choice["prompt_token_ids"] = None if ids_sent[idx] else pids
                        choice["token_ids"] = c.token_ids
                        ids_sent[idx] = True
                    yield chunk(choice)
            if include_usage:
                yield chunk(None, final=True)
        except RequestFailedError as e:
            yield sse(APIError(str(e), e.status).body())
        yield "data: [DONE]\n\n"

    def _legacy_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs], top_k: int,
                         offset: int) -> dict[str, Any]:
        """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, pos in zip(token_ids, logprobs):
            chosen = pos[tid]
            text = self.serving.token_text(tid, chosen)
            tokens.append(text)
            token_lps.append(finite(chosen.logprob))
            tops.append({self.serving.token_text(t, lp): finite(lp.logprob)
                         for t, lp in sorted(pos.items(), key=lambda kv: kv[1].rank) if lp.rank <= top_k}
                        if top_k > 0 else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, c: CompletionOutput, top_k: int | None, offset: int,
                  prompt: tuple[list[int], list[PositionLogprobs | None] | None] | None) -> dict[str, Any] | None:
        """Legacy logprobs of a completion's tokens from text offset `offset`, after those of the
        echoed `prompt` (its token ids and prompt logprobs) when given; None unless asked for."""
        if top_k is None:
            return None
        out = self._legacy_logprobs(c.token_ids, c.logprobs or [], top_k, offset)
        if prompt is None:
            return out
        ids, prompt_logprobs = prompt
        first = self.serving.tokenizer.decode([ids[0]])  # no logprob: nothing precedes it
        rest = self._legacy_logprobs(ids[1:], [p or {} for p in (prompt_logprobs or [None])[1:]], top_k, len(first))
        head = {"tokens": first, "token_logprobs": None, "top_logprobs": None, "text_offset": 0}
        return {k: [head[k], *rest[k], *out[k]] for k in head}


def _cumulative_logprob(c: CompletionOutput) -> float:
    """The log-probability of a completion's tokens (its logprobs were asked for)."""
    return sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs or []))


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
