"""The cluster state: everything every node agrees on."""

from __future__ import annotations

from pydantic import Field

from exo.shared.types.common import (
    CommandId,
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadStatus, NodeInfo, TopologyEdge
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.tasks import ModelTask


class InstanceUsage(FrozenModel):
    """When an instance was last used and how long it may then stay idle."""

    last_used_at: float
    """Unix seconds (the master's wall clock)."""
    keep_alive_seconds: float | None = Field(ge=0)
    """Idle seconds before the instance is deleted; None: kept until deleted."""


class InstanceUnavailable(FrozenModel):
    """Why an instance serves no request right now (it lost a node)."""

    reason: str
    """For people and for the 503 requests get: "node X left; re-placing on Y"."""
    waiting_for_room: bool = False
    """No remaining node set has room: the master places it again when room appears."""


class LoadFailure(FrozenModel):
    """Why the master deleted an instance whose runners kept failing to load or warm up
    its model for a reason of the model's own (`RunnerFailed.permanent`): requests get a
    final error (500) naming it, not a 503 that clients retry into the same failure."""

    reason: str
    """The runner's message ("loading failed: tensor ... has shape ...")."""
    failed_at: float
    """Unix seconds (the master's wall clock) of the deletion."""


MAX_LOAD_FAILURES = 64
"""Models whose last load failure the state keeps (`State.load_failures`), the newest."""

MAX_COMMAND_OUTCOMES = 1000
"""Command answers the state keeps (`State.command_outcomes`), the newest. An API waits at
most 30 s for an answer; a busy cluster carries out far fewer than 1000 commands in that
time, and 1000 small records add about 200 KB to a snapshot."""


class CommandOutcome(FrozenModel):
    """How the master answered one command, as much as the API waiting for the answer
    needs to rebuild the answering event from its own command and the state
    (`exo.api.serving.command_outcomes`). Kept in the state so that a node that takes a snapshot
    in place of the events (`StateSnapshot`) still learns the answers inside it."""

    event_idx: int
    """The index of the answering event."""
    kind: str
    """The answering event's kind (`"InstanceCreated"`, `"CommandRejected"`, ...)."""
    instance_id: InstanceId | None = None
    """The instance created, deleted or used, or that the created task runs on."""
    task_id: TaskId | None = None
    """The task created (`TaskCreated`)."""
    origin: NodeId | None = None
    """A rejection's: the node that sent the command."""
    reason: str | None = None
    """A rejection's reason."""
    status_code: int | None = None
    """A rejection's HTTP status."""


class State(FrozenModel):
    """Built only by `apply()` over indexed events; `last_event_applied_idx` is -1 when
    no event has been applied."""

    instances: dict[InstanceId, Instance] = {}
    runners: dict[RunnerId, RunnerStatus] = {}
    runner_nodes: dict[RunnerId, NodeId] = {}
    tasks: dict[TaskId, ModelTask] = {}
    node_info: dict[NodeId, NodeInfo] = {}
    downloads: dict[NodeId, dict[ModelId, DownloadStatus]] = {}
    topology: dict[NodeId, dict[NodeId, TopologyEdge]] = {}
    """Edges by source, then sink."""
    instance_usage: dict[InstanceId, InstanceUsage] = {}
    """Last use and keep-alive of each instance (`InstanceUsed`)."""
    instance_failures: dict[InstanceId, int] = {}
    """Runner failures of each instance since it was last fully ready."""
    lost_nodes: tuple[NodeId, ...] = ()
    """Nodes whose link to the master dropped (`NodeLost`), until they return or time out."""
    unavailable_instances: dict[InstanceId, InstanceUnavailable] = {}
    """Instances that lost a node, until every runner of their new placement is ready."""
    custom_cards: dict[ModelId, ModelCard] = {}
    """Models added outside the catalog (`CustomModelAdded`), by id."""
    load_failures: dict[ModelId, LoadFailure] = {}
    """The last load failure of each model whose instance was deleted for it (at most
    `MAX_LOAD_FAILURES`, oldest first), until the model is added again, a node completes
    a download of it or an instance of it becomes ready (`exo.api.serving.load_on_request`
    decides how long it stops placements on request)."""
    history_id: str | None = None
    command_outcomes: dict[CommandId, CommandOutcome] = {}
    """The answers to the latest `MAX_COMMAND_OUTCOMES` commands, oldest first."""
    local_event_progress: dict[str, int] = {}
    """Highest `origin_idx` indexed per "node/session", so any master drops resends."""
    last_event_applied_idx: int = -1

    def instances_on_node(self, node_id: NodeId) -> list[Instance]:
        return [i for i in self.instances.values() if node_id in i.shard_assignments.node_to_runner]

    def instances_of_model(self, model_id: ModelId) -> list[Instance]:
        return [i for i in self.instances.values() if i.model_id == model_id]
