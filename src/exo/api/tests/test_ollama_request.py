"""The Ollama adapter's request side: model names, timestamps, and `/api/chat` and
`/api/generate` bodies converted to the internal params (options, think, format, images,
tools, logprobs) or refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from exo.api.ollama.request import (
    chat_to_task_params,
    generate_to_task_params,
    resolve_model_name,
    rfc3339_nano,
)
from exo.api.tests.ollama_builders import CREATED_AT, MODEL, WALL_NS, chat_request, generate_request
from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, NamedToolChoice, ToolCall

# ---------------------------------------------------------------- names and times


def test_model_names_resolve_with_and_without_latest_tag() -> None:
    known = [ModelId("org/model")]
    assert resolve_model_name("org/model", known) == "org/model"
    assert resolve_model_name("org/model:latest", known) == "org/model"
    assert resolve_model_name("org/model:7b", known) is None
    assert resolve_model_name("other", known) is None


def test_created_at_is_rfc3339_with_nanoseconds() -> None:
    assert rfc3339_nano(WALL_NS) == CREATED_AT
    assert rfc3339_nano(1_700_000_000_500_000_000) == "2023-11-14T22:13:20.5Z"
    assert rfc3339_nano(0) == "1970-01-01T00:00:00Z"


# ---------------------------------------------------------------- request conversion


def test_chat_messages_and_defaults() -> None:
    request = chat_request(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "thinking": "greet back"},
            {"role": "user", "content": None},
        ]
    )
    params = chat_to_task_params(request, ModelId(MODEL))
    assert params.messages == (
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content="hello", reasoning_content="greet back"),
        ChatMessage(role="user", content=""),
    )
    assert params.stream is True, "Ollama streams unless told not to"
    assert params.max_tokens is None and params.temperature is None
    assert params.response_format == "text" and params.tools == ()
    assert params.enable_thinking is None and params.reasoning_effort is None


def test_options_map_to_internal_fields() -> None:
    options = {
        "temperature": 0.5,
        "top_p": 0.8,
        "top_k": 20,
        "min_p": 0.05,
        "seed": 42,
        "num_predict": 12,
        "stop": ["\n", ""],
        "repeat_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "num_ctx": 4096,  # the request's context window
        "mirostat": 0,  # off: accepted
        "num_thread": 4,  # a load-time option: accepted, placement decides
    }
    params = chat_to_task_params(chat_request(options=options, stream=False), ModelId(MODEL))
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.5, 0.8, 20, 0.05)
    assert (params.seed, params.max_tokens, params.stop) == (42, 12, ("\n",))
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (
        1.1,
        0.5,
        -0.5,
    )
    assert params.stream is False
    assert params.context_tokens == 4096


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("typical_p", 0.9),
        ("tfs_z", 0.95),
        ("mirostat", 1),
        ("penalize_newline", False),
        ("repeat_last_n", -2),
    ],
)
def test_sampling_options_exo_does_not_have_are_refused_by_name(option: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        chat_to_task_params(chat_request(options={option: value}), ModelId(MODEL))
    assert raised.value.param == f"options.{option}"
    assert raised.value.message.startswith(f"options.{option}: ")


def test_repeat_last_n_zero_turns_the_repeat_penalty_off() -> None:
    on = chat_to_task_params(
        chat_request(options={"repeat_penalty": 1.3, "repeat_last_n": -1}), ModelId(MODEL)
    )
    off = chat_to_task_params(
        chat_request(options={"repeat_penalty": 1.3, "repeat_last_n": 0}), ModelId(MODEL)
    )
    assert (on.repetition_penalty, off.repetition_penalty) == (1.3, 1.0)


def test_repeat_last_n_limits_the_repeat_penalty_to_a_window() -> None:
    windowed = chat_to_task_params(
        chat_request(options={"repeat_penalty": 1.3, "repeat_last_n": 64}), ModelId(MODEL)
    )
    short = chat_to_task_params(
        chat_request(options={"repeat_penalty": 1.3, "repeat_last_n": 8}), ModelId(MODEL)
    )
    whole = chat_to_task_params(chat_request(options={"repeat_last_n": -1}), ModelId(MODEL))
    assert (windowed.repetition_penalty, windowed.repetition_window) == (1.3, 64)
    assert short.repetition_window == 8
    assert whole.repetition_window is None


def test_unset_repeat_last_n_is_ollamas_default_window() -> None:
    params = chat_to_task_params(chat_request(options={"repeat_penalty": 1.3}), ModelId(MODEL))
    assert (params.repetition_penalty, params.repetition_window) == (1.3, 64)


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_non_positive_num_predict_means_no_limit(num_predict: int) -> None:
    params = chat_to_task_params(chat_request(options={"num_predict": num_predict}), ModelId(MODEL))
    assert params.max_tokens is None


def test_llama_cpp_sentinels_for_seed_and_top_k() -> None:
    params = chat_to_task_params(
        chat_request(options={"seed": -1, "top_k": -1, "stop": "END"}), ModelId(MODEL)
    )
    assert (params.seed, params.top_k, params.stop) == (None, 0, ("END",))


def test_out_of_range_option_is_named_as_ollama_spells_it() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        chat_to_task_params(chat_request(options={"temperature": 5}), ModelId(MODEL))
    assert raised.value.param == "options.temperature"
    assert raised.value.message.startswith("options.temperature:")
    with pytest.raises(InvalidRequestError) as raised:
        chat_to_task_params(chat_request(options={"repeat_penalty": -1}), ModelId(MODEL))
    assert raised.value.param == "options.repeat_penalty"


@pytest.mark.parametrize(
    ("think", "enable_thinking", "effort"),
    [(True, True, None), (False, False, None), ("low", True, "low"), ("high", True, "high")],
)
def test_think_maps_to_enable_thinking_and_effort(
    think: Any, enable_thinking: bool, effort: str | None
) -> None:
    params = chat_to_task_params(chat_request(think=think), ModelId(MODEL))
    assert (params.enable_thinking, params.reasoning_effort) == (enable_thinking, effort)


def test_format_json_and_refusals() -> None:
    assert chat_to_task_params(chat_request(format="json"), ModelId(MODEL)).response_format == (
        "json_object"
    )
    assert chat_to_task_params(chat_request(format=""), ModelId(MODEL)).response_format == "text"
    schema_params = chat_to_task_params(chat_request(format={"type": "object"}), ModelId(MODEL))
    assert (schema_params.response_format, schema_params.json_schema) == (
        "json_schema",
        {"type": "object"},
    )
    with pytest.raises(InvalidRequestError, match="invalid format 'xml'"):
        chat_to_task_params(chat_request(format="xml"), ModelId(MODEL))


def test_images_are_refused_with_the_missing_capability() -> None:
    request = chat_request(messages=[{"role": "user", "content": "what?", "images": ["aGk="]}])
    with pytest.raises(InvalidRequestError, match="no vision capability") as raised:
        chat_to_task_params(request, ModelId(MODEL), ("text",))
    assert raised.value.param == "messages[0].images"
    with pytest.raises(InvalidRequestError, match="image input is not supported yet"):
        chat_to_task_params(request, ModelId(MODEL), ("text", "vision"))
    with pytest.raises(InvalidRequestError, match="no vision capability"):
        generate_to_task_params(generate_request(images=["aGk="]), ModelId(MODEL))


def test_tools_and_tool_history_round_trip() -> None:
    request = chat_request(
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Weather of a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            },
            {"type": "function", "function": {"name": "get_time"}},
        ],
        messages=[
            {"role": "user", "content": "weather and time in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"function": {"name": "get_time", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                ],
            },
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
            {"role": "tool", "content": "noon"},
        ],
    )
    params = chat_to_task_params(request, ModelId(MODEL))
    assert [tool.name for tool in params.tools] == ["get_weather", "get_time"]
    assert params.tools[0].description == "Weather of a city"
    assert params.tools[1].parameters == {}
    assert params.tool_choice == "auto"
    assistant = params.messages[1]
    assert assistant.tool_calls == (
        ToolCall(id="call_1_0", name="get_time", arguments='{"city": "Paris"}'),
        ToolCall(id="call_1_1", name="get_weather", arguments='{"city": "Paris"}'),
    )
    # tool_name picks its call; a nameless result answers the oldest unanswered call.
    assert params.messages[2] == ChatMessage(
        role="tool", content="sunny", name="get_weather", tool_call_id="call_1_1"
    )
    assert params.messages[3] == ChatMessage(
        role="tool", content="noon", name="get_time", tool_call_id="call_1_0"
    )


def test_tool_choice_extension() -> None:
    tools = [{"function": {"name": "f"}}, {"function": {"name": "g"}}]
    named = {"type": "function", "function": {"name": "g"}}
    params = chat_to_task_params(chat_request(tools=tools, tool_choice=named), ModelId(MODEL))
    assert params.tool_choice == NamedToolChoice(name="g")
    params = chat_to_task_params(chat_request(tools=tools, tool_choice="none"), ModelId(MODEL))
    assert params.tool_choice == "none"
    unknown = {"type": "function", "function": {"name": "h"}}
    with pytest.raises(InvalidRequestError, match="'h'"):
        chat_to_task_params(chat_request(tools=tools, tool_choice=unknown), ModelId(MODEL))


def test_tool_call_ids_given_by_the_client_are_kept() -> None:
    request = chat_request(
        messages=[
            {"role": "user", "content": "x"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "abc", "function": {"name": "f", "arguments": {}}}],
            },
            {"role": "tool", "content": "1", "tool_call_id": "abc"},
        ]
    )
    params = chat_to_task_params(request, ModelId(MODEL))
    assert params.messages[1].tool_calls == (ToolCall(id="abc", name="f", arguments="{}"),)
    assert params.messages[2].tool_call_id == "abc" and params.messages[2].name == "f"


def test_tool_call_arguments_that_are_not_an_object_are_refused() -> None:
    request = chat_request(
        messages=[
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}
        ]
    )
    with pytest.raises(InvalidRequestError) as raised:
        chat_to_task_params(request, ModelId(MODEL))
    assert raised.value.param == "messages[0].tool_calls[0].function.arguments"


def test_logprobs_request_fields() -> None:
    params = chat_to_task_params(chat_request(logprobs=True, top_logprobs=3), ModelId(MODEL))
    assert (params.logprobs, params.top_logprobs) == (True, 3)
    with pytest.raises(InvalidRequestError, match="requires logprobs"):
        chat_to_task_params(chat_request(top_logprobs=3), ModelId(MODEL))


def test_generate_prompt_and_system_become_chat_turns() -> None:
    params = generate_to_task_params(
        generate_request(system="be brief", format="json", options={"num_predict": 5}),
        ModelId(MODEL),
    )
    assert params.messages == (
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    )
    assert (params.response_format, params.max_tokens, params.stream) == ("json_object", 5, True)
    # Empty or false values ask for nothing.
    generate_to_task_params(
        generate_request(suffix="", raw=False, context=[], template=""), ModelId(MODEL)
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("suffix", "}", "suffix"),
        ("template", "{{ .Prompt }}", "template override"),
        ("context", [1, 2, 3], "context"),
    ],
)
def test_generate_refuses_what_it_cannot_honour(field: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as raised:
        generate_to_task_params(generate_request(**{field: value}), ModelId(MODEL))
    assert raised.value.param == field


def test_raw_generate_sends_the_prompt_without_a_template() -> None:
    params = generate_to_task_params(
        generate_request(prompt="Once upon", raw=True, options={"num_predict": 3}),
        ModelId(MODEL),
    )
    assert (params.prompt, params.messages, params.max_tokens) == ("Once upon", (), 3)
