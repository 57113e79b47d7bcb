"""Bytes from the first second: how a streamed generation answers while its first chunk is
still to come (the model loading on request, the request queued for a place, a long prompt
being prefilled).

A streaming request is validated before anything is sent (a bad body is a plain HTTP error
with its status, as before). Then its slow part — placing and loading the model when it has
no instance, waiting for a place (`admission`), submitting, waiting for the first chunk —
runs while the response waits at most `HEADERS_AFTER_SECONDS`:
- the first chunk (or an error) came in time: the answer is exactly what it was without this
  module (an error is an HTTP error with its status and the dialect's error body);
- it did not: the `200` headers go out, then the dialect's opening frames (Responses:
  `response.created`, `response.in_progress`), then one heartbeat every `KEEPALIVE_SECONDS`
  until the first chunk — an SSE comment line (`: keep-alive`, ignored by every SSE parser)
  in Chat Completions, legacy Completions and Responses, a `ping` event in Claude Messages
  (as Anthropic's own streams send, skipped by its SDKs) — then the stream as always. An
  error raised after the headers went out (the engine refused the prompt, no capacity, the
  model could not be loaded) ends the stream in-band, in the dialect's own failure frames,
  with the message and code the HTTP error would have had.

Ollama's NDJSON streams keep their silence until the first line (its clients wait; nothing
here times out server-side). Headers that depend on the first chunk
(`X-Exo-Max-Tokens-Capped`) are only sent when the first chunk came before the headers.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import anyio
from loguru import logger
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from exo.api.wire.errors import ApiError, GenerationError
from exo.shared.types.chunks import Chunk

HEADERS_AFTER_SECONDS = 1.0
"""How long a streamed answer may go without its headers (the issue's "bytes from the
first second")."""
KEEPALIVE_SECONDS = 5.0
"""The longest gap between two heartbeats before the first chunk; proxies and agents
commonly give up on 10-60 s of silence."""
SSE_KEEPALIVE = ": keep-alive\n\n"
"""An SSE comment line: every SSE parser skips it (WHATWG HTML, server-sent events)."""

ChunkRenderer = Callable[[AsyncIterator[Chunk]], AsyncIterator[str]]
"""Turns one generation's chunks into the dialect's streamed body pieces (SSE events or
JSON lines)."""


class StartedGeneration(Protocol):
    """A generation accepted by the cluster (`exo.api.serving.generation.Generation`)."""

    chunks: AsyncIterator[Chunk]

    def cancel(self) -> None: ...

    def close(self) -> None: ...


G = TypeVar("G", bound=StartedGeneration)


def _no_frames() -> Iterable[str]:
    return ()


@dataclass(frozen=True, slots=True)
class WaitingFrames:
    """What one dialect's stream sends between its early headers and its first chunk.

    Attributes:
        failure: the frames ending a stream whose request failed before its first chunk
            (the dialect's in-band error, worded as its HTTP error would be).
        heartbeat: sent every `KEEPALIVE_SECONDS` while the first chunk is awaited.
        opening: sent once, right after the early headers (Responses' lifecycle events).
    """

    failure: Callable[[ApiError], Iterable[str]]
    heartbeat: str = SSE_KEEPALIVE
    opening: Callable[[], Iterable[str]] = field(default=_no_frames)


class EarlyStreamingResponse(Response, Generic[G]):
    """A streamed generation's response that sends its headers at the first chunk or after
    `HEADERS_AFTER_SECONDS`, whichever comes first (module docstring).

    Args:
        start: starts the generation and returns it with its first chunk read
            (`start_generation` after the request's checks); raises ApiError.
        respond: the answer for a generation started in time (a streamed response that
            ends the generation with itself).
        render: the dialect's renderer of the chunks.
        frames: the dialect's waiting frames.
    """

    def __init__(
        self,
        start: Callable[[], Awaitable[G]],
        respond: Callable[[G], Response],
        render: ChunkRenderer,
        frames: WaitingFrames,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(media_type=media_type)
        self._start = start
        self._respond = respond
        self._render = render
        self._frames = frames
        self._outcome: G | BaseException | None = None
        self._started = anyio.Event()
        self._handed_over = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        early = False
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._run_start)
            with anyio.move_on_after(HEADERS_AFTER_SECONDS):
                await self._started.wait()
            if not self._started.is_set():
                early = True
                body = self._early_body()
                try:
                    await StreamingResponse(body, media_type=self.media_type)(scope, receive, send)
                finally:
                    with anyio.CancelScope(shield=True):
                        await body.aclose()
                    # The client left (or the stream ended) before the start finished.
                    task_group.cancel_scope.cancel()
        outcome = self._outcome
        if early:
            unsent = outcome is not None and not isinstance(outcome, BaseException)
            if unsent and not self._handed_over:
                assert outcome is not None and not isinstance(outcome, BaseException)
                outcome.cancel()
                outcome.close()
            return
        if isinstance(outcome, BaseException):
            raise outcome  # before any byte: the app's handlers render it as an HTTP error
        assert outcome is not None
        await self._respond(outcome)(scope, receive, send)

    async def _run_start(self) -> None:
        try:
            self._outcome = await self._start()
        except Exception as error:
            self._outcome = error
        finally:
            self._started.set()

    async def _early_body(self) -> AsyncGenerator[str, None]:
        for frame in self._frames.opening():
            yield frame
        while not self._started.is_set():
            with anyio.move_on_after(KEEPALIVE_SECONDS):
                await self._started.wait()
            if not self._started.is_set():
                yield self._frames.heartbeat
        outcome = self._outcome
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, ApiError):
                logger.opt(exception=outcome).error("api: a streamed generation failed to start")
                outcome = GenerationError(f"the generation failed to start: {outcome}")
            for frame in self._frames.failure(outcome):
                yield frame
            return
        assert outcome is not None
        self._handed_over = True
        finished = False
        try:
            async for piece in self._render(outcome.chunks):
                yield piece
            finished = True
        finally:
            if not finished:
                outcome.cancel()
            outcome.close()
