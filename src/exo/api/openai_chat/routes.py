"""OpenAI Chat Completions: `POST /v1/chat/completions`, `GET /v1/models` (what can be
served now), `GET /v1/models/{id}` (any known model, by id or short name; ids contain a
slash, sent plain or as `%2F`), and `POST /v1/cancel/{id}` (cancel any dialect's generation
by its response or command id).

A short model name (`qwen3:0.6b`) is resolved to the catalog id before the request is
converted; responses name that id, as OpenAI's name the snapshot an alias resolved to."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from exo.api.openai_chat.request import to_task_params
from exo.api.openai_chat.response import collect_chat_completion, stream_chat_completion
from exo.api.openai_chat.wire_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelList,
    ModelObject,
)
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.early_stream import WaitingFrames
from exo.api.serving.generation import convert_request
from exo.api.serving.model_files import files_modified_ns
from exo.api.serving.model_lookup import (
    Cluster,
    card_of,
    resolve_model_id,
    servable_model_ids,
)
from exo.api.serving.response_ids import command_id_in_response_id
from exo.api.wire.errors import ApiError, ModelNotFoundError
from exo.api.wire.openai_sse import openai_error_events
from exo.shared.types.commands import CancelGeneration
from exo.shared.types.common import CommandId, ModelId

router = APIRouter()


class GenerationNotFoundError(ApiError):
    status_code = 404
    error_type = "invalid_request_error"


def _model_object(cluster: ClusterClient, model_id: str) -> ModelObject:
    """The model as `/v1/models` and `/v1/models/{id}` both describe it. `created` (Unix
    seconds) is when its files on this node were written (downloaded, converted or added:
    the time Ollama's `modified_at` gives too); 0, the Unix epoch, where this node holds no
    copy (exo does not know when a model was published)."""
    card = card_of(cluster, ModelId(model_id))
    capabilities = list(card.capabilities) if card is not None else None
    modified_ns = files_modified_ns(cluster, card) if card is not None else None
    created = 0 if modified_ns is None else modified_ns // 1_000_000_000
    return ModelObject(id=model_id, created=created, owned_by="exo", capabilities=capabilities)


@router.get("/v1/models")
async def list_models(cluster: Cluster) -> ModelList:
    """Models the cluster can serve now: placed ones, then downloaded catalog models (the
    whole catalog is `GET /models`)."""
    return ModelList(
        data=[_model_object(cluster, model_id) for model_id in servable_model_ids(cluster)]
    )


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, cluster: Cluster) -> ModelObject:
    """One known model (catalog or placed) by id or short name; 404 in OpenAI's error shape
    when the cluster knows no such model."""
    resolved = resolve_model_id(cluster, model_id)
    if resolved is None and not model_id.startswith("/"):
        # `/v1/models/tmp/x.gguf` names the local model /tmp/x.gguf (the path converter
        # leaves out the slash after `models/`), as `DELETE /models/custom/tmp/x.gguf` does.
        resolved = resolve_model_id(cluster, f"/{model_id}")
    if resolved is None:
        raise ModelNotFoundError(f"The model '{model_id}' does not exist", code="model_not_found")
    return _model_object(cluster, resolved)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, cluster: Cluster
) -> ChatCompletionResponse | Response:
    converted = await convert_request(cluster, body, to_task_params, "chatcmpl-")
    params, completion_id, created = converted.params, converted.response_id, int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await converted.serve(
        request,
        render=lambda chunks: stream_chat_completion(
            chunks, completion_id=completion_id, model=params.model, created=created,
            include_usage=include_usage, params=params,
        ),
        collector=lambda chunks: collect_chat_completion(
            chunks, completion_id=completion_id, model=params.model, created=created, params=params
        ),
        waiting=WaitingFrames(failure=openai_error_events),
    )  # fmt: skip


@router.post("/v1/cancel/{generation_id}")
async def cancel_generation(generation_id: str, cluster: Cluster) -> dict[str, object]:
    """Stop a running or queued generation on every rank and free its slot.

    `generation_id` is the id of any dialect's response (`chatcmpl-…`, `msg_…`, `resp_…`)
    or the internal command id. A generation still waiting for its model's instance to be
    placed again ends as cancelled without being sent. 404 when no such generation is
    pending, waiting or running.
    """
    command_id = command_id_in_response_id(generation_id)
    waiting = None if command_id is None else cluster.waiting_generations.get(command_id)
    if waiting is not None:  # waiting for a re-placed instance: not sent, so not a task
        waiting.set()
        return {"id": generation_id, "object": "generation.cancelled", "cancelled": True}
    if command_id is not None:  # sent again after its instance was lost: the new command
        command_id = cluster.generation_aliases.get(command_id, command_id)
    if command_id is None or not any(
        task.command_id == command_id for task in cluster.state.tasks.values()
    ):
        raise GenerationNotFoundError(
            f"no generation {generation_id!r} is pending or running",
            param="generation_id",
            code="generation_not_found",
        )
    cluster.send_and_forget(
        CancelGeneration(command_id=CommandId.new(), target_command_id=command_id)
    )
    return {"id": generation_id, "object": "generation.cancelled", "cancelled": True}
