"""The Claude Messages adapter's output: the SSE event sequence, the collected message,
and the error shape."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from pydantic import TypeAdapter

from exo.api.claude_messages.request import (
    error_body,
    error_type_for_status,
)
from exo.api.claude_messages.response import collect_message
from exo.api.claude_messages.routes import ERROR_DIALECT
from exo.api.claude_messages.wire_types import (
    Message,
    MessageUsage,
    StreamEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from exo.api.tests.claude_messages_builders import (
    MESSAGE_ID,
    MESSAGE_START,
    MESSAGE_STOP,
    MODEL,
    block_start,
    block_stop,
    collect,
    delta,
    error_chunk,
    error_event,
    finish,
    message_delta,
    stream_events,
    token,
    tool_calls,
    usage_json,
)
from exo.api.wire.errors import ApiError
from exo.shared.types.chunks import (
    Chunk,
)
from exo.testing.chunks import ChunkSource

# ---------------------------------------------------------------- SSE stream


@pytest.mark.anyio
async def test_stream_of_text_is_one_text_block() -> None:
    events = await stream_events(
        [token("Hel"), token(""), token("lo"), finish(completion_tokens=2)]
    )
    assert events == [
        MESSAGE_START,
        block_start(0, {"type": "text", "text": ""}),
        delta(0, text_delta="Hel"),
        delta(0, text_delta="lo"),
        block_stop(0),
        message_delta("end_turn", usage_json(5, 2)),
        MESSAGE_STOP,
    ]


@pytest.mark.anyio
async def test_stream_of_thinking_text_and_tool_calls_numbers_the_blocks() -> None:
    events = await stream_events(
        [
            token(reasoning="Need "),
            token(reasoning="weather.", text="Checking"),
            token(text="."),
            tool_calls(
                ("call_1", "weather", '{"city": "Paris"}'),
                ("call_2", "time", "{}"),
                finish_reason=None,
            ),
            finish("tool_calls", completion_tokens=9, reasoning=2),
        ]
    )
    assert events == [
        MESSAGE_START,
        block_start(0, {"type": "thinking", "thinking": "", "signature": ""}),
        delta(0, thinking_delta="Need "),
        delta(0, thinking_delta="weather."),
        block_stop(0),
        block_start(1, {"type": "text", "text": ""}),
        delta(1, text_delta="Checking"),
        delta(1, text_delta="."),
        block_stop(1),
        block_start(2, {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}),
        delta(2, input_json_delta='{"city": "Paris"}'),
        block_stop(2),
        block_start(3, {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}}),
        delta(3, input_json_delta="{}"),
        block_stop(3),
        message_delta("tool_use", usage_json(5, 9, thinking=2)),
        MESSAGE_STOP,
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("chunks", "stop_reason"),
    [
        ([token("a"), finish("length")], "max_tokens"),
        ([token("a"), finish("stop")], "end_turn"),
        ([tool_calls(("c", "n", "{}"))], "tool_use"),
        ([tool_calls(("c", "n", "{}"), finish_reason=None), finish("stop")], "tool_use"),
    ],
)
async def test_stream_stop_reasons(chunks: list[Chunk], stop_reason: str) -> None:
    events = await stream_events(chunks)
    assert events[-2][1]["delta"] == {"stop_reason": stop_reason, "stop_sequence": None}
    assert events[-1] == MESSAGE_STOP


@pytest.mark.anyio
async def test_matched_stop_string_is_reported_as_stop_sequence() -> None:
    chunks: list[Chunk] = [token("a"), finish("stop").model_copy(update={"stop_sequence": "END"})]
    events = await stream_events(chunks)
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    message = await collect_message(ChunkSource(chunks), message_id=MESSAGE_ID, model=MODEL)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "END")


@pytest.mark.anyio
async def test_stream_without_content_has_no_blocks() -> None:
    events = await stream_events([finish(completion_tokens=1)])
    assert events == [MESSAGE_START, message_delta("end_turn", usage_json(5, 1)), MESSAGE_STOP]


@pytest.mark.anyio
async def test_stream_error_mid_stream_is_an_error_event_and_the_end() -> None:
    events = await stream_events([token("partial"), error_chunk("runner crashed")])
    assert events == [
        MESSAGE_START,
        block_start(0, {"type": "text", "text": ""}),
        delta(0, text_delta="partial"),
        error_event("api_error", "runner crashed"),
    ]


@pytest.mark.anyio
async def test_stream_request_error_is_an_invalid_request_error_event() -> None:
    events = await stream_events([error_chunk("prompt too long", status_code=400)])
    assert events == [MESSAGE_START, error_event("invalid_request_error", "prompt too long")]


@pytest.mark.anyio
async def test_stream_cancelled_and_unfinished_generations_end_with_an_error_event() -> None:
    cancelled = await stream_events([token("a"), finish("cancelled")])
    assert cancelled[-1] == error_event("api_error", "generation was cancelled before it finished")
    unfinished = await stream_events([token("a")])
    assert unfinished[-1] == error_event("api_error", "generation stream ended without a finish")


@pytest.mark.anyio
async def test_stream_tool_call_with_non_object_arguments_is_an_error() -> None:
    events = await stream_events([tool_calls(("c", "n", "[1, 2]"))])
    assert events[-1][0] == "error"
    assert "not a JSON object" in events[-1][1]["error"]["message"]


@pytest.mark.anyio
async def test_stream_stops_reading_at_the_finish() -> None:
    source = ChunkSource([token("a"), finish(), token("never read")])
    await stream_events(source)
    assert source.taken == 2


@pytest.mark.anyio
async def test_stream_usage_falls_back_to_counted_tokens() -> None:
    events = await stream_events([token("a"), token("b"), token(finish_reason="stop")])
    assert events[-2] == message_delta("end_turn", usage_json(0, 2))


@pytest.mark.anyio
async def test_stream_events_parse_as_the_sdk_event_types() -> None:
    events = await stream_events(
        [token(reasoning="r"), token("t"), tool_calls(("c", "n", '{"a": 1}'))]
    )
    adapter: TypeAdapter[Any] = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    ours: TypeAdapter[StreamEvent] = TypeAdapter(StreamEvent)
    for _name, data in events:
        assert adapter.validate_python(data).type == data["type"]
        assert ours.validate_json(json.dumps(data)).model_dump(mode="json") == data


# ---------------------------------------------------------------- collect


@pytest.mark.anyio
async def test_collect_gathers_thinking_text_and_tool_use_blocks() -> None:
    message = await collect(
        [
            token(reasoning="hmm"),
            token("Hi", reasoning=""),
            token(" there"),
            tool_calls(("call_1", "weather", '{"city": "Paris", "days": 2}')),
        ]
    )
    assert message == Message(
        id=MESSAGE_ID,
        model=MODEL,
        content=[
            ThinkingBlock(thinking="hmm", signature=""),
            TextBlock(text="Hi there"),
            ToolUseBlock(id="toolu_1", name="weather", input={"city": "Paris", "days": 2}),
        ],
        stop_reason="tool_use",
        stop_sequence=None,
        usage=MessageUsage(input_tokens=5, output_tokens=4),
    )


@pytest.mark.anyio
async def test_collect_reports_max_tokens_and_stops_reading() -> None:
    source = ChunkSource([token("a"), finish("length", completion_tokens=1), token("x")])
    message = await collect_message(source, message_id=MESSAGE_ID, model=MODEL)
    assert message.stop_reason == "max_tokens"
    assert message.content == [TextBlock(text="a")]
    assert source.taken == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("chunks", "status"),
    [
        ([token("a"), error_chunk()], 500),
        ([error_chunk("too long", status_code=400)], 400),
        ([token("a"), finish("cancelled")], 500),
        ([token("a")], 500),
    ],
)
async def test_collect_failures_raise_api_errors(chunks: list[Chunk], status: int) -> None:
    with pytest.raises(ApiError) as raised:
        await collect(chunks)
    assert raised.value.status_code == status


@pytest.mark.anyio
async def test_collected_message_parses_as_the_sdk_message() -> None:
    message = await collect([token(reasoning="r"), token("t"), tool_calls(("c", "n", '{"a": 1}'))])
    data = message.model_dump(mode="json")
    parsed = anthropic.types.Message.model_validate(data)
    assert [block.type for block in parsed.content] == ["thinking", "text", "tool_use"]
    assert Message.model_validate_json(message.model_dump_json()) == message


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("status", "error_type"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (409, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_types_follow_anthropic_statuses(status: int, error_type: str) -> None:
    assert error_type_for_status(status) == error_type
    assert error_body(status, "m") == {
        "type": "error",
        "error": {"type": error_type, "message": "m"},
    }


def test_error_dialect_claims_both_routes_and_answers_schema_errors_with_400() -> None:
    assert ERROR_DIALECT.matches("/v1/messages")
    assert ERROR_DIALECT.matches("/v1/messages/count_tokens")
    assert not ERROR_DIALECT.matches("/v1/chat/completions")
