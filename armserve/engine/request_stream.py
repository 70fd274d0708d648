"""A request's outputs as an async stream of deltas (`RequestStream`), and handing outputs from the
engine's thread to the streams' event loops (`deliver`). engine/async_llm.py makes the streams."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import replace
from typing import Any, Protocol

from armserve.outputs import CompletionOutput, RequestOutput


class _Owner(Protocol):
    """What a stream needs of its AsyncLLM: aborting its request when closed early."""

    def abort(self, request_ids: str) -> None: ...


def merge_delta_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Join two consecutive delta outputs of one request into one (`b` came later)."""
    comps: dict[int, CompletionOutput] = {
        c.index: replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in a.outputs
    }
    for c in b.outputs:
        prev = comps.get(c.index)
        if prev is None:
            comps[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + list(c.logprobs)
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
    # (prompt_logprobs are cumulative in the engine: the later output has them all)
    return replace(b, outputs=[comps[i] for i in sorted(comps)])


class RequestStream:
    """The outputs of one request as an async iterator of deltas.

    When the reader falls behind, queued deltas are merged, so a slow client gets fewer,
    larger chunks instead of an ever-growing backlog. Closing an unfinished stream aborts
    the request, which frees its KV blocks at once.
    """

    def __init__(self, request_id: str, owner: _Owner, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._closed = False

    def _put(self, item: RequestOutput | BaseException) -> None:  # event-loop thread only
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output (merged deltas); raises the engine's error if the request failed."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        while self._items and isinstance(self._items[0], RequestOutput):
            item = merge_delta_outputs(item, self._items.popleft())  # type: ignore[arg-type]
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

    def close(self) -> None:
        """Stop reading; aborts the request if it has not finished. Safe to call twice."""
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._owner.abort(self.request_id)


def deliver(deliveries: list[tuple[RequestStream, Any]]) -> None:
    """Hand outputs to their event loops: one thread-safe callback per loop per step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream._loop, []).append((stream, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            pass  # that event loop is closed: nobody is listening


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)
