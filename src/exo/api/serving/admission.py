"""Admission of generations on this API node: how many may be in flight at once, and what
happens to the rest.

Each instance runs up to `max_concurrent_requests` generations at once in its batch (its
rank-0 runner reports the number in `RunnerReady`), and queues the ones after them. This
node lets at most `capacity + queue` of its own requests be in flight per instance serving
the model (summed over the model's instances: the master sends each generation to the least
busy of them), where `queue` is `--max-queued-requests` (default `DEFAULT_QUEUE_BATCHES`
times the capacity, at least `DEFAULT_MIN_QUEUE`). A request beyond that waits here,
first come first served, for at most `ADMISSION_WAIT_SECONDS`; then it is answered 503 with
a `Retry-After` header (`QueueFullError`) in its dialect's shape. Nothing is lost: the
waiting request has sent nothing to the cluster yet, and a client that disconnects while
waiting gives up its place.

"In flight" runs from admission until the response is finished or abandoned (the
`Generation` is closed), including the time spent streaming to a slow client.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from fastapi import Request
from loguru import logger

from exo.api.wire.errors import GenerationError, QueueFullError
from exo.shared.types.common import ModelId, RunnerId
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.shared.types.state import State

# How long a request waits for a place when every instance of its model is full. Long
# enough for a running batch of chat answers to finish a few (on the 2-core test machine
# the default model's answers of a few hundred tokens take 10-20 s each), short enough that
# the client hears of the overload well inside its SDK's own timeout (OpenAI's and
# Anthropic's Python SDKs wait 600 s) and can retry elsewhere or later.
ADMISSION_WAIT_SECONDS = 30.0
# The `Retry-After` a refused request gets: about the time a place takes to free up when
# the queue is full (one short answer of the running batch finishing), so that a client
# retrying then (the official SDKs honour the header) is likely to be admitted.
RETRY_AFTER_SECONDS = 5
# The default queue per instance: this many batches' worth of generations, so a queued
# request waits behind at most about four batches...
DEFAULT_QUEUE_BATCHES = 4
# ...and at least this many requests, so that an ordinary burst (a few users at once, an
# agent's parallel calls) is queued rather than refused even by an instance that runs one
# generation at a time. (Ollama queues up to 512 per server before its 503, OLLAMA_MAX_QUEUE;
# we refuse sooner, after a bounded wait, so that a client hears of the overload in time.)
DEFAULT_MIN_QUEUE = 16
# Waiting requests look at the cluster state (new instances, new capacities) and at their
# client's connection this often, besides waking whenever a place is released.
POLL_SECONDS = 0.25


class _Disconnectable(Protocol):
    async def is_disconnected(self) -> bool: ...


def admission_of(request: Request) -> Admission:
    """The admission of the app serving `request` (`create_app` sets one; an app built
    without gets the default on first use)."""
    admission = getattr(request.app.state, "admission", None)
    if admission is None:
        admission = request.app.state.admission = Admission()
    assert isinstance(admission, Admission)
    return admission


@dataclass(slots=True)
class _ModelQueue:
    in_flight: int = 0
    waiting: deque[object] = field(default_factory=deque)


class Admission:
    """Counts this node's generations in flight per model and admits new ones.

    Args:
        max_queued_requests: requests per instance admitted beyond its batch capacity
            (`--max-queued-requests`, >= 0); None: `DEFAULT_QUEUE_BATCHES` x capacity, at
            least `DEFAULT_MIN_QUEUE`.
        wait_seconds: how long a request waits for a place before its 503.
        retry_after_seconds: the `Retry-After` of that 503.
        poll_seconds: how often a waiting request looks at the state and its client.

    Raises:
        ValueError: a negative `max_queued_requests`, or a wait that is not positive.
    """

    def __init__(
        self,
        max_queued_requests: int | None = None,
        wait_seconds: float = ADMISSION_WAIT_SECONDS,
        retry_after_seconds: int = RETRY_AFTER_SECONDS,
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, not {max_queued_requests}")
        if not wait_seconds > 0 or not poll_seconds > 0:
            raise ValueError("wait_seconds and poll_seconds must be > 0")
        self.max_queued_requests = max_queued_requests
        self.wait_seconds = wait_seconds
        self.retry_after_seconds = retry_after_seconds
        self.poll_seconds = poll_seconds
        self._queues: dict[ModelId, _ModelQueue] = {}
        self._ready_capacity: dict[RunnerId, int] = {}
        self._released: anyio.Event | None = None

    def capacity(self, state: State, model: ModelId) -> tuple[int, int]:
        """(batch capacity, queue) summed over the instances of `model` that can serve (not
        unavailable). An instance's capacity is its rank-0 runner's
        `max_concurrent_requests` (the last one it reported while ready when it is
        running now; 1 while it is still loading).

        When every instance of the model is unavailable (a lost node's instance waiting to
        be re-placed under the same id), they all count as they were: their requests go on
        and wait, holding their place, until the re-placed instance serves them
        (`accepted_generation.Generation.submit`, `REPLACEMENT_WAIT_SECONDS`), instead of
        waiting here for a place that cannot free and failing with "busy"."""
        instances = state.instances_of_model(model)
        serving = [i for i in instances if i.instance_id not in state.unavailable_instances]
        running, queued = 0, 0
        for instance in serving or instances:
            rank_zero = instance.shard_assignments.rank_zero_runner()
            status = state.runners.get(rank_zero)
            capacity = 1
            if isinstance(status, RunnerReady):
                capacity = self._ready_capacity[rank_zero] = status.max_concurrent_requests
            elif isinstance(status, RunnerRunning):
                capacity = max(
                    status.max_concurrent_requests, self._ready_capacity.get(rank_zero, 1)
                )
            running += capacity
            queued += (
                max(DEFAULT_MIN_QUEUE, DEFAULT_QUEUE_BATCHES * capacity)
                if self.max_queued_requests is None
                else self.max_queued_requests
            )
        return running, queued

    def limit(self, state: State, model: ModelId) -> int:
        """How many of this node's generations of `model` may be in flight now."""
        running, queued = self.capacity(state, model)
        return running + queued

    def in_flight(self, model: ModelId) -> int:
        """This node's admitted, unfinished generations of `model`."""
        queue = self._queues.get(model)
        return queue.in_flight if queue else 0

    def waiting(self, model: ModelId) -> int:
        """Requests for `model` waiting for a place."""
        queue = self._queues.get(model)
        return len(queue.waiting) if queue else 0

    async def admit(
        self, current_state: Callable[[], State], request: _Disconnectable, model: ModelId
    ) -> Callable[[], None]:
        """Take a place for one generation of `model`, waiting (first come first served)
        while every instance is full.

        Args:
            current_state: the cluster state now (read again while waiting).
            request: the HTTP request, to notice its client leaving.
            model: the model the generation runs on.

        Returns:
            The release of the place (idempotent): call it once the generation's response
            is finished or abandoned.

        Raises:
            QueueFullError: no place freed within `wait_seconds` (503, `Retry-After`).
            GenerationError: the client disconnected while waiting.
        """
        queue = self._queues.setdefault(model, _ModelQueue())
        if not queue.waiting and queue.in_flight < self.limit(current_state(), model):
            return self._take(queue)
        ticket = object()
        queue.waiting.append(ticket)
        deadline = anyio.current_time() + self.wait_seconds
        try:
            while True:
                limit = self.limit(current_state(), model)
                if queue.waiting[0] is ticket and queue.in_flight < limit:
                    queue.waiting.popleft()
                    self._notify()  # the next in line may fit too
                    return self._take(queue)
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    logger.info(
                        f"api: {model} is full ({queue.in_flight} in flight, limit {limit}, "
                        f"{len(queue.waiting)} waiting); answering 503"
                    )
                    raise QueueFullError(
                        f"every instance of {model} is busy: {queue.in_flight} requests "
                        f"from this node are running or queued (the limit is {limit}) and "
                        f"none finished within {self.wait_seconds:g} s; retry after "
                        f"{self.retry_after_seconds} s",
                        retry_after_seconds=self.retry_after_seconds,
                    )
                if await request.is_disconnected():
                    raise GenerationError("the client disconnected while waiting for a place")
                released = self._released_event()
                with anyio.move_on_after(min(self.poll_seconds, remaining)):
                    await released.wait()
        finally:
            if ticket in queue.waiting:
                queue.waiting.remove(ticket)
                self._notify()

    def _take(self, queue: _ModelQueue) -> Callable[[], None]:
        queue.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            queue.in_flight -= 1
            self._notify()

        return release

    def _released_event(self) -> anyio.Event:
        # Created on first use: an anyio.Event belongs to the running event loop.
        if self._released is None:
            self._released = anyio.Event()
        return self._released

    def _notify(self) -> None:
        """Wake every waiting request (each checks whether it is first and a place is free)."""
        if self._released is not None:
            self._released.set()
            self._released = None
