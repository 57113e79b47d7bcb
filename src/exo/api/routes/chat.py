"""OpenAI Chat Completions: `POST /v1/chat/completions`, `GET /v1/models`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from typing import Annotated

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from exo.api.adapters.chat_completions import (
    collect_chat_completion,
    new_completion_id,
    stream_chat_completion,
    to_task_params,
)
from exo.api.cluster import ClusterClient, CommandRejectedError
from exo.api.dependencies import cluster_dependency, known_model_ids
from exo.api.errors import (
    ApiError,
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
    NoCapacityError,
)
from exo.api.types.openai_chat import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ModelList,
    ModelObject,
)
from exo.master.decisions import no_instance_message
from exo.shared.types.chunks import Chunk, ErrorChunk
from exo.shared.types.commands import CancelGeneration, GenerateText
from exo.shared.types.common import CommandId, ModelId

router = APIRouter()
Cluster = Annotated[ClusterClient, Depends(cluster_dependency)]
DISCONNECT_POLL_SECONDS = 0.25


@router.get("/v1/models")
async def list_models(cluster: Cluster) -> ModelList:
    return ModelList(
        data=[
            ModelObject(id=model_id, created=0, owned_by="exo")
            for model_id in known_model_ids(cluster)
        ]
    )


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, cluster: Cluster
) -> ChatCompletionResponse | StreamingResponse:
    params = to_task_params(body)
    if params.model not in known_model_ids(cluster):
        raise ModelNotFoundError(f"The model '{params.model}' does not exist")
    if not cluster.state.instances_of_model(params.model):
        raise ModelNotFoundError(no_instance_message(params.model), code="no_instance")
    command = GenerateText(command_id=CommandId.new(), params=params)
    completion_id, created = new_completion_id(), int(time.time())
    # Registered before submitting, so no chunk can arrive unheard; released by whoever
    # finishes last (this handler, or the streaming body after the response started).
    resources = ExitStack()
    chunks = resources.enter_context(cluster.chunk_stream(command.command_id))
    try:
        await _submit(cluster, command)
    except BaseException:
        resources.close()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # The first chunk decides the status: a request refused by the engine (prompt
        # longer than the context) is a 400, not an error inside a 200 stream.
        try:
            first = await _first_chunk(request, chunks)
        except BaseException:
            _cancel(cluster, command.command_id)
            resources.close()
            raise
        if isinstance(first, ErrorChunk) and first.status_code == 400:
            resources.close()
            raise InvalidRequestError(first.error_message, param="messages", code=first.error_code)

        async def sse() -> AsyncIterator[str]:
            finished = False
            try:
                async for event in stream_chat_completion(
                    _prepend(first, chunks),
                    completion_id=completion_id,
                    model=params.model,
                    created=created,
                    include_usage=include_usage,
                ):
                    yield event
                finished = True
            finally:
                if not finished:  # the client went away mid-stream
                    _cancel(cluster, command.command_id)
                resources.close()

        return StreamingResponse(sse(), media_type="text/event-stream")
    with resources:
        return await _collect_unless_disconnected(
            request, cluster, command.command_id, chunks, completion_id, params.model, created
        )


async def _first_chunk(request: Request, chunks: AsyncIterator[Chunk]) -> Chunk | None:
    """The first chunk of a stream, or None if the stream ended; raises GenerationError
    when the client leaves before it comes."""
    result: list[Chunk | None] = []
    async with anyio.create_task_group() as task_group:

        async def first() -> None:
            result.append(await anext(chunks, None))
            task_group.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_SECONDS)
            task_group.cancel_scope.cancel()

        task_group.start_soon(first)
        task_group.start_soon(watch_disconnect)
    if not result:
        raise GenerationError("the client disconnected; generation cancelled")
    return result[0]


async def _prepend(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    if first is None:
        return
    yield first
    if first.finish_reason is None:
        async for chunk in rest:
            yield chunk


async def _submit(cluster: ClusterClient, command: GenerateText) -> None:
    try:
        await cluster.submit(command)
    except CommandRejectedError as error:
        if error.status_code == 404:
            raise ModelNotFoundError(error.reason, code="no_instance") from None
        raise NoCapacityError(error.reason) from None


async def _collect_unless_disconnected(
    request: Request,
    cluster: ClusterClient,
    command_id: CommandId,
    chunks: AsyncIterator[Chunk],
    completion_id: str,
    model: ModelId,
    created: int,
) -> ChatCompletionResponse:
    result: ChatCompletionResponse | None = None
    error: ApiError | None = None
    async with anyio.create_task_group() as task_group:

        async def collect() -> None:
            nonlocal result, error
            try:
                result = await collect_chat_completion(
                    chunks, completion_id=completion_id, model=model, created=created
                )
            except ApiError as api_error:
                error = api_error
            task_group.cancel_scope.cancel()

        async def watch_disconnect() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_SECONDS)
            task_group.cancel_scope.cancel()

        task_group.start_soon(collect)
        task_group.start_soon(watch_disconnect)
    if error is not None:
        raise error
    if result is None:
        _cancel(cluster, command_id)
        raise GenerationError("the client disconnected; generation cancelled")
    return result


def _cancel(cluster: ClusterClient, command_id: CommandId) -> None:
    cluster.send_and_forget(
        CancelGeneration(command_id=CommandId.new(), target_command_id=command_id)
    )
