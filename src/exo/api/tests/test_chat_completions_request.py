"""The OpenAI Chat Completions adapter's request conversion: messages, sampling fields,
tools and tool choice, and what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from exo.api.openai_chat.request import (
    to_task_params,
)
from exo.api.openai_chat.wire_types import (
    ChatCompletionRequest,
)
from exo.api.tests.chat_completions_builders import (
    MODEL,
    WEATHER_TOOL,
    make_request,
)
from exo.api.wire.errors import (
    InvalidRequestError,
)
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)

# ---------------------------------------------------------------- request conversion


def test_string_content_becomes_user_message() -> None:
    params = to_task_params(make_request())
    assert params.model == ModelId(MODEL)
    assert params.messages == (ChatMessage(role="user", content="hi"),)


def test_text_parts_are_joined_with_newlines() -> None:
    request = make_request(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
            }
        ]
    )
    assert to_task_params(request).messages[0].content == "first\nsecond"


def test_roles_names_and_tool_call_ids_are_mapped() -> None:
    request = make_request(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "system", "content": [{"type": "text", "text": "sys"}]},
            {"role": "user", "content": "q", "name": "alice"},
            {"role": "assistant", "content": None, "refusal": "no"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "still no"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    }
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert to_task_params(request).messages == (
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="system", content="sys"),
        ChatMessage(role="user", content="q", name="alice"),
        ChatMessage(role="assistant", content="no"),
        ChatMessage(role="assistant", content="still no"),
        ChatMessage(role="assistant", tool_calls=(ToolCall(id="call_1", name="f"),)),
        ChatMessage(role="tool", content="42", tool_call_id="call_1"),
    )


def test_a_tool_result_without_its_call_is_refused() -> None:
    request = make_request(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "tool", "content": "42", "tool_call_id": "call_9"},
        ]
    )
    with pytest.raises(InvalidRequestError, match="call_9"):
        to_task_params(request)


def test_null_user_content_is_a_schema_error() -> None:
    # OpenAI requires a user turn's content (a string or parts), and never null.
    with pytest.raises(ValidationError):
        make_request(messages=[{"role": "user", "content": None}])


def test_image_part_is_refused_naming_the_part() -> None:
    request = make_request(
        messages=[
            {"role": "user", "content": "look"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
        ]
    )
    with pytest.raises(InvalidRequestError, match="no vision capability") as caught:
        to_task_params(request)
    assert caught.value.param == "messages[1].content[1]"
    assert caught.value.status_code == 400


def test_unknown_role_is_a_schema_error() -> None:
    with pytest.raises(ValidationError):
        make_request(messages=[{"role": "narrator", "content": "x"}])


def test_empty_messages_is_a_schema_error() -> None:
    with pytest.raises(ValidationError):
        make_request(messages=[])


def test_sampling_fields_pass_through_and_absent_stay_none() -> None:
    params = to_task_params(
        make_request(temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, stream=True)
    )
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        0.5,
        0.9,
        40,
        0.05,
        7,
    )
    assert params.stream is True
    defaults = to_task_params(make_request())
    assert (
        defaults.temperature,
        defaults.top_p,
        defaults.top_k,
        defaults.min_p,
        defaults.seed,
        defaults.max_tokens,
    ) == (None, None, None, None, None, None)
    assert defaults.stream is False


def test_integer_temperature_is_accepted() -> None:
    assert to_task_params(make_request(temperature=1)).temperature == 1.0


def test_top_k_minus_one_means_disabled() -> None:
    assert to_task_params(make_request(top_k=-1)).top_k == 0


def test_out_of_range_temperature_is_a_schema_error() -> None:
    with pytest.raises(ValidationError):
        make_request(temperature=3.0)


def test_max_completion_tokens_is_an_alias_of_max_tokens() -> None:
    assert to_task_params(make_request(max_completion_tokens=12)).max_tokens == 12
    assert to_task_params(make_request(max_tokens=7)).max_tokens == 7
    assert to_task_params(make_request(max_tokens=9, max_completion_tokens=9)).max_tokens == 9


def test_conflicting_max_tokens_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="disagree") as caught:
        to_task_params(make_request(max_tokens=5, max_completion_tokens=6))
    assert caught.value.param == "max_completion_tokens"


def test_n_above_one_is_refused() -> None:
    assert to_task_params(make_request(n=1)).messages
    with pytest.raises(InvalidRequestError, match="n=2 is not supported") as caught:
        to_task_params(make_request(n=2))
    assert caught.value.param == "n"


def test_json_schema_response_format_carries_its_schema() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    params = to_task_params(
        make_request(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        )
    )
    assert (params.response_format, params.json_schema) == ("json_schema", schema)
    # No schema: any JSON object.
    params = to_task_params(
        make_request(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    )
    assert params.json_schema == {"type": "object"}
    with pytest.raises(InvalidRequestError) as caught:
        to_task_params(make_request(response_format={"type": "json_schema"}))
    assert caught.value.param == "response_format.json_schema"
    json_object = to_task_params(make_request(response_format={"type": "json_object"}))
    assert (json_object.response_format, json_object.json_schema) == ("json_object", None)


def test_logit_bias_keys_are_token_ids_and_biases_are_bounded() -> None:
    params = to_task_params(make_request(logit_bias={"7042": -100, "0": 2.5}))
    assert params.logit_bias == {7042: -100.0, 0: 2.5}
    for key in ("Paris", "-1", "1.5", " 12", ""):
        with pytest.raises(InvalidRequestError) as caught:
            to_task_params(make_request(logit_bias={key: 1}))
        assert caught.value.param == "logit_bias", key
    for bias in (-100.5, 101):
        with pytest.raises(InvalidRequestError) as caught:
            to_task_params(make_request(logit_bias={"5": bias}))
        assert caught.value.param == "logit_bias"


TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "function": {"name": "get_time"}}, NamedToolChoice(name="get_time")),
    ],
)
def test_tools_and_tool_choice_are_converted(tool_choice: Any, expected: Any) -> None:
    fields: dict[str, Any] = {"tools": [WEATHER_TOOL, TIME_TOOL], "parallel_tool_calls": False}
    if tool_choice is not None:
        fields["tool_choice"] = tool_choice
    params = to_task_params(make_request(**fields))
    assert params.tools == (
        ToolDefinition(
            name="get_weather",
            description="Weather of a city",
            parameters={"type": "object", "properties": {"city": {"type": "string"}}},
        ),
        ToolDefinition(name="get_time"),
    )
    assert params.tool_choice == expected
    assert params.parallel_tool_calls is False


def test_legacy_functions_and_function_call_map_like_tools() -> None:
    params = to_task_params(
        make_request(functions=[{"name": "get_time"}], function_call={"name": "get_time"})
    )
    assert params.tools == (ToolDefinition(name="get_time"),)
    assert params.tool_choice == NamedToolChoice(name="get_time")
    assert params.parallel_tool_calls is True
    legacy_none = to_task_params(make_request(functions=[{"name": "f"}], function_call="none"))
    assert legacy_none.tool_choice == "none"
    with pytest.raises(InvalidRequestError, match="not both"):
        to_task_params(make_request(tools=[TIME_TOOL], functions=[{"name": "f"}]))


@pytest.mark.parametrize(
    "fields",
    [
        {"tool_choice": "required"},
        {"tools": [TIME_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
    ],
)
def test_impossible_tool_choice_is_a_bad_request(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        to_task_params(make_request(**fields))
    assert caught.value.status_code == 400


def test_assistant_tool_calls_and_tool_results_are_history() -> None:
    request = make_request(
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need a tool",
                "tool_calls": [
                    {
                        "id": "call_a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_time", "arguments": ""},
            },
            {"role": "function", "name": "get_time", "content": "noon"},
        ],
    )
    messages = to_task_params(request).messages
    assert messages[1] == ChatMessage(
        role="assistant",
        content="",
        reasoning_content="need a tool",
        tool_calls=(ToolCall(id="call_a", name="get_weather", arguments='{"city": "Paris"}'),),
    )
    assert messages[2] == ChatMessage(role="tool", content="sunny", tool_call_id="call_a")
    assert messages[3].tool_calls == (ToolCall(id="call_3", name="get_time", arguments="{}"),)
    assert messages[4] == ChatMessage(
        role="tool", content="noon", name="get_time", tool_call_id="call_3"
    )


def test_replayed_arguments_must_be_a_json_object() -> None:
    request = make_request(
        messages=[
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1"}}
                ],
            }
        ]
    )
    with pytest.raises(InvalidRequestError) as caught:
        to_task_params(request)
    assert caught.value.param == "messages[0].tool_calls[0].function.arguments"


def test_logprobs_and_top_logprobs() -> None:
    params = to_task_params(make_request(logprobs=True, top_logprobs=5))
    assert (params.logprobs, params.top_logprobs) == (True, 5)
    assert to_task_params(make_request(logprobs=True)).top_logprobs == 0
    with pytest.raises(InvalidRequestError, match="requires logprobs") as caught:
        to_task_params(make_request(top_logprobs=5))
    assert caught.value.param == "top_logprobs"
    with pytest.raises(ValidationError):
        make_request(logprobs=True, top_logprobs=21)


def test_penalties_and_thinking_controls() -> None:
    params = to_task_params(
        make_request(
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            repetition_penalty=1.2,
            reasoning_effort="high",
        )
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.25)
    assert params.repetition_penalty == 1.2
    assert (params.enable_thinking, params.reasoning_effort) == (True, "high")
    off = to_task_params(make_request(chat_template_kwargs={"enable_thinking": False}))
    assert (off.enable_thinking, off.reasoning_effort) == (False, None)
    assert to_task_params(make_request(reasoning_effort="none")).enable_thinking is False
    with pytest.raises(InvalidRequestError) as caught:
        to_task_params(make_request(chat_template_kwargs={"enable_thinking": "yes"}))
    assert caught.value.param == "chat_template_kwargs.enable_thinking"
    with pytest.raises(ValidationError):
        make_request(repetition_penalty=0)


def test_harmless_feature_values_are_accepted() -> None:
    params = to_task_params(
        make_request(
            tools=[],
            tool_choice="none",
            logprobs=False,
            response_format={"type": "text"},
            frequency_penalty=0.0,
            presence_penalty=0.0,
            user="u-1",
        )
    )
    assert params.messages == (ChatMessage(role="user", content="hi"),)
    assert (params.tools, params.tool_choice, params.logprobs) == ((), "none", False)
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)


def test_stop_string_and_list_become_tuples() -> None:
    assert to_task_params(make_request()).stop == ()
    assert to_task_params(make_request(stop="END")).stop == ("END",)
    assert to_task_params(make_request(stop=["a", "", "b"])).stop == ("a", "b")
    assert to_task_params(make_request(stop="")).stop == ()
    assert to_task_params(make_request(stop=[f"s{i}" for i in range(16)])).stop[-1] == "s15"
    with pytest.raises(ValidationError):
        make_request(stop=[f"s{i}" for i in range(17)])


def test_stream_options_are_parsed() -> None:
    request = make_request(stream=True, stream_options={"include_usage": True})
    assert request.stream_options is not None
    assert request.stream_options.include_usage is True


def test_request_round_trips_through_json() -> None:
    request = make_request(stop=["x"], max_tokens=3, stream_options={"include_usage": False})
    again = ChatCompletionRequest.model_validate_json(request.model_dump_json())
    assert again == request
