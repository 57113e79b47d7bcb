"""Events: facts about the cluster, in past tense. The master indexes them; every node
applies them in index order to get the same `State`."""

from __future__ import annotations

from typing import Annotated, Literal

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
from exo.shared.types.downloads import DownloadAction
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadStatus, NodeInfo, TopologyEdge
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.state import InstanceUsage, LoadFailure, State
from exo.shared.types.tasks import ModelTask, TaskStatus


class InstanceCreated(FrozenModel):
    kind: Literal["InstanceCreated"] = "InstanceCreated"
    instance: Instance
    command_id: CommandId | None = None


class InstanceDeleted(FrozenModel):
    """An instance was deleted: by a command (`command_id`), for idling, or by the master
    after its runners failed `MAX_INSTANCE_FAILURES` times, with `load_failure` set when
    a failure was the model's own (loading it again would fail the same way)."""

    kind: Literal["InstanceDeleted"] = "InstanceDeleted"
    instance_id: InstanceId
    command_id: CommandId | None = None
    load_failure: LoadFailure | None = Field(
        default=None, exclude_if=lambda failure: failure is None
    )
    """Left out of the JSON when None, so the records of older versions, which lack it,
    keep their bytes (and `event_digest`)."""


class InstanceUsed(FrozenModel):
    """An instance was placed, became ready, started or finished a generation, or had its
    keep-alive set (`command_id` then names the command): the master's wall clock then,
    and the keep-alive from then on. What idle unloading decides from
    (`exo.master.keep_alive`)."""

    kind: Literal["InstanceUsed"] = "InstanceUsed"
    instance_id: InstanceId
    used_at: float
    """Unix seconds."""
    keep_alive_seconds: float | None = Field(ge=0)
    """Idle seconds before the instance is deleted; None: kept until deleted."""
    command_id: CommandId | None = None


class TaskCreated(FrozenModel):
    kind: Literal["TaskCreated"] = "TaskCreated"
    task: ModelTask


class TaskStatusUpdated(FrozenModel):
    """A terminal status (complete, failed, cancelled) also removes the task from state."""

    kind: Literal["TaskStatusUpdated"] = "TaskStatusUpdated"
    task_id: TaskId
    status: TaskStatus


class RunnerStatusUpdated(FrozenModel):
    kind: Literal["RunnerStatusUpdated"] = "RunnerStatusUpdated"
    runner_id: RunnerId
    node_id: NodeId
    status: RunnerStatus


class RunnerDeleted(FrozenModel):
    kind: Literal["RunnerDeleted"] = "RunnerDeleted"
    runner_id: RunnerId


class NodeGatheredInfo(FrozenModel):
    kind: Literal["NodeGatheredInfo"] = "NodeGatheredInfo"
    node_id: NodeId
    info: NodeInfo


class NodeDownloadProgress(FrozenModel):
    kind: Literal["NodeDownloadProgress"] = "NodeDownloadProgress"
    node_id: NodeId
    model_id: ModelId
    status: DownloadStatus


class ClusterHistoryStarted(FrozenModel):
    """Always event 0: names this history, so a node holding another cluster's log can
    tell that it must start over when it joins this one."""

    kind: Literal["ClusterHistoryStarted"] = "ClusterHistoryStarted"
    history_id: str
    master: NodeId


class NodeTimedOut(FrozenModel):
    """The master heard nothing from `node_id` for the timeout: its info, edges, runners
    and the instances using it are removed."""

    kind: Literal["NodeTimedOut"] = "NodeTimedOut"
    node_id: NodeId


class NodeLost(FrozenModel):
    """The master's link to `node_id` dropped (zenoh liveliness, about a second after a
    process dies): its instances stop receiving requests at once. Its info stays until
    it returns (`NodeRejoined`) or times out (`NodeTimedOut`)."""

    kind: Literal["NodeLost"] = "NodeLost"
    node_id: NodeId


class NodeRejoined(FrozenModel):
    """A lost node's link came back: it can be placed on again."""

    kind: Literal["NodeRejoined"] = "NodeRejoined"
    node_id: NodeId


class InstanceReplaced(FrozenModel):
    """An instance that lost a node was placed again on nodes that remain: same id, same
    model and sharding, new runners (the old ones are gone or shut down). It serves again
    once every new runner is ready."""

    kind: Literal["InstanceReplaced"] = "InstanceReplaced"
    instance: Instance
    reason: str
    """What happened, for people: "node X left; re-placed on Y"."""


class InstanceUnplaced(FrozenModel):
    """An instance lost a node and the remaining nodes have no room for it: it keeps its
    id and waits (`State.unavailable_instances` says why) until room appears."""

    kind: Literal["InstanceUnplaced"] = "InstanceUnplaced"
    instance_id: InstanceId
    reason: str


class TopologyEdgeMeasured(FrozenModel):
    kind: Literal["TopologyEdgeMeasured"] = "TopologyEdgeMeasured"
    edge: TopologyEdge


class TopologyEdgeRemoved(FrozenModel):
    kind: Literal["TopologyEdgeRemoved"] = "TopologyEdgeRemoved"
    source: NodeId
    sink: NodeId


class CustomModelAdded(FrozenModel):
    """A model outside the catalog became known to the cluster (`POST /models/add`): its
    card, built once by the API node that was asked, replaces any earlier one of that id."""

    kind: Literal["CustomModelAdded"] = "CustomModelAdded"
    card: ModelCard
    command_id: CommandId | None = None


class CustomModelDeleted(FrozenModel):
    kind: Literal["CustomModelDeleted"] = "CustomModelDeleted"
    model_id: ModelId
    command_id: CommandId | None = None


class DownloadControlled(FrozenModel):
    """`node_id` was asked to start, cancel or delete the download of `card`'s model; its
    worker does it and reports the files as `NodeDownloadProgress`."""

    kind: Literal["DownloadControlled"] = "DownloadControlled"
    node_id: NodeId
    card: ModelCard
    action: DownloadAction
    command_id: CommandId | None = None


class CommandRejected(FrozenModel):
    """The master could not carry out a command; the API that sent it reports `reason`."""

    kind: Literal["CommandRejected"] = "CommandRejected"
    command_id: CommandId
    origin: NodeId
    reason: str
    status_code: int = 400


class StateSnapshot(FrozenModel):
    """The whole cluster state after the event at the carrying `IndexedEvent.idx`.

    Never written to the event log: the master sends it to a node that asks for events
    it has compacted away (`exo.node.event_log`), followed by the events after it, so a
    node joining a long history applies one snapshot and a short tail."""

    kind: Literal["StateSnapshot"] = "StateSnapshot"
    state: State
    last_event_digest: str | None = None
    """`event_digest` of the event at the snapshot's index (None when unknown)."""


class InstanceReported(FrozenModel):
    """A node still runs `instance` after it dropped its history for the cluster's (a
    healed network split whose other side won the election): the instance is added
    back, with the runner statuses the node last knew, unless the cluster's history
    already holds an instance of that id or one of its runner ids."""

    kind: Literal["InstanceReported"] = "InstanceReported"
    node_id: NodeId
    instance: Instance
    runners: dict[RunnerId, RunnerStatus]
    """The statuses of the instance's runners in the dropped history."""
    usage: InstanceUsage | None = None


Event = Annotated[
    InstanceCreated
    | InstanceDeleted
    | InstanceUsed
    | TaskCreated
    | TaskStatusUpdated
    | RunnerStatusUpdated
    | RunnerDeleted
    | NodeGatheredInfo
    | NodeDownloadProgress
    | CustomModelAdded
    | CustomModelDeleted
    | DownloadControlled
    | CommandRejected
    | ClusterHistoryStarted
    | NodeTimedOut
    | NodeLost
    | NodeRejoined
    | InstanceReplaced
    | InstanceUnplaced
    | TopologyEdgeMeasured
    | TopologyEdgeRemoved
    | StateSnapshot
    | InstanceReported,
    Field(discriminator="kind"),
]


class ForwarderEvent(FrozenModel):
    """A node's own (local) event on its way to the master. `origin_idx` counts the
    events of one process (`origin_session`) from 0, so the master indexes each exactly
    once and in order, however often it is resent."""

    origin: NodeId
    origin_session: str
    origin_idx: int = Field(ge=0)
    event: Event


class IndexedEvent(FrozenModel):
    """An event with its place in the cluster's history (0, 1, 2, ... with no gaps).
    Local events keep their origin, so the sender knows it arrived."""

    idx: int = Field(ge=0)
    event: Event
    origin: NodeId | None = None
    origin_session: str | None = None
    origin_idx: int | None = None
    published_by: NodeId | None = None
    """The master that sent this copy (live or replayed), stamped as it is published so
    a node applies only what the master it follows sends (`exo.node.replica`). Not part
    of the history: the event log and `event_digest` leave it out."""
