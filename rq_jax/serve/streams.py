"""The engine thread's deltas on their way to HTTP responses: handed to the server's event loop in bursts
(`LoopPost`), gathered per prompt (`Choice`), awaited whole (`gather`) or streamed as Server-Sent Events
(`sse_events`, `sse`). A client that disconnects, or closes its stream early, cancels what is left."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from rq_jax.serve.output import Delta, TokenLogprob
from rq_jax.serve.protocol import APIError

#: How often a non-streaming request checks whether its client is still there (seconds).
DISCONNECT_POLL = 0.1


class LoopPost:
    """Hands the engine thread's deltas to the server's event loop, one wake-up per burst: a step's deltas
    (one per running request) would otherwise each write the loop's wake-up pipe (`call_soon_threadsafe`),
    which at a few thousand tokens a second costs the server as much CPU as the rest of streaming."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, Delta]] = []

    def put(self, events: asyncio.Queue, delta: Delta) -> None:
        """From any thread: `events.put_nowait(delta)` on the loop, soon."""
        with self._lock:
            self._items.append((events, delta))
            if len(self._items) > 1:  # a flush is already scheduled and has not run yet
                return
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for events, delta in items:
            events.put_nowait(delta)


class Choice:
    """What one prompt's request has produced (text, tokens, log-probabilities), from its deltas."""

    def __init__(self, index: int, request_id: str, prompt: list[int]):
        self.index, self.request_id, self.prompt = index, request_id, prompt
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.logprobs += delta.logprobs
        self.num_tokens += len(delta.tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason


async def gather(request: Request, choices: list[Choice], events: asyncio.Queue,
                 cancel: Callable[[list[Choice]], None]) -> None:
    """Wait for every choice to finish; a client that disconnects meanwhile cancels them (APIError 499)."""
    by_id = {c.request_id: c for c in choices}
    pending = len(choices)
    try:
        while pending:
            try:
                delta = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "the client disconnected") from None
                continue
            choice = by_id[delta.request_id]
            choice.add(delta)
            pending -= delta.finish_reason is not None
    finally:
        cancel(choices)


async def sse_events(choices: list[Choice], events: asyncio.Queue, chunk: Callable[[Choice, Delta], dict],
                     first: Callable[[Choice], dict | None], usage: Callable[[], dict] | None,
                     cancel: Callable[[list[Choice]], None]) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta (and an opening one per choice when `first` gives one), a usage
    chunk when asked for, then [DONE]. Closing the stream early cancels what is left."""
    by_id = {c.request_id: c for c in choices}
    pending = len(choices)
    try:
        for c in choices:
            opening = first(c)
            if opening is not None:
                yield f"data: {json.dumps(opening)}\n\n"
        while pending:
            delta = await events.get()
            choice = by_id[delta.request_id]
            choice.add(delta)
            pending -= delta.finish_reason is not None
            if delta.finish_reason == "cancelled":
                return
            yield f"data: {json.dumps(chunk(choice, delta))}\n\n"
        if usage is not None:
            yield f"data: {json.dumps(usage())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        cancel(choices)


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    """A streaming response of Server-Sent Events."""
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
