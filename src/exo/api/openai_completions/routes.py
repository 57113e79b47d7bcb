"""OpenAI legacy Completions: `POST /v1/completions`, a raw prompt completed without the
chat template: how base models are served, and instruct models too when a client wants
its prompt used as it is."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from exo.api.openai_completions.request import COMPLETION_ID_PREFIX, to_task_params
from exo.api.openai_completions.response import collect_completion, stream_completion
from exo.api.openai_completions.wire_types import Completion, CompletionRequest
from exo.api.serving.generation import serve_generation
from exo.api.serving.model_lookup import Cluster, with_resolved_model
from exo.api.serving.response_ids import response_id
from exo.shared.types.common import CommandId

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, cluster: Cluster
) -> Completion | StreamingResponse:
    body = with_resolved_model(cluster, body)
    params = to_task_params(body)
    command_id = CommandId.new()
    completion_id, created = response_id(COMPLETION_ID_PREFIX, command_id), int(time.time())
    echo = params.prompt if body.echo and params.prompt is not None else ""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await serve_generation(
        cluster, request, params, command_id=command_id,
        render=lambda chunks: stream_completion(
            chunks, completion_id=completion_id, model=params.model, created=created,
            include_usage=include_usage, params=params, echo=echo,
        ),
        collector=lambda chunks: collect_completion(
            chunks, completion_id=completion_id, model=params.model, created=created,
            params=params, echo=echo,
        ),
    )  # fmt: skip
