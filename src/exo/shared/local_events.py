"""A node's outgoing local events, numbered so the master can drop duplicates."""

from __future__ import annotations

import itertools

from exo.shared.types.common import NodeId
from exo.shared.types.events import Event, ForwarderEvent
from exo.utils.channels import Publisher


class LocalEventSender:
    """Shared by every component of one node: one counter, one order."""

    def __init__(self, node_id: NodeId, publisher: Publisher[ForwarderEvent]) -> None:
        self.node_id = node_id
        self._publisher = publisher
        self._counter = itertools.count()

    def emit(self, event: Event) -> None:
        self._publisher.publish(
            ForwarderEvent(origin=self.node_id, origin_idx=next(self._counter), event=event)
        )
