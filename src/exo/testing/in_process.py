"""A one-node cluster in one process for component tests: a real `Master` and a real
`ClusterClient` joined by in-process topics, with a minimal replica between them.

The master acts only while `active` is set, as a node's master does only once its
election is won; `report_node` stands in for a node's info gatherer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from exo.api.serving.cluster_client import ClusterClient, LoadOnRequest
from exo.api.serving.command_delivery import RESEND_FIRST_SECONDS
from exo.master.main import Master
from exo.node.event_log import EventLog
from exo.shared.apply import apply
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.events import Event, ForwarderEvent, IndexedEvent, NodeGatheredInfo
from exo.shared.types.models import ModelCard
from exo.shared.types.state import State
from exo.testing.builders import make_card, make_node_info
from exo.utils.channels import Subscription, Topic

NODE = NodeId("node-1")
SESSION = "session-1"


@dataclass
class InProcessCluster:
    """The topics of one node, its master, its replica's state and its cluster client."""

    client: ClusterClient
    master: Master
    event_log: EventLog
    commands: Topic[ForwarderCommand]
    local_events: Topic[ForwarderEvent]
    chunks: Topic[Chunk]
    """Where a stand-in runner publishes the chunks of the client's generations."""
    state: State = field(default_factory=State)
    active: bool = True
    applied: Topic[IndexedEvent] | None = None
    """The events as this node's replica applied them (what a worker subscribes to)."""
    _next_local_idx: int = 0

    def report_node(self, available_mb: int = 4096, node_id: NodeId = NODE) -> None:
        """Publish the node's resources as its info gatherer does."""
        self.emit_local(NodeGatheredInfo(node_id=node_id, info=make_node_info(available_mb)))

    def emit_local(self, event: Event) -> None:
        self.local_events.publish(
            ForwarderEvent(
                origin=NODE, origin_session=SESSION, origin_idx=self._next_local_idx, event=event
            )
        )
        self._next_local_idx += 1

    def logged_events(self) -> list[Event]:
        """Every event of the master's log, in index order."""
        return [indexed_event.event for indexed_event in self.event_log.events]


@asynccontextmanager
async def in_process_cluster(
    tmp_path: Path,
    active: bool = True,
    cards: Mapping[ModelId, ModelCard] | None = None,
    resend_first_seconds: float = RESEND_FIRST_SECONDS,
    load_on_request: LoadOnRequest | None = None,
) -> AsyncIterator[InProcessCluster]:
    """Run a master, a replica loop and a cluster client until the block ends.

    Args:
        active: whether the master acts from the start (set `cluster.active` later).
        cards: model cards by model id; default the built-in SmolLM2 card.
        load_on_request: the API's load-on-request settings (`ClusterClient`'s).
    """
    card = make_card()
    known_cards = {card.model_id: card} if cards is None else cards
    commands: Topic[ForwarderCommand] = Topic("commands")
    local_events: Topic[ForwarderEvent] = Topic("local_events")
    global_events: Topic[IndexedEvent] = Topic("global_events")
    applied: Topic[IndexedEvent] = Topic("applied_events")
    chunks: Topic[Chunk] = Topic("chunks")
    event_log = EventLog(tmp_path / "event_log.jsonl")
    event_log.read_all()
    holder: list[InProcessCluster] = []
    master = Master(
        node_id=NODE,
        state=State(),
        event_log=event_log,
        command_subscription=commands.subscribe(),
        local_event_subscription=local_events.subscribe(),
        global_event_publisher=global_events.sender(),
        cards=known_cards,
        is_active=lambda: holder[0].active,
        current_state=lambda: holder[0].state,
    )
    client = ClusterClient(
        node_id=NODE,
        current_state=lambda: holder[0].state,
        applied_events=applied.subscribe(),
        chunk_subscription=chunks.subscribe(),
        command_publisher=commands.sender(),
        cards=known_cards,
        resend_first_seconds=resend_first_seconds,
        load_on_request=load_on_request,
        storage_problem=event_log.space.problem,
    )
    cluster = InProcessCluster(
        client, master, event_log, commands, local_events, chunks, active=active, applied=applied
    )
    holder.append(cluster)

    async def replicate(received: Subscription[IndexedEvent]) -> None:
        # The master publishes in index order and in-process topics keep it.
        async for indexed_event in received:
            cluster.state = apply(cluster.state, indexed_event)
            applied.publish(indexed_event)

    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(replicate, global_events.subscribe())
            task_group.start_soon(master.run)
            task_group.start_soon(client.run)
            yield cluster
            task_group.cancel_scope.cancel()
    finally:
        event_log.close()
