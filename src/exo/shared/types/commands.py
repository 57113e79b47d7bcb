"""Commands: requests to change the cluster, sent by an API to the master."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import CommandId, FrozenModel, InstanceId, ModelId, NodeId
from exo.shared.types.downloads import DownloadAction
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.instances import Sharding
from exo.shared.types.models import ModelCard
from exo.shared.types.text_generation import TextGenerationTaskParams


class KeepAlive(FrozenModel):
    """How long an instance stays after its last use (Ollama's `keep_alive`)."""

    seconds: float | None = Field(ge=0)
    """Idle seconds before the instance is deleted (0: as soon as it is idle); None: kept
    until deleted."""


class PlaceInstance(FrozenModel):
    kind: Literal["PlaceInstance"] = "PlaceInstance"
    command_id: CommandId
    model_id: ModelId
    sharding: Sharding = "pipeline"
    min_nodes: int = Field(default=1, ge=1)
    node_ids: tuple[NodeId, ...] | None = None
    only_if_cluster_empty: bool = False
    """Place only when the cluster has no instance at all (a node's default model)."""
    on_request: bool = False
    """Placed because a request named a model with no instance (load on request): refused
    (409) when the model already has an instance, so racing API nodes place it once, and
    a lack of memory is a 503."""
    keep_alive: KeepAlive | None = None
    """How long the instance stays once idle; None: until deleted."""


class DeleteInstance(FrozenModel):
    kind: Literal["DeleteInstance"] = "DeleteInstance"
    command_id: CommandId
    instance_id: InstanceId


MAX_GENERATION_BYTES = 24 * 2**20
"""The largest `GenerateText` (its JSON, in bytes) the master carries out: its request is
copied into a `TaskCreated` event that every node keeps in its event log, so a bigger one
is rejected (413) and never logged. The API refuses such requests first, by the model's
context length (`exo.api.serving.prompt_size`). 24 MiB: 256 bytes per token of a 98K context,
32 of a 786K one."""


class GenerateText(FrozenModel):
    kind: Literal["GenerateText"] = "GenerateText"
    command_id: CommandId
    params: TextGenerationTaskParams
    keep_alive: KeepAlive | None = None
    """The instance's keep-alive from this request on; None leaves it as it is."""
    instance_id: InstanceId | None = None
    """The instance that must run it (the API's `X-Exo-Instance` header); None: the master
    chooses among the model's instances (`exo.master.decisions.choose_instance`)."""


class ComputeEmbeddings(FrozenModel):
    """Embed or rerank `params` on an instance of its model (`GenerateText`'s sibling: the
    same choice of instance, refusals and keep-alive); answered in one `EmbeddingChunk`."""

    kind: Literal["ComputeEmbeddings"] = "ComputeEmbeddings"
    command_id: CommandId
    params: EmbeddingTaskParams
    keep_alive: KeepAlive | None = None
    instance_id: InstanceId | None = None


class SetKeepAlive(FrozenModel):
    """Set the keep-alive of every instance of `model_id` (Ollama's load and unload
    requests: no prompt, only `keep_alive`); rejected (404) when it has none."""

    kind: Literal["SetKeepAlive"] = "SetKeepAlive"
    command_id: CommandId
    model_id: ModelId
    keep_alive: KeepAlive


class AddCustomModel(FrozenModel):
    """Make a model outside the catalog known to every node; `card` was built by the API
    node from the repository's small files. Rejected (409) for a catalog model's id."""

    kind: Literal["AddCustomModel"] = "AddCustomModel"
    command_id: CommandId
    card: ModelCard


class DeleteCustomModel(FrozenModel):
    """Forget a custom model. Rejected for a catalog model (400), an unknown one (404)
    and one with a placed instance (409)."""

    kind: Literal["DeleteCustomModel"] = "DeleteCustomModel"
    command_id: CommandId
    model_id: ModelId


class ControlDownload(FrozenModel):
    """Start, cancel or delete the download of `card`'s model on `node_id` (`POST
    /download/start`, `POST /download/cancel`, `DELETE /download/{node_id}/{model_id}`).
    Rejected for a node the cluster does not know (404) and, for "delete", while an
    instance of the model has a shard on that node (409)."""

    kind: Literal["ControlDownload"] = "ControlDownload"
    command_id: CommandId
    node_id: NodeId
    card: ModelCard
    action: DownloadAction


class CancelGeneration(FrozenModel):
    """Stop the generation started by `target_command_id` (client gone or asked)."""

    kind: Literal["CancelGeneration"] = "CancelGeneration"
    command_id: CommandId
    target_command_id: CommandId


# The most events a master publishes again for one `RequestEventReplay`.
REPLAY_BATCH = 500


class RequestEventReplay(FrozenModel):
    """A node missed indexed events: the master publishes `[from_idx, from_idx +
    REPLAY_BATCH)` again."""

    kind: Literal["RequestEventReplay"] = "RequestEventReplay"
    command_id: CommandId
    from_idx: int = Field(ge=0)


Command = Annotated[
    PlaceInstance
    | DeleteInstance
    | GenerateText
    | ComputeEmbeddings
    | SetKeepAlive
    | CancelGeneration
    | RequestEventReplay
    | AddCustomModel
    | DeleteCustomModel
    | ControlDownload,
    Field(discriminator="kind"),
]


class ForwarderCommand(FrozenModel):
    """A command with the node it came from, as sent on the commands topic."""

    origin: NodeId
    command: Command
