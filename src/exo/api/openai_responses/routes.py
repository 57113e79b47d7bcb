"""OpenAI Responses: `POST /v1/responses` and `POST /v1/responses/input_tokens`. Errors use
OpenAI's error shape, an input over the context worded as the Responses API words it
(`ERROR_DIALECT`).

Hosted tools (`web_search`, `file_search`, `code_interpreter`, `image_generation`, `mcp`,
...) are not offered to the model, since the node runs none: the answer lists their types in
the `TOOLS_NOT_OFFERED_HEADER` header, and the log at debug level.
"""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from loguru import logger
from pydantic import BaseModel

from exo.api.openai_responses.assembler import ResponseAssembler
from exo.api.openai_responses.context import response_context
from exo.api.openai_responses.request import to_task_params, tools_not_offered
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.openai_responses.response import (
    collect_response,
    stream_response,
    waiting_frames,
)
from exo.api.openai_responses.response_types import ResponseObject
from exo.api.serving.generation import convert_request
from exo.api.serving.image_input import convert_with_images
from exo.api.serving.model_lookup import Cluster, with_resolved_model
from exo.api.serving.token_counting import count_prompt_tokens
from exo.api.serving.token_limit import response_headers
from exo.api.wire.errors import (
    ErrorDialect,
    describe_openai_validation_errors,
    openai_renderer,
    responses_context_overflow_message,
)

TOOLS_NOT_OFFERED_HEADER = "X-Exo-Tools-Not-Offered"

router = APIRouter()

ERROR_DIALECT = ErrorDialect(
    "openai-responses",
    ("/v1/responses", "/ollama/v1/responses"),
    openai_renderer(responses_context_overflow_message),
    describe_openai_validation_errors,
)


class InputTokensResponse(BaseModel):
    """The answer of `POST /v1/responses/input_tokens`."""

    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


@router.post("/v1/responses", response_model=None)
async def create_response(
    body: ResponsesRequest, request: Request, cluster: Cluster
) -> ResponseObject | Response:
    converted = await convert_request(cluster, body, to_task_params, "resp_")
    context = response_context(
        converted.body, converted.params, converted.response_id, created_at=int(time.time())
    )
    not_offered = tools_not_offered(body)
    if not_offered:
        logger.debug(
            f"api: {converted.response_id}: hosted tools not offered to the model: "
            f"{', '.join(not_offered)}"
        )
        response_headers(request)[TOOLS_NOT_OFFERED_HEADER] = ", ".join(not_offered)
    assembler = ResponseAssembler(context)
    return await converted.serve(
        request,
        render=lambda chunks: stream_response(chunks, context, assembler),
        collector=lambda chunks: collect_response(chunks, context),
        waiting=waiting_frames(assembler),
    )


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, cluster: Cluster) -> InputTokensResponse:
    """The prompt tokens `POST /v1/responses` would send the model for this body, counted
    with the model's own tokenizer and chat template on this node."""
    body = with_resolved_model(cluster, body)
    params = await convert_with_images(cluster, body, body.model, to_task_params)
    count = await count_prompt_tokens(cluster, params)
    return InputTokensResponse(input_tokens=count)
