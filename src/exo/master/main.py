"""The master: the only writer of cluster history."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
from loguru import logger

from exo.master.decisions import events_for_command
from exo.master.event_log import EventLog
from exo.shared.apply import apply
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.events import Event, ForwarderEvent, IndexedEvent
from exo.shared.types.models import ModelCard
from exo.shared.types.state import State
from exo.utils.channels import Publisher, Subscription


class Master:
    """Turns commands and nodes' local events into indexed, persisted, published events.

    Every event gets the next index, is appended (fsynced) to the event log, applied to
    the master's state, then published on the global events topic — in that order, so
    nothing is published that a restart would forget.
    """

    def __init__(
        self,
        node_id: NodeId,
        state: State,
        event_log: EventLog,
        command_subscription: Subscription[ForwarderCommand],
        local_event_subscription: Subscription[ForwarderEvent],
        global_event_publisher: Publisher[IndexedEvent],
        cards: Mapping[ModelId, ModelCard],
    ) -> None:
        self.node_id = node_id
        self.state = state
        self._event_log = event_log
        self._commands = command_subscription
        self._local_events = local_event_subscription
        self._global_events = global_event_publisher
        self._cards = cards
        self._last_origin_idx: dict[NodeId, int] = {}

    def emit(self, events: Sequence[Event]) -> list[IndexedEvent]:
        """Index, persist, apply and publish `events` (in that order)."""
        if not events:
            return []
        first = self.state.last_event_applied_idx + 1
        indexed = [IndexedEvent(idx=first + i, event=e) for i, e in enumerate(events)]
        self._event_log.append(indexed)
        for indexed_event in indexed:
            self.state = apply(self.state, indexed_event)
            self._global_events.publish(indexed_event)
        return indexed

    async def run(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._command_loop)
            task_group.start_soon(self._local_event_loop)

    async def _command_loop(self) -> None:
        async for forwarded in self._commands:
            logger.debug(f"master: command {forwarded.command!r} from {forwarded.origin}")
            events = events_for_command(
                self.state, forwarded.origin, forwarded.command, self._cards
            )
            self.emit(events)

    async def _local_event_loop(self) -> None:
        async for forwarded in self._local_events:
            last = self._last_origin_idx.get(forwarded.origin, -1)
            if forwarded.origin_idx <= last:
                continue  # a resend of an event already indexed
            self._last_origin_idx[forwarded.origin] = forwarded.origin_idx
            self.emit([forwarded.event])
