"""The API node stopping, as the requests it has not answered yet see it.

As the node stops (Ctrl-C, SIGTERM), `ClusterClient.end_streams` ends every open chunk
stream with a 503 `node_shutting_down` error chunk, and begins the `NodeStop`. A request
that has no chunk stream yet is still waiting for something else: catching up with the
master's history, its model loading on request, a place in the admission queue, a command's
outcome, a re-placed instance. Each such wait runs inside `NodeStop.unless_stopping`, which
ends it as the stop begins with the same answer an open stream gets, in the request's
dialect: a non-streamed request a 503 in its error shape, a stream whose headers went out
its in-band error (`exo.api.serving.early_stream`). Without it the request waited on until
uvicorn's graceful shutdown (2 s) cancelled it: a plain-text 500, a stream cut without its
error, and a `CancelledError` traceback in the log. A request arriving once the stop began
is answered at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from exo.api.wire.errors import NoCapacityError
from exo.shared.types.chunks import NODE_SHUTTING_DOWN

T = TypeVar("T")

DEFAULT_MESSAGE = "the node is shutting down"


class NodeStop:
    """Whether this API node is stopping, and the race every pre-stream wait takes against
    it. Each wait has its own event, made in the loop it runs in (a test client may run
    each request in a loop of its own)."""

    def __init__(self) -> None:
        self._waits: set[anyio.Event] = set()
        self.message: str | None = None
        """What the clients read (`begin`'s message); None until the stop begins."""

    @property
    def begun(self) -> bool:
        return self.message is not None

    def begin(self, message: str) -> None:
        """The node stops: every wait inside `unless_stopping` ends now with `error()`
        saying `message`, and every one started from now on at once. Idempotent (the
        first message stays)."""
        if self.message is None:
            self.message = message
        for wait in self._waits:
            wait.set()

    def error(self) -> NoCapacityError:
        """The answer of a request the stop ended: 503 `node_shutting_down`, worded as the
        error chunk that ends the open streams."""
        return NoCapacityError(self.message or DEFAULT_MESSAGE, code=NODE_SHUTTING_DOWN)

    async def unless_stopping(self, wait: Callable[[], Awaitable[T]]) -> T:
        """`await wait()`, unless the stop begins first: then `wait` is cancelled (its own
        cleanup runs: an admission place given back, a generation already sent cancelled)
        and `error()` raised. Nested calls are fine (the innermost ends first, with the
        same error).

        Raises:
            NoCapacityError: the stop began before `wait` ended, or had already begun.
            Exception: whatever `wait` raised before the stop began.
        """
        if self.begun:
            raise self.error()
        begun = anyio.Event()
        outcome: list[T] = []
        error: list[Exception] = []
        stopped = False
        self._waits.add(begun)
        try:
            async with anyio.create_task_group() as task_group:

                async def run() -> None:
                    try:
                        outcome.append(await wait())
                    except Exception as raised:
                        error.append(raised)
                    task_group.cancel_scope.cancel()

                async def stop_on_begin() -> None:
                    nonlocal stopped
                    await begun.wait()
                    stopped = True
                    task_group.cancel_scope.cancel()

                task_group.start_soon(run)
                task_group.start_soon(stop_on_begin)
        finally:
            self._waits.discard(begun)
        if outcome:
            return outcome[0]
        if error and not stopped:
            raise error[0]
        # Stopped. What `wait` raised while it was being cancelled (an inner wait taking the
        # cancellation for its client leaving) is not the answer.
        raise self.error()
