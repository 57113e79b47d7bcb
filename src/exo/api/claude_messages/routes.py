"""Claude (Anthropic) Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Errors under `/v1/messages` have Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`) and a schema mismatch is a 400, as Anthropic answers. Statuses: 400
`invalid_request_error`, 404 `not_found_error` (unknown model), 503 `overloaded_error` (no
capacity; the official SDK raises `InternalServerError` and retries it, as it does
Anthropic's own 529), 500 `api_error`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from exo.api.claude_messages.request import count_tokens_params, error_body, to_task_params
from exo.api.claude_messages.response import WAITING_FRAMES, collect_message, stream_message
from exo.api.claude_messages.wire_types import (
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesRequest,
)
from exo.api.serving.generation import convert_request
from exo.api.serving.image_input import convert_with_images
from exo.api.serving.model_lookup import Cluster, with_resolved_model
from exo.api.serving.token_counting import count_prompt_tokens
from exo.api.wire.errors import ErrorDialect, context_overflow

router = APIRouter()


def _render_error(
    status_code: int, _error_type: str, message: str, _param: str | None, code: str | None
) -> dict[str, Any]:
    # Anthropic's body has no param or code; the type follows from the status alone.
    overflow = context_overflow(message, code)
    if overflow is not None:
        # Anthropic's words, which Claude Code matches to compact the conversation.
        message = (
            f"prompt is too long: {overflow.prompt_tokens} tokens > {overflow.limit} maximum"
            f"{overflow.note()}"
        )
    return error_body(status_code, message)


ERROR_DIALECT = ErrorDialect("anthropic", ("/v1/messages",), _render_error)


@router.post("/v1/messages", response_model=None)
async def create_message(
    body: MessagesRequest, request: Request, cluster: Cluster
) -> Message | Response:
    converted = await convert_request(cluster, body, to_task_params, "msg_")
    message_id, model = converted.response_id, converted.body.model
    return await converted.serve(
        request,
        render=lambda chunks: stream_message(chunks, message_id=message_id, model=model),
        collector=lambda chunks: collect_message(chunks, message_id=message_id, model=model),
        waiting=WAITING_FRAMES,
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, cluster: Cluster) -> CountTokensResponse:
    body = with_resolved_model(cluster, body)
    params = await convert_with_images(cluster, body, body.model, count_tokens_params)
    count = await count_prompt_tokens(cluster, params)
    return CountTokensResponse(input_tokens=count)
