"""The OpenAI Responses adapter: request conversion, the SSE event sequence, collection,
and the official `openai` client against a tiny server that uses the adapter."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from exo.api.app import create_app
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
from exo.api.serving.cluster_client import ClusterClient, LoadOnRequest
from exo.api.serving.node_stop import NodeStop
from exo.api.serving.response_ids import command_id_in_response_id, response_id
from exo.api.wire.errors import ApiError, GenerationError, InvalidRequestError
from exo.api.wire.images import ImagePolicy
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from exo.shared.types.commands import CancelGeneration, GenerateText
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.text_generation import ChatMessage, NamedToolChoice, ToolCall
from exo.testing.builders import make_instance
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


# ---------------------------------------------------------------- request conversion


def test_string_input_is_one_user_turn_after_the_instructions() -> None:
    assert messages_of(input="Hello", instructions="Be brief.") == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hello"),
    )


def test_message_items_with_and_without_type() -> None:
    messages = messages_of(
        input=[
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "S"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "line 1"},
                    {"type": "input_text", "text": "line 2"},
                ],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "Answer", "annotations": [], "logprobs": []}
                ],
            },
            {"role": "user", "content": "Again"},
        ]
    )
    assert messages == (
        ChatMessage(role="system", content="Rules."),
        ChatMessage(role="system", content="S"),
        ChatMessage(role="user", content="line 1\nline 2"),
        ChatMessage(role="assistant", content="Answer"),
        ChatMessage(role="user", content="Again"),
    )


def test_function_calls_and_outputs_become_tool_turns() -> None:
    messages = messages_of(
        input=[
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Need two calls."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c":"P"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"c":"R"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "20C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "25C"}],
            },
            {"role": "assistant", "content": "Let me also check"},
            {"type": "function_call", "call_id": "c3", "name": "time", "arguments": "{}"},
        ]
    )
    assert messages == (
        ChatMessage(role="user", content="Weather in Paris and Rome?"),
        ChatMessage(
            role="assistant",
            reasoning_content="Need two calls.",
            tool_calls=(
                ToolCall(id="c1", name="weather", arguments='{"c":"P"}'),
                ToolCall(id="c2", name="weather", arguments='{"c":"R"}'),
            ),
        ),
        ChatMessage(role="tool", content="20C", tool_call_id="c1"),
        ChatMessage(role="tool", content="25C", tool_call_id="c2"),
        ChatMessage(
            role="assistant",
            content="Let me also check",
            tool_calls=(ToolCall(id="c3", name="time", arguments="{}"),),
        ),
    )


def test_reasoning_goes_to_the_next_assistant_turn_or_is_dropped() -> None:
    messages = messages_of(
        input=[
            {"role": "user", "content": "Q1"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "R"}],
            },
            {"role": "assistant", "content": "A1"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "lost"}]},
            {"role": "user", "content": "Q2"},
        ]
    )
    assert messages == (
        ChatMessage(role="user", content="Q1"),
        ChatMessage(role="assistant", content="A1", reasoning_content="R"),
        ChatMessage(role="user", content="Q2"),
    )


def test_function_call_output_without_its_call_is_refused() -> None:
    error = refusal(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}])
    assert error.param == "input[0].call_id" and "nope" in error.message


@pytest.mark.parametrize(
    ("part", "words"),
    [
        ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "no vision"),
        ({"type": "input_file", "file_id": "file-1"}, "input_file"),
        ({"type": "input_audio", "input_audio": {}}, "input_audio"),
    ],
)
def test_non_text_input_is_refused_naming_the_part(part: dict[str, Any], words: str) -> None:
    error = refusal(
        input=[{"role": "user", "content": [{"type": "input_text", "text": "see"}, part]}]
    )
    assert error.status_code == 400
    assert error.param == "input[0].content[1]"
    assert words in error.message


@pytest.mark.parametrize(
    ("item", "words"),
    [
        ({"type": "item_reference", "id": "msg_1"}, "does not store"),
        ({"type": "web_search_call", "id": "ws_1", "status": "completed"}, "web_search_call"),
    ],
)
def test_unsupported_input_items_are_refused(item: dict[str, Any], words: str) -> None:
    error = refusal(input=[{"role": "user", "content": "hi"}, item])
    assert error.param == "input[1].type" and words in error.message


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_abc"}, "previous_response_id", "does not store"),
        ({"conversation": "conv_1"}, "conversation", "does not store"),
        ({"background": True}, "background", "does not store"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "not supported"),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
            "tool_choice",
            "'web_search'",
        ),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "allowed_tools"},
            },
            "tool_choice",
            "allowed_tools",
        ),
        (
            {
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": {"type": "function", "name": "g"},
            },
            "tool_choice",
            "'g'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
        (
            {
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required",
            },
            "text.format",
            "json_schema",
        ),
        ({"input": []}, "input", "at least one"),
        ({"input": [{"role": "system", "content": "only rules"}]}, "input", "at least one"),
    ],
)
def test_unsupported_or_inconsistent_requests_are_refused(
    fields: dict[str, Any], param: str, words: str
) -> None:
    error = refusal(**fields)
    assert error.status_code == 400
    assert error.param == param
    assert words in error.message


def test_json_object_with_a_forced_tool_call_names_text_format() -> None:
    error = refusal(
        tools=[{"type": "function", "name": "f"}],
        tool_choice="required",
        text={"format": {"type": "json_object"}},
    )
    assert error.param == "text.format"


def test_tools_and_tool_choice_are_converted() -> None:
    params = to_task_params(
        make_request(
            tools=[
                {
                    "type": "function",
                    "name": "weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                    "strict": True,
                },
                {"type": "function", "name": "noargs"},
            ],
            tool_choice={"type": "function", "name": "weather"},
            parallel_tool_calls=False,
        )
    )
    assert [tool.name for tool in params.tools] == ["weather", "noargs"]
    assert params.tools[0].description == "Current weather"
    assert params.tools[0].parameters["properties"] == {"city": {"type": "string"}}
    assert params.tools[1].parameters == {}
    assert params.tool_choice == NamedToolChoice(name="weather")
    assert params.parallel_tool_calls is False
    for choice in ("auto", "none", "required"):
        converted = to_task_params(
            make_request(tools=[{"type": "function", "name": "f"}], tool_choice=choice)
        )
        assert converted.tool_choice == choice
    assert to_task_params(make_request()).tool_choice == "auto"
    assert to_task_params(make_request()).parallel_tool_calls is True


@pytest.mark.parametrize(
    ("effort", "enable_thinking", "reasoning_effort"),
    [
        (None, None, None),
        ("none", False, None),
        ("minimal", False, "minimal"),
        ("low", True, "low"),
        ("medium", True, "medium"),
        ("high", True, "high"),
        ("xhigh", True, "high"),
    ],
)
def test_reasoning_effort_mapping(
    effort: str | None, enable_thinking: bool | None, reasoning_effort: str | None
) -> None:
    params = to_task_params(make_request(reasoning={"effort": effort, "summary": "auto"}))
    assert params.enable_thinking is enable_thinking
    assert params.reasoning_effort == reasoning_effort


def test_sampling_and_format_fields_pass_through() -> None:
    params = to_task_params(
        make_request(
            max_output_tokens=16,
            temperature=0,
            top_p=0.5,
            stream=True,
            text={"format": {"type": "json_object"}},
            include=["message.output_text.logprobs"],
            top_logprobs=3,
        )
    )
    assert (params.max_tokens, params.temperature, params.top_p, params.stream) == (
        16,
        0,
        0.5,
        True,
    )
    assert params.response_format == "json_object"
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    plain = to_task_params(make_request(text={"format": {"type": "text"}}))
    assert (plain.max_tokens, plain.temperature, plain.top_p) == (None, None, None)
    assert (plain.response_format, plain.logprobs, plain.stream) == ("text", False, False)


def test_what_the_sdk_and_codex_send_is_accepted() -> None:
    request = make_request(
        instructions="You are Codex.",
        input=[
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}
        ],
        tools=[
            {"type": "function", "name": "shell", "strict": False, "parameters": {"type": "object"}}
        ],
        tool_choice="auto",
        parallel_tool_calls=False,
        reasoning={"effort": "medium", "summary": "auto"},
        store=False,
        stream=True,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="abc",
        text={"verbosity": "low"},
        metadata={"k": "v"},
        truncation="disabled",
        user="u",
        service_tier="auto",
        safety_identifier="s",
        max_tool_calls=3,
        stream_options={"include_obfuscation": False},
        some_future_field={"x": 1},
    )
    params = to_task_params(request)
    assert params.messages[0] == ChatMessage(role="system", content="You are Codex.")
    assert params.logprobs is False


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL},
        {"input": "hi"},
        {"model": MODEL, "input": 3},
        {"model": MODEL, "input": [{"role": "robot", "content": "x"}]},
        {"model": MODEL, "input": "hi", "max_output_tokens": 0},
        {"model": MODEL, "input": "hi", "max_output_tokens": 15},
        {"model": MODEL, "input": "hi", "temperature": 3},
        {"model": MODEL, "input": "hi", "tool_choice": "sometimes"},
        {"model": MODEL, "input": "hi", "text": {"format": {"type": "yaml"}}},
        {"model": MODEL, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    ],
)
def test_schema_violations_are_validation_errors(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate(body)


def test_request_round_trips_through_json() -> None:
    request = make_request(
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        ],
        tools=[{"type": "function", "name": "f"}],
        tool_choice={"type": "function", "name": "f"},
        reasoning={"effort": "low"},
    )
    assert ResponsesRequest.model_validate_json(request.model_dump_json()) == request


# ---------------------------------------------------------------- streaming


@pytest.mark.anyio
async def test_stream_of_plain_text() -> None:
    events = await stream_events([token("Hel"), token("lo"), finish(text="!")])
    assert shape(events) == [
        ("response.created", None, None, None),
        ("response.in_progress", None, None, None),
        ("response.output_item.added", 0, MSG0, None),
        ("response.content_part.added", 0, MSG0, 0),
        ("response.output_text.delta", 0, MSG0, 0),
        ("response.output_text.delta", 0, MSG0, 0),
        ("response.output_text.delta", 0, MSG0, 0),
        ("response.output_text.done", 0, MSG0, 0),
        ("response.content_part.done", 0, MSG0, 0),
        ("response.output_item.done", 0, MSG0, None),
        ("response.completed", None, None, None),
    ]
    created = events[0]["response"]
    assert created["id"] == RESPONSE_ID and created["status"] == "in_progress"
    assert created["output"] == [] and created["usage"] is None
    assert events[2]["item"] == {
        "type": "message",
        "id": MSG0,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert events[3]["part"] == {
        "type": "output_text",
        "text": "",
        "annotations": [],
        "logprobs": [],
    }
    assert [event["delta"] for event in events[4:7]] == ["Hel", "lo", "!"]
    assert events[7]["text"] == "Hello!"
    assert events[8]["part"]["text"] == "Hello!"
    message = {
        "type": "message",
        "id": MSG0,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}],
    }
    assert events[9]["item"] == message
    final = events[10]["response"]
    assert final["status"] == "completed" and final["output"] == [message]
    assert final["completed_at"] >= final["created_at"] == 1700
    assert final["usage"] == {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 8,
    }
    assert SdkResponse.model_validate(final).output_text == "Hello!"


@pytest.mark.anyio
async def test_stream_of_reasoning_then_text() -> None:
    events = await stream_events(
        [
            token(reasoning="Think"),
            token(reasoning="ing."),
            token("Paris"),
            finish(reasoning_tokens=2),
        ]
    )
    assert shape(events) == [
        ("response.created", None, None, None),
        ("response.in_progress", None, None, None),
        ("response.output_item.added", 0, RS0, None),
        ("response.reasoning_summary_part.added", 0, RS0, 0),
        ("response.reasoning_summary_text.delta", 0, RS0, 0),
        ("response.reasoning_summary_text.delta", 0, RS0, 0),
        ("response.reasoning_summary_text.done", 0, RS0, 0),
        ("response.reasoning_summary_part.done", 0, RS0, 0),
        ("response.output_item.done", 0, RS0, None),
        ("response.output_item.added", 1, MSG1, None),
        ("response.content_part.added", 1, MSG1, 0),
        ("response.output_text.delta", 1, MSG1, 0),
        ("response.output_text.done", 1, MSG1, 0),
        ("response.content_part.done", 1, MSG1, 0),
        ("response.output_item.done", 1, MSG1, None),
        ("response.completed", None, None, None),
    ]
    assert events[2]["item"] == {
        "type": "reasoning",
        "id": RS0,
        "summary": [],
        "status": "in_progress",
    }
    assert [events[4]["delta"], events[5]["delta"]] == ["Think", "ing."]
    assert events[6]["text"] == "Thinking."
    assert events[7]["part"] == {"type": "summary_text", "text": "Thinking."}
    reasoning = {
        "type": "reasoning",
        "id": RS0,
        "summary": [{"type": "summary_text", "text": "Thinking."}],
        "status": "completed",
    }
    assert events[8]["item"] == reasoning
    final = events[-1]["response"]
    assert final["output"][0] == reasoning
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert SdkResponse.model_validate(final).output_text == "Paris"


@pytest.mark.anyio
async def test_stream_of_text_then_tool_calls() -> None:
    events = await stream_events(
        [
            token("Checking."),
            tool_calls(
                ("call_a", "weather", '{"city": "Paris"}'),
                ("call_b", "weather", '{"city": "Rome"}'),
                reason="tool_calls",
            ),
        ]
    )
    fc1, fc2 = f"fc_{HEX}_1", f"fc_{HEX}_2"
    assert shape(events)[2:] == [
        ("response.output_item.added", 0, MSG0, None),
        ("response.content_part.added", 0, MSG0, 0),
        ("response.output_text.delta", 0, MSG0, 0),
        ("response.output_text.done", 0, MSG0, 0),
        ("response.content_part.done", 0, MSG0, 0),
        ("response.output_item.done", 0, MSG0, None),
        ("response.output_item.added", 1, fc1, None),
        ("response.function_call_arguments.delta", 1, fc1, None),
        ("response.function_call_arguments.done", 1, fc1, None),
        ("response.output_item.done", 1, fc1, None),
        ("response.output_item.added", 2, fc2, None),
        ("response.function_call_arguments.delta", 2, fc2, None),
        ("response.function_call_arguments.done", 2, fc2, None),
        ("response.output_item.done", 2, fc2, None),
        ("response.completed", None, None, None),
    ]
    assert events[8]["item"] == {
        "type": "function_call",
        "id": fc1,
        "call_id": "call_a",
        "name": "weather",
        "arguments": "",
        "status": "in_progress",
    }
    assert events[9]["delta"] == '{"city": "Paris"}'
    assert events[10]["arguments"] == '{"city": "Paris"}' and events[10]["name"] == "weather"
    done = events[11]["item"]
    assert done["arguments"] == '{"city": "Paris"}' and done["status"] == "completed"
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert [item["type"] for item in final["output"]] == [
        "message",
        "function_call",
        "function_call",
    ]
    assert [item.get("call_id") for item in final["output"]] == [None, "call_a", "call_b"]


@pytest.mark.anyio
async def test_stream_hitting_max_output_tokens_is_incomplete() -> None:
    events = await stream_events([token("Once upon"), finish("length", text=" a")])
    assert events[-2]["type"] == "response.output_item.done"
    assert events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Once upon a"
    assert final["completed_at"] is None


@pytest.mark.anyio
async def test_stream_of_cancelled_generation_ends_incomplete_with_status_cancelled() -> None:
    events = await stream_events([token("Part"), finish("cancelled")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["incomplete_details"] is None
    assert events[-2]["item"]["status"] == "incomplete"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("last", "code", "message"),
    [
        (error_chunk("runner crashed"), "server_error", "runner crashed"),
        (error_chunk("prompt too long", status_code=400), "invalid_prompt", "prompt too long"),
        (finish("error"), "server_error", "generation failed"),
    ],
)
async def test_stream_failure_closes_the_open_item_and_ends_failed(
    last: Chunk, code: str, message: str
) -> None:
    events = await stream_events([token("partial"), last])
    assert shape(events)[-4:] == [
        ("response.output_text.done", 0, MSG0, 0),
        ("response.content_part.done", 0, MSG0, 0),
        ("response.output_item.done", 0, MSG0, None),
        ("response.failed", None, None, None),
    ]
    assert events[-2]["item"]["status"] == "incomplete"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": code, "message": message}
    assert failed["output"][0]["content"][0]["text"] == "partial"


@pytest.mark.anyio
async def test_stream_without_finish_ends_failed() -> None:
    events = await stream_events([token("cut")])
    assert events[-1]["type"] == "response.failed"
    assert "without a finish" in events[-1]["response"]["error"]["message"]


@pytest.mark.anyio
async def test_stream_stops_reading_at_the_finish() -> None:
    source = ChunkSource([token("a"), finish(), token("never read")])
    events = await stream_events(source)
    assert source.taken == 2
    assert events[-1]["type"] == "response.completed"


@pytest.mark.anyio
async def test_empty_answer_is_an_empty_message() -> None:
    events = await stream_events([finish()])
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


@pytest.mark.anyio
async def test_logprobs_reach_deltas_and_the_final_text() -> None:
    logprob = TokenLogprob(
        token="Hi",
        token_id=7,
        logprob=-0.25,
        bytes=(72, 105),
        top_logprobs=(TopLogprob(token="Hi", token_id=7, logprob=-0.25, bytes=(72, 105)),),
    )
    entry = {
        "token": "Hi",
        "logprob": -0.25,
        "bytes": [72, 105],
        "top_logprobs": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105]}],
    }
    events = await stream_events([token("Hi", logprobs=(logprob,)), finish()])
    assert events[4]["logprobs"] == [entry]
    assert events[5]["logprobs"] == [entry]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == [entry]


@pytest.mark.anyio
async def test_stream_echoes_the_request() -> None:
    context = context_for(
        instructions="Be brief.",
        max_output_tokens=20,
        temperature=0,
        top_p=0.9,
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        reasoning={"effort": "low", "summary": "auto"},
        text={"format": {"type": "text"}, "verbosity": "low"},
        metadata={"k": "v"},
        user="me",
    )
    events = await stream_events([finish()], context)
    final = events[-1]["response"]
    assert {
        key: final[key] for key in ("instructions", "max_output_tokens", "temperature", "top_p")
    } == {
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "temperature": 0,
        "top_p": 0.9,
    }
    assert final["tools"] == [
        {
            "type": "function",
            "name": "f",
            "description": None,
            "parameters": {"type": "object"},
            "strict": True,
        }
    ]
    assert final["tool_choice"] == {"type": "function", "name": "f"}
    assert final["parallel_tool_calls"] is False
    assert final["reasoning"] == {"effort": "low", "summary": "auto"}
    assert final["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert (final["store"], final["metadata"], final["user"]) == (False, {"k": "v"}, "me")
    assert (final["model"], final["object"]) == (MODEL, "response")


def test_response_ids_name_their_command_for_cancel() -> None:
    assert RESPONSE_ID.startswith("resp_")
    assert command_id_in_response_id(RESPONSE_ID) == COMMAND_ID


# ---------------------------------------------------------------- collection


@pytest.mark.anyio
async def test_collect_matches_the_streamed_final_response() -> None:
    chunks: list[Chunk] = [
        token(reasoning="Hmm."),
        token("Hi"),
        tool_calls(("c", "f", "{}"), reason="tool_calls"),
    ]
    response = await collect(chunks)
    streamed = (await stream_events(chunks))[-1]["response"]
    collected = response.model_dump(mode="json")
    collected.pop("completed_at"), streamed.pop("completed_at")
    assert collected == streamed
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    sdk = SdkResponse.model_validate(response.model_dump(mode="json"))
    assert sdk.output_text == "Hi"


@pytest.mark.anyio
async def test_collect_length_is_incomplete_and_stops_reading() -> None:
    source = ChunkSource([token("a"), finish("length"), token("never read")])
    response = await collect(source)
    assert source.taken == 2
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.anyio
async def test_collect_cancelled_keeps_the_partial_output() -> None:
    response = await collect([token("Part"), finish("cancelled")])
    assert response.status == "cancelled"
    assert SdkResponse.model_validate(response.model_dump(mode="json")).output_text == "Part"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("chunks", "error_class", "message"),
    [
        ([token("a"), error_chunk("runner crashed")], GenerationError, "runner crashed"),
        ([error_chunk("prompt too long", 400)], InvalidRequestError, "prompt too long"),
        ([token("a"), finish("error")], GenerationError, "generation failed"),
        ([token("a")], GenerationError, "without a finish"),
    ],
)
async def test_collect_failures_raise(
    chunks: list[Chunk], error_class: type[ApiError], message: str
) -> None:
    with pytest.raises(error_class) as caught:
        await collect(chunks)
    assert message in caught.value.message


@pytest.mark.anyio
async def test_usage_falls_back_to_counted_tokens() -> None:
    response = await collect([token("a"), token("b", finish_reason="stop")])
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.output_tokens) == (0, 2)


@pytest.mark.anyio
async def test_response_round_trips_through_json() -> None:
    response = await collect(
        [token(reasoning="r"), token("t"), tool_calls(("c", "f", "{}"), reason="tool_calls")]
    )
    assert ResponseObject.model_validate_json(response.model_dump_json()) == response


# ---------------------------------------------------------------- the official client


SCRIPTED_CHUNKS: dict[str, list[Chunk]] = {
    "hello": [token(reasoning="Greet."), token("Hel"), token("lo"), finish(text=" world")],
    "weather": [tool_calls(("call_1", "weather", '{"city": "Paris"}'), reason="tool_calls")],
    "crash": [token("partial"), error_chunk("runner crashed")],
    "20C": [token("It is 20C in Paris."), finish()],
}


class FakeState:
    instances: dict[str, Any] = {}
    custom_cards: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    unavailable_instances: dict[str, Any] = {}

    def instances_of_model(self, model_id: ModelId) -> list[Any]:
        return [make_instance(NodeId("node-a"))]


class FakeCluster:
    """What the real route needs from `ClusterClient`: one known model with an instance,
    and for each command the scripted chunks keyed by its last message's text."""

    def __init__(self) -> None:
        self.cards = {ModelId(MODEL): None}
        self.state = FakeState()
        self.commands: list[GenerateText] = []
        self.cancelled: list[CommandId] = []
        self.load_on_request = LoadOnRequest()
        self.stop = NodeStop()
        self.image_policy = ImagePolicy()

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        return True  # the state is what the test set

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            last = self.commands[-1].params.messages[-1].content
            for chunk in SCRIPTED_CHUNKS[last]:
                yield chunk

        yield chunks()

    async def submit(self, command: GenerateText) -> None:
        self.commands.append(command)

    def send_and_forget(self, command: CancelGeneration) -> None:
        self.cancelled.append(command.target_command_id)


@pytest.fixture(scope="module")
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture(scope="module")
def client(cluster: FakeCluster) -> Iterator[openai.OpenAI]:
    """The official client against the real app (routes, error handlers), in process."""
    with TestClient(create_app(cast(ClusterClient, cluster))) as http_client:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http_client, max_retries=0
        )


def test_openai_client_non_streaming(client: openai.OpenAI, cluster: FakeCluster) -> None:
    response = client.responses.create(model=MODEL, input="hello", store=False)
    assert command_id_in_response_id(response.id) == cluster.commands[-1].command_id
    assert response.status == "completed"
    assert response.output_text == "Hello world"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage is not None and response.usage.total_tokens == 8


def test_openai_client_streaming_events(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="hello", stream=True)
    events = list(stream)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello world"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Hello world"


def test_openai_client_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="hello") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello world"


def test_openai_client_function_call_round_trip(
    client: openai.OpenAI, cluster: FakeCluster
) -> None:
    tools: Any = [
        {
            "type": "function",
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": False,
        }
    ]
    response = client.responses.create(
        model=MODEL,
        input="weather",
        tools=tools,
        tool_choice={"type": "function", "name": "weather"},
    )
    (call,) = response.output
    assert call.type == "function_call"
    assert (call.name, call.call_id, json.loads(call.arguments)) == (
        "weather",
        "call_1",
        {"city": "Paris"},
    )
    # Replaying the output plus the result is the next request.
    follow_up: list[Any] = [
        {"role": "user", "content": "weather"},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "20C"},
    ]
    answer = client.responses.create(model=MODEL, input=follow_up, tools=tools)
    assert answer.output_text == "It is 20C in Paris."
    assert cluster.commands[-1].params.messages[1:] == (
        ChatMessage(
            role="assistant",
            tool_calls=(ToolCall(id="call_1", name="weather", arguments='{"city": "Paris"}'),),
        ),
        ChatMessage(role="tool", content="20C", tool_call_id="call_1"),
    )


def test_route_passes_the_converted_request_to_the_cluster(
    client: openai.OpenAI, cluster: FakeCluster
) -> None:
    client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="hello",
        max_output_tokens=17,
        temperature=0,
        reasoning={"effort": "low"},
    )
    params = cluster.commands[-1].params
    assert params.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="hello"),
    )
    assert (params.max_tokens, params.temperature, params.enable_thinking) == (17, 0, True)


def test_max_output_tokens_below_openais_minimum_is_refused_as_openai_words_it(
    client: openai.OpenAI, cluster: FakeCluster
) -> None:
    """OpenAI's least `max_output_tokens` is 16; below it, its 400 (param, code, sentence)."""
    sent = len(cluster.commands)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="hello", max_output_tokens=10)
    assert raised.value.body == {
        "message": "Invalid 'max_output_tokens': integer below minimum value. Expected a value "
        ">= 16, but got 10 instead.",
        "type": "invalid_request_error",
        "param": "max_output_tokens",
        "code": "integer_below_min_value",
    }
    assert len(cluster.commands) == sent
    client.responses.create(model=MODEL, input="hello", max_output_tokens=16)
    assert cluster.commands[-1].params.max_tokens == 16


def test_openai_client_sees_a_failed_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="crash", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error is not None
    assert events[-1].response.error.message == "runner crashed"


def test_openai_client_non_streaming_failure_is_an_api_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="runner crashed"):
        client.responses.create(model=MODEL, input="crash")


def test_openai_client_gets_bad_request_for_previous_response_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hello", previous_response_id="resp_1")
    assert caught.value.body is not None
    assert "does not store" in str(caught.value.body)


def test_route_errors_are_openai_shaped(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="no/such-model", input="hello")
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as schema:
        client.responses.create(model=MODEL, input=cast(Any, 42))
    assert isinstance(schema.value.body, dict) and schema.value.body["param"].startswith("input")
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(
            model=MODEL,
            input=cast(
                Any,
                [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x/y"}],
                    }
                ],
            ),
        )
    assert isinstance(image.value.body, dict)
    assert image.value.body["param"] == "input[0].content[0]"
    assert image.value.body["type"] == "invalid_request_error"
