"""Tasks: what a worker's `plan()` decides to do next, and generation tasks the master
creates from API commands. Only `TextGeneration` and `Embedding` tasks (`ModelTask`) live in
the cluster state."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import CommandId, FrozenModel, InstanceId, NodeId, RunnerId, TaskId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams


class TaskPending(FrozenModel):
    kind: Literal["TaskPending"] = "TaskPending"


class TaskRunning(FrozenModel):
    kind: Literal["TaskRunning"] = "TaskRunning"


class TaskComplete(FrozenModel):
    kind: Literal["TaskComplete"] = "TaskComplete"


class TaskFailed(FrozenModel):
    kind: Literal["TaskFailed"] = "TaskFailed"
    error_message: str


class TaskCancelled(FrozenModel):
    kind: Literal["TaskCancelled"] = "TaskCancelled"


TaskStatus = Annotated[
    TaskPending | TaskRunning | TaskComplete | TaskFailed | TaskCancelled,
    Field(discriminator="kind"),
]

TERMINAL_TASK_STATUSES = (TaskComplete, TaskFailed, TaskCancelled)


class CreateRunner(FrozenModel):
    """Spawn the runner subprocess for this node's shard of an instance."""

    kind: Literal["CreateRunner"] = "CreateRunner"
    instance_id: InstanceId
    runner_id: RunnerId


class DownloadModel(FrozenModel):
    """Fetch (and convert if needed) the files of a shard onto this node."""

    kind: Literal["DownloadModel"] = "DownloadModel"
    instance_id: InstanceId
    shard: ShardMetadata


class ConnectToGroup(FrozenModel):
    """Join the instance's torch.distributed group (every rank at once): rank 0 listens
    on `master_port`, the others reach it at `master_addr`; `link_addresses[rank]`: where
    this rank reaches that lower rank other than 0 (`Rendezvous.link_addresses`; a rank
    missing: at the address it published)."""

    kind: Literal["ConnectToGroup"] = "ConnectToGroup"
    instance_id: InstanceId
    runner_id: RunnerId
    backend: Literal["gloo", "nccl"]
    master_addr: str
    master_port: int = Field(gt=0, lt=65536)
    link_addresses: dict[int, str] = Field(default_factory=dict)


class LoadModel(FrozenModel):
    """Load the shard from `model_dir` (an HF-format directory on this node)."""

    kind: Literal["LoadModel"] = "LoadModel"
    instance_id: InstanceId
    runner_id: RunnerId
    model_dir: str


class StartWarmup(FrozenModel):
    kind: Literal["StartWarmup"] = "StartWarmup"
    instance_id: InstanceId
    runner_id: RunnerId


class TextGeneration(FrozenModel):
    """Generate for one API command. Created by the master, forwarded by workers."""

    kind: Literal["TextGeneration"] = "TextGeneration"
    task_id: TaskId
    command_id: CommandId
    instance_id: InstanceId
    origin_node_id: NodeId
    params: TextGenerationTaskParams
    status: TaskStatus = TaskPending()


class Embedding(FrozenModel):
    """Embed or rerank for one API command (`ComputeEmbeddings`): answered in one
    `EmbeddingChunk`. Created by the master, forwarded by workers like `TextGeneration`."""

    kind: Literal["Embedding"] = "Embedding"
    task_id: TaskId
    command_id: CommandId
    instance_id: InstanceId
    origin_node_id: NodeId
    params: EmbeddingTaskParams
    status: TaskStatus = TaskPending()


ModelTask = Annotated[TextGeneration | Embedding, Field(discriminator="kind")]
"""A request a model instance serves: the tasks the cluster state holds."""


class CancelTask(FrozenModel):
    """Stop a generation that the runner is running or holds queued."""

    kind: Literal["CancelTask"] = "CancelTask"
    runner_id: RunnerId
    task_id: TaskId


class Shutdown(FrozenModel):
    """Stop and remove a runner (its instance is gone, or it failed)."""

    kind: Literal["Shutdown"] = "Shutdown"
    runner_id: RunnerId


Task = Annotated[
    CreateRunner
    | DownloadModel
    | ConnectToGroup
    | LoadModel
    | StartWarmup
    | TextGeneration
    | Embedding
    | CancelTask
    | Shutdown,
    Field(discriminator="kind"),
]
