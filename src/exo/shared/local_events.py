"""A node's outgoing local events, numbered so the master indexes each exactly once."""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence

import anyio
from pydantic import TypeAdapter

from exo.shared.types.common import NodeId
from exo.shared.types.events import Event, ForwarderEvent, IndexedEvent
from exo.utils.channels import Publisher

RESEND_AFTER_SECONDS = 1.0
EMITTED_KEPT = 10_000
"""Events this process sent, the newest, kept to send again if the history that indexed them
is dropped (`LocalEventSender.restart_session`). Held as their JSON, decoded only then: a
task's status update (a serving node emits ~1.7 a request) takes ~150 bytes so, ~1.2 KB as an
event object, so a full deque of them holds ~1.5 MB, not ~12 MB
(docs/benchmarks/2026-12-07-node-memory.md)."""
_EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


class LocalEventSender:
    """Shared by every component of one node: one counter, one order.

    Each event is resent (in order, with everything after it) until it comes back in the
    indexed stream, so events sent while there is no master are not lost.
    """

    def __init__(
        self,
        node_id: NodeId,
        publisher: Publisher[ForwarderEvent],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_id = node_id
        self.session = uuid.uuid4().hex
        self._publisher = publisher
        self._now = clock
        self._next_idx = 0
        self._unacknowledged: dict[int, tuple[ForwarderEvent, float]] = {}
        self._emitted: deque[bytes] = deque(maxlen=EMITTED_KEPT)  # each an event's JSON
        self._emitted_wake: anyio.Event | None = None
        """Set by `emit`, to wake `run` from its wait while nothing is unacknowledged."""

    def emit(self, event: Event) -> None:
        self._emitted.append(_EVENT_ADAPTER.dump_json(event))
        forwarded = ForwarderEvent(
            origin=self.node_id, origin_session=self.session, origin_idx=self._next_idx, event=event
        )
        self._next_idx += 1
        self._unacknowledged[forwarded.origin_idx] = (forwarded, self._now())
        self._publisher.publish(forwarded)
        if self._emitted_wake is not None:
            self._emitted_wake.set()

    def restart_session(self, then: Sequence[Event] = ()) -> None:
        """Start numbering again under a new session and send this process's events once
        more, in order, followed by `then`: the history that had indexed them was
        discarded. (Events set state — statuses, node info — so sending them again ends in
        the same state.)"""
        emitted = [*map(_EVENT_ADAPTER.validate_json, self._emitted), *then]
        self.session = uuid.uuid4().hex
        self._next_idx = 0
        self._unacknowledged.clear()
        self._emitted.clear()
        for event in emitted:
            self.emit(event)

    def acknowledge(self, indexed_event: IndexedEvent) -> None:
        if indexed_event.origin != self.node_id or indexed_event.origin_session != self.session:
            return
        assert indexed_event.origin_idx is not None
        for origin_idx in [i for i in self._unacknowledged if i <= indexed_event.origin_idx]:
            del self._unacknowledged[origin_idx]

    def acknowledge_through(self, origin_idx: int) -> None:
        """Every event of this session up to `origin_idx` is indexed (a snapshot says so)."""
        for idx in [i for i in self._unacknowledged if i <= origin_idx]:
            del self._unacknowledged[idx]

    def pending(self) -> list[Event]:
        """The events sent and not yet indexed, in order."""
        return [self._unacknowledged[i][0].event for i in sorted(self._unacknowledged)]

    @property
    def unacknowledged(self) -> int:
        return len(self._unacknowledged)

    def resend_overdue(self) -> int:
        """Resend, in order, every event not indexed within `RESEND_AFTER_SECONDS`."""
        now = self._now()
        if not any(now - sent >= RESEND_AFTER_SECONDS for _, sent in self._unacknowledged.values()):
            return 0
        for origin_idx in sorted(self._unacknowledged):
            forwarded, _ = self._unacknowledged[origin_idx]
            self._unacknowledged[origin_idx] = (forwarded, now)
            self._publisher.publish(forwarded)
        return len(self._unacknowledged)

    async def run(self) -> None:
        """Look for overdue events every `RESEND_AFTER_SECONDS / 2` while some are not
        indexed yet; with none, sleep until the next is emitted."""
        while True:
            if not self._unacknowledged:
                self._emitted_wake = anyio.Event()
                await self._emitted_wake.wait()
            await anyio.sleep(RESEND_AFTER_SECONDS / 2)
            self.resend_overdue()
