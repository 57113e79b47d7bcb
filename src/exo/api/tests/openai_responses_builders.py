"""What the OpenAI Responses adapter's tests build and read: requests, the chunks a runner
sends, the adapter's SSE events (their shape) and its collected response."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from exo.api.openai_responses.context import ResponseContext, response_context
from exo.api.openai_responses.request import (
    to_task_params,
)
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.openai_responses.response import (
    collect_response,
    stream_response,
)
from exo.api.openai_responses.response_types import ResponseObject
from exo.api.serving.response_ids import response_id
from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChatMessage, ToolCall
from exo.testing.chunks import ChunkSource

MODEL = "test-model"
COMMAND_ID = CommandId("0b5e0a3c-8d2f-4f61-9c1e-3a7d2b9e4f10")
RESPONSE_ID = response_id("resp_", COMMAND_ID)
HEX = RESPONSE_ID.removeprefix("resp_")
SDK_EVENT: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


# ---------------------------------------------------------------- builders


def make_request(**fields: Any) -> ResponsesRequest:
    body: dict[str, Any] = {"model": MODEL, "input": "hi"}
    body.update(fields)
    return ResponsesRequest.model_validate(body)


def messages_of(**fields: Any) -> tuple[ChatMessage, ...]:
    return to_task_params(make_request(**fields)).messages


def refusal(**fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        to_task_params(make_request(**fields))
    return caught.value


def context_for(**fields: Any) -> ResponseContext:
    request = make_request(**fields)
    return response_context(request, to_task_params(request), RESPONSE_ID, created_at=1700)


def token(
    text: str = "",
    reasoning: str = "",
    finish_reason: FinishReason | None = None,
    usage: Usage | None = None,
    logprobs: tuple[TokenLogprob, ...] = (),
) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        text=text,
        reasoning_text=reasoning,
        token_ids=(1,),
        finish_reason=finish_reason,
        usage=usage,
        logprobs=logprobs,
    )


def finish(
    reason: FinishReason = "stop", text: str = "", prompt_tokens: int = 5, reasoning_tokens: int = 0
) -> TokenChunk:
    return token(
        text,
        finish_reason=reason,
        usage=Usage(
            prompt_tokens=prompt_tokens, completion_tokens=3, reasoning_tokens=reasoning_tokens
        ),
    )


def tool_calls(*calls: tuple[str, str, str], reason: FinishReason | None = None) -> ToolCallChunk:
    return ToolCallChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        tool_calls=tuple(ToolCall(id=id_, name=name, arguments=args) for id_, name, args in calls),
        token_ids=(2, 3),
        finish_reason=reason,
        usage=Usage(prompt_tokens=5, completion_tokens=3) if reason else None,
    )


def error_chunk(message: str = "runner crashed", status_code: int = 500) -> ErrorChunk:
    return ErrorChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        error_message=message,
        status_code=status_code,
    )


async def stream_events(
    chunks: Sequence[Chunk] | ChunkSource, context: ResponseContext | None = None
) -> list[dict[str, Any]]:
    """Run the stream adapter; check every event's SSE framing, that the official SDK's
    event model validates it, and that sequence numbers count 0, 1, 2, ..."""
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    events: list[dict[str, Any]] = []
    async for piece in stream_response(source, context or context_for()):
        assert piece.endswith("\n\n"), piece
        event_line, data_line = piece.removesuffix("\n\n").split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {payload['type']}"
        assert payload["sequence_number"] == len(events)
        SDK_EVENT.validate_python(payload)
        events.append(payload)
    return events


def shape(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each event as (type, output_index, item_id or item id, content/summary index)."""
    rows: list[tuple[Any, ...]] = []
    for event in events:
        item_id = event.get("item_id") or event.get("item", {}).get("id")
        index = event.get("content_index", event.get("summary_index"))
        rows.append((event["type"], event.get("output_index"), item_id, index))
    return rows


async def collect(
    chunks: Sequence[Chunk] | ChunkSource, context: ResponseContext | None = None
) -> ResponseObject:
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    return await collect_response(source, context or context_for())


MSG0, MSG1, RS0 = f"msg_{HEX}_0", f"msg_{HEX}_1", f"rs_{HEX}_0"
