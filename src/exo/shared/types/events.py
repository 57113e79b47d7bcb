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
from exo.shared.types.instances import Instance
from exo.shared.types.nodes import DownloadStatus, NodeInfo
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.tasks import TaskStatus, TextGeneration


class InstanceCreated(FrozenModel):
    kind: Literal["InstanceCreated"] = "InstanceCreated"
    instance: Instance
    command_id: CommandId | None = None


class InstanceDeleted(FrozenModel):
    kind: Literal["InstanceDeleted"] = "InstanceDeleted"
    instance_id: InstanceId
    command_id: CommandId | None = None


class TaskCreated(FrozenModel):
    kind: Literal["TaskCreated"] = "TaskCreated"
    task: TextGeneration


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


class CommandRejected(FrozenModel):
    """The master could not carry out a command; the API that sent it reports `reason`."""

    kind: Literal["CommandRejected"] = "CommandRejected"
    command_id: CommandId
    origin: NodeId
    reason: str
    status_code: int = 400


Event = Annotated[
    InstanceCreated
    | InstanceDeleted
    | TaskCreated
    | TaskStatusUpdated
    | RunnerStatusUpdated
    | RunnerDeleted
    | NodeGatheredInfo
    | NodeDownloadProgress
    | CommandRejected,
    Field(discriminator="kind"),
]


class ForwarderEvent(FrozenModel):
    """A node's own (local) event on its way to the master. `origin_idx` counts that
    node's events so the master can drop resent duplicates."""

    origin: NodeId
    origin_idx: int = Field(ge=0)
    event: Event


class IndexedEvent(FrozenModel):
    """An event with its place in the cluster's history (0, 1, 2, ... with no gaps)."""

    idx: int = Field(ge=0)
    event: Event
