"""How an accepted generation becomes the HTTP answer: a streamed body
(`streaming_response`) or a collected one (`collect`), and how either ends the generation
when the client goes away (cancelled on every rank, its admission place given back).

Apart from `generation` (checking, placing and submitting a request) because this is the
response's side of the generation's life: Starlette's streaming and disconnect handling.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from exo.api.serving.accepted_generation import Generation
from exo.api.serving.early_stream import ChunkRenderer
from exo.api.wire.errors import ApiError, GenerationError
from exo.shared.types.chunks import Chunk

T = TypeVar("T")

DISCONNECT_POLL_SECONDS = 0.25


class _GenerationStreamingResponse(StreamingResponse):
    """Streams `render(chunks)` and always ends the generation with the response: cancelled
    unless it streamed to the end, closed (its admission place given back) either way.
    Starlette never starts the body when the client is gone before the headers are sent,
    and leaves a body it stopped early to the garbage collector, so the ending is also done
    when the response is over."""

    def __init__(self, generation: Generation, render: ChunkRenderer, media_type: str) -> None:
        self._generation = generation
        self._started = False
        self._body = self._stream(render)
        super().__init__(self._body, media_type=media_type)

    async def _stream(self, render: ChunkRenderer) -> AsyncGenerator[str, None]:
        self._started = True
        finished = False
        try:
            async for piece in render(self._generation.chunks):
                yield piece
            finished = True
        finally:
            if not finished:
                self._generation.cancel()
            self._generation.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._started:
                self._generation.cancel()
                self._generation.close()
            with anyio.CancelScope(shield=True):
                await self._body.aclose()  # runs `_stream`'s `finally` if it stopped early


def streaming_response(
    generation: Generation, render: ChunkRenderer, media_type: str = "text/event-stream"
) -> StreamingResponse:
    """Stream `render(chunks)`; a client that leaves mid-stream (or before the stream
    starts) cancels the generation and gives back its admission place."""
    return _GenerationStreamingResponse(generation, render, media_type)


async def collect(
    generation: Generation,
    request: Request,
    collector: Callable[[AsyncIterator[Chunk]], Awaitable[T]],
) -> T:
    """`await collector(chunks)` unless the client disconnects first (then the generation
    is cancelled and GenerationError raised). ApiErrors from the collector propagate,
    except that a generation whose instance became unavailable is sent again (the client
    has received nothing yet) and collected anew."""
    result: list[T] = []
    error: list[ApiError] = []
    try:
        while True:
            async with anyio.create_task_group() as task_group:

                async def run_collector() -> None:
                    try:
                        result.append(await collector(generation.chunks))
                    except ApiError as api_error:
                        error.append(api_error)
                    task_group.cancel_scope.cancel()

                task_group.start_soon(run_collector)
                task_group.start_soon(cancel_on_disconnect, request, task_group.cancel_scope)
            if not (error and generation.can_retry(error[0])):
                break
            error.clear()
            await generation.retry(request)
    finally:
        generation.close()
    if error:
        raise error[0]
    if not result:
        generation.cancel()
        raise GenerationError("the client disconnected; generation cancelled")
    return result[0]


async def cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    """Cancel `scope` once the client has disconnected (polled every
    `DISCONNECT_POLL_SECONDS`)."""
    while not await request.is_disconnected():
        await anyio.sleep(DISCONNECT_POLL_SECONDS)
    scope.cancel()
