"""The OpenAI Responses adapter's request conversion: input items, instructions, tools and
tool choice, sampling and output options, and what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from exo.api.openai_responses.request import (
    to_task_params,
)
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.tests.openai_responses_builders import (
    MODEL,
    make_request,
    messages_of,
    refusal,
)
from exo.shared.types.text_generation import ChatMessage, NamedToolChoice, ToolCall

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
