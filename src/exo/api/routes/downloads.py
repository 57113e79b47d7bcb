"""A model's files on one node: start, cancel or delete its download.

`POST /download/start` and `POST /download/cancel` take `{"model", "node_id"}` (the node
defaults to the one asked); `DELETE /download/{node_id}/{model_id}` removes the files from
that node's writable models directories. Each is a command to the master, which refuses an
unknown node (404) and a delete while an instance has a shard there (409); the node's worker
carries it out and reports the files, and a download's progress (bytes, speed, ETA per
file and in total), as `downloads` in `GET /state`. Errors are OpenAI's shape.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from exo.api.routes.custom_models import ModelConflictError
from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.model_lookup import Cluster, card_of, resolve_model_id
from exo.api.wire.errors import ApiError, InvalidRequestError, ModelNotFoundError
from exo.shared.types.commands import ControlDownload
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.downloads import DownloadAction
from exo.shared.types.events import DownloadControlled
from exo.shared.types.models import ModelCard

router = APIRouter()


class NodeNotFoundError(ApiError):
    status_code = 404
    error_type = "invalid_request_error"


def _refusal(message: str, status_code: int) -> ApiError:
    match status_code:
        case 404:
            return NodeNotFoundError(message, param="node_id", code="node_not_found")
        case 409:
            return ModelConflictError(message, param="model")
        case _:
            return InvalidRequestError(message)


class DownloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="model id or short name")
    node_id: str | None = Field(default=None, description="default: the node asked")


class DownloadControlResponse(BaseModel):
    node_id: str
    model_id: str
    action: DownloadAction


@router.post("/download/start")
async def start_download(body: DownloadRequest, cluster: Cluster) -> DownloadControlResponse:
    """Fetch every file of the model onto the node (its progress goes into the state)."""
    return await _control(cluster, body.model, body.node_id, "start")


@router.post("/download/cancel")
async def cancel_download(body: DownloadRequest, cluster: Cluster) -> DownloadControlResponse:
    """Stop the model's download on the node; its partial files stay for a later resume."""
    return await _control(cluster, body.model, body.node_id, "cancel")


@router.delete("/download/{node_id}/{model_id:path}")
async def delete_download(node_id: str, model_id: str, cluster: Cluster) -> DownloadControlResponse:
    """Remove the model's files from the node's writable models directories."""
    return await _control(cluster, model_id, node_id, "delete")


def _card(cluster: ClusterClient, name: str) -> ModelCard:
    model_id = resolve_model_id(cluster, name)
    card = card_of(cluster, model_id) if model_id is not None else None
    if card is None:
        raise ModelNotFoundError(f"model '{name}' not found", param="model")
    return card


async def _control(
    cluster: ClusterClient, name: str, node_id: str | None, action: DownloadAction
) -> DownloadControlResponse:
    card = _card(cluster, name)
    target = NodeId(node_id) if node_id else cluster.node_id
    if action == "start" and target == cluster.node_id and cluster.load_on_request.offline:
        raise _refusal(
            f"this node runs with --offline and downloads nothing: put {card.model_id}'s "
            "files in one of its models directories, or add a local path with "
            "POST /models/add",
            409,
        )
    command = ControlDownload(command_id=CommandId.new(), node_id=target, card=card, action=action)
    try:
        event = await cluster.submit(command)
    except CommandRejectedError as error:
        raise _refusal(error.reason, error.status_code) from None
    assert isinstance(event, DownloadControlled)
    return DownloadControlResponse(
        node_id=event.node_id, model_id=event.card.model_id, action=event.action
    )
