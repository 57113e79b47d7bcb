"""The Claude Messages adapter's request conversion: the conversation (system, content
blocks, tool use and results, images), tools, tool choice and options, and what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from exo.api.claude_messages.request import (
    TOOL_ERROR_PREFIX,
    count_tokens_params,
)
from exo.api.claude_messages.wire_types import (
    CountTokensRequest,
    MessagesRequest,
)
from exo.api.tests.claude_messages_builders import (
    IMAGE,
    MODEL,
    USER_HI,
    make_request,
    params_of,
    refusal_of,
)
from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    ToolCall,
)

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
