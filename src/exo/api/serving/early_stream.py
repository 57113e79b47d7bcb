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
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectSendStream
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
RENDER_BUFFER = 16
"""Rendered pieces held between the renderer and the response body."""
SSE_KEEPALIVE = ": keep-alive\n\n"
"""An SSE comment line: every SSE parser skips it (WHATWG HTML, server-sent events)."""

ChunkRenderer = Callable[[AsyncIterator[Chunk]], AsyncIterator[str]]
"""Turns one generation's chunks into the dialect's streamed body pieces (SSE events or
JSON lines)."""


class StartedGeneration(Protocol):
    """A generation accepted by the cluster (`exo.api.serving.accepted_generation.Generation`)."""

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
        render: the dialect's renderer of the chunks.
        frames: the dialect's waiting frames.
    """

    def __init__(
        self,
        start: Callable[[], Awaitable[G]],
        render: ChunkRenderer,
        frames: WaitingFrames,
        media_type: str = "text/event-stream",
    ) -> None:
        super().__init__(media_type=media_type)
        self._start = start
        self._render = render
        self._frames = frames
        self._outcome: G | BaseException | None = None
        self._started = anyio.Event()
        self._handed_over = False
        self._rendered: list[BaseException | None] = []  # the renderer's end, once it ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed_in_time = False
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._run_start)
                with anyio.move_on_after(HEADERS_AFTER_SECONDS):
                    await self._started.wait()
                failed_in_time = self._started.is_set() and isinstance(self._outcome, BaseException)
                if not failed_in_time:
                    body = self._body(task_group)
                    try:
                        response = StreamingResponse(body, media_type=self.media_type)
                        await response(scope, receive, send)
                    finally:
                        with anyio.CancelScope(shield=True):
                            await body.aclose()
                        # The client left or the stream ended: stop the start and renderer.
                        task_group.cancel_scope.cancel()
        finally:
            outcome = self._outcome
            # Started, but its body never ran (the client left, or the headers failed).
            if isinstance(outcome, BaseException) or outcome is None or self._handed_over:
                pass
            else:
                outcome.cancel()
                outcome.close()
        if failed_in_time:
            assert isinstance(outcome, BaseException)
            raise outcome  # before any byte: the app's handlers render it as an HTTP error

    async def _run_start(self) -> None:
        try:
            self._outcome = await self._start()
        except Exception as error:
            self._outcome = error
        finally:
            self._started.set()

    async def _body(self, task_group: TaskGroup) -> AsyncGenerator[str, None]:
        """The response body: the early frames while the start is awaited (none when it
        ended in time), then the rendered chunks, with a heartbeat wherever
        `KEEPALIVE_SECONDS` pass without a byte sent (a prefill after the admission chunk,
        a slow step). The interval runs from the last byte actually sent: a piece that
        renders as nothing (Responses' admission) and the hand-over from the start to the
        renderer do not restart it."""
        last_sent = anyio.current_time()  # the headers have just gone out

        def until_heartbeat() -> float:
            return max(0.0, last_sent + KEEPALIVE_SECONDS - anyio.current_time())

        if not self._started.is_set():
            for frame in self._frames.opening():
                yield frame
                last_sent = anyio.current_time()
        while not self._started.is_set():
            with anyio.move_on_after(until_heartbeat()):
                await self._started.wait()
            if not self._started.is_set():
                yield self._frames.heartbeat
                last_sent = anyio.current_time()
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
        pieces, receiver = anyio.create_memory_object_stream[str](RENDER_BUFFER)
        task_group.start_soon(self._render_into, outcome, pieces)
        try:
            with receiver:
                while True:
                    piece: str | None = None
                    with anyio.move_on_after(until_heartbeat()):
                        try:
                            piece = await receiver.receive()
                        except anyio.EndOfStream:
                            break
                    if piece == "":
                        continue  # nothing to send: the heartbeat stays due
                    yield self._frames.heartbeat if piece is None else piece
                    last_sent = anyio.current_time()
            (error,) = self._rendered
            if error is not None:
                raise error
            finished = True
        finally:
            if not finished:
                outcome.cancel()
            outcome.close()

    async def _render_into(self, generation: G, pieces: MemoryObjectSendStream[str]) -> None:
        """Render `generation`'s chunks into `pieces`; the renderer's end (None, or what it
        raised) goes to `_rendered` before `pieces` closes."""
        error: BaseException | None = None
        async with pieces:
            try:
                async for piece in self._render(generation.chunks):
                    await pieces.send(piece)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the body stopped reading: the client left
            except Exception as raised:
                error = raised
            finally:
                self._rendered.append(error)
