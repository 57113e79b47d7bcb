"""OpenAI legacy Completions: `POST /v1/completions`, a raw prompt completed without the
chat template: how base models are served, and instruct models too when a client wants
its prompt used as it is."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from exo.api.openai_completions.request import COMPLETION_ID_PREFIX, to_task_params
from exo.api.openai_completions.response import collect_completion, stream_completion
from exo.api.openai_completions.wire_types import Completion, CompletionRequest
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.generation import collect, start_generation, streaming_response
from exo.api.serving.model_lookup import cluster_dependency, with_resolved_model
from exo.api.serving.response_ids import response_id
from exo.shared.types.common import CommandId

router = APIRouter()
Cluster = Annotated[ClusterClient, Depends(cluster_dependency)]


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, cluster: Cluster
) -> Completion | StreamingResponse:
    body = with_resolved_model(cluster, body)
    params = to_task_params(body)
    command_id = CommandId.new()
    completion_id, created = response_id(COMPLETION_ID_PREFIX, command_id), int(time.time())
    echo = params.prompt if body.echo and params.prompt is not None else ""
    generation = await start_generation(cluster, request, params, command_id=command_id)
    if params.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return streaming_response(
            generation,
            lambda chunks: stream_completion(
                chunks,
                completion_id=completion_id,
                model=params.model,
                created=created,
                include_usage=include_usage,
                params=params,
                echo=echo,
            ),
        )
    return await collect(
        generation,
        request,
        lambda chunks: collect_completion(
            chunks,
            completion_id=completion_id,
            model=params.model,
            created=created,
            params=params,
            echo=echo,
        ),
    )
