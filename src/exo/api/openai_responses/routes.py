"""OpenAI Responses: `POST /v1/responses`. Errors use OpenAI's error shape (the default),
so this module defines no `ERROR_DIALECT`."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from exo.api.openai_responses.context import response_context
from exo.api.openai_responses.request import to_task_params
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.openai_responses.response import collect_response, stream_response
from exo.api.openai_responses.response_types import ResponseObject
from exo.api.serving.generation import serve_generation
from exo.api.serving.model_lookup import Cluster, with_resolved_model
from exo.api.serving.response_ids import response_id
from exo.shared.types.common import CommandId

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, request: Request, cluster: Cluster
) -> ResponseObject | StreamingResponse:
    # A short name (`qwen3:0.6b`) answers with the catalog id it resolves to.
    body = with_resolved_model(cluster, body)
    params = to_task_params(body)
    command_id = CommandId.new()
    context = response_context(
        body, params, response_id("resp_", command_id), created_at=int(time.time())
    )
    return await serve_generation(
        cluster, request, params, command_id=command_id,
        render=lambda chunks: stream_response(chunks, context),
        collector=lambda chunks: collect_response(chunks, context),
    )  # fmt: skip
