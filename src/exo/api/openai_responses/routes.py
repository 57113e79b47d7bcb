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
from exo.api.serving.generation import convert_request
from exo.api.serving.model_lookup import Cluster

router = APIRouter()


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, request: Request, cluster: Cluster
) -> ResponseObject | StreamingResponse:
    converted = convert_request(cluster, body, to_task_params, "resp_")
    context = response_context(
        converted.body, converted.params, converted.response_id, created_at=int(time.time())
    )
    return await converted.serve(
        request,
        render=lambda chunks: stream_response(chunks, context),
        collector=lambda chunks: collect_response(chunks, context),
    )
