"""The OpenAI Chat Completions adapter: request conversion, SSE shape, collection, and the
official `openai` client against a tiny server that uses the adapter."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from exo.api.openai_chat.request import (
    new_completion_id,
    to_task_params,
)
from exo.api.openai_chat.response import collect_chat_completion, stream_chat_completion
from exo.api.openai_chat.wire_types import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorResponse,
    ModelList,
    ModelObject,
)
from exo.api.wire.errors import (
    GenerationError,
    InvalidRequestError,
    describe_validation_errors,
    openai_error_body,
    openai_error_body_for,
)
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    PrefillProgressChunk,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolCall,
    ToolDefinition,
)
from exo.testing.chunks import ChunkSource

MODEL = "test-model"
COMMAND_ID = CommandId("command-1")


# ---------------------------------------------------------------- builders


def make_request(**fields: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return ChatCompletionRequest.model_validate(body)


def token(
    text: str,
    token_ids: tuple[int, ...] = (1,),
    finish_reason: FinishReason | None = None,
    usage: Usage | None = None,
) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        text=text,
        token_ids=token_ids,
        finish_reason=finish_reason,
        usage=usage,
    )


def finish(
    text: str = "",
    reason: FinishReason = "stop",
    prompt_tokens: int = 5,
    completion_tokens: int = 3,
) -> TokenChunk:
    return token(
        text,
        token_ids=(9,) if text else (),
        finish_reason=reason,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
    )


def error_chunk(message: str = "runner crashed") -> ErrorChunk:
    return ErrorChunk(command_id=COMMAND_ID, model=ModelId(MODEL), error_message=message)


def prefill(prefilled_tokens: int, prompt_tokens: int = 2048) -> PrefillProgressChunk:
    return PrefillProgressChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        prompt_tokens=prompt_tokens,
        cached_tokens=256,
        prefilled_tokens=prefilled_tokens,
    )


async def stream_events(
    chunks: Sequence[Chunk] | ChunkSource,
    include_usage: bool = False,
    params: TextGenerationTaskParams | None = None,
) -> list[Any]:
    """Run the stream adapter; each SSE event parsed as JSON, `[DONE]` kept as a string."""
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    events: list[Any] = []
    async for line in stream_chat_completion(
        source,
        completion_id="chatcmpl-1",
        model=MODEL,
        created=1700,
        include_usage=include_usage,
        params=params,
    ):
        assert line.startswith("data: ") and line.endswith("\n\n"), line
        payload = line.removeprefix("data: ").removesuffix("\n\n")
        assert "\n" not in payload, "one SSE event must be one data line"
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def collect(
    chunks: Sequence[Chunk] | ChunkSource, params: TextGenerationTaskParams | None = None
) -> ChatCompletionResponse:
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    return await collect_chat_completion(
        source, completion_id="chatcmpl-1", model=MODEL, created=1700, params=params
    )


def reasoning(text: str) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND_ID, model=ModelId(MODEL), text="", reasoning_text=text, token_ids=(1,)
    )


def calls(*pairs: tuple[str, str], finish_reason: FinishReason | None = None) -> ToolCallChunk:
    return ToolCallChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        tool_calls=tuple(
            ToolCall(id=f"call_{name}", name=name, arguments=arguments) for name, arguments in pairs
        ),
        token_ids=(1, 2),
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=5, completion_tokens=9, reasoning_tokens=2)
        if finish_reason
        else None,
    )


LOGPROB = TokenLogprob(
    token="Hi",
    token_id=7,
    logprob=-0.5,
    bytes=(72, 105),
    top_logprobs=(
        TopLogprob(token="Hi", token_id=7, logprob=-0.5, bytes=(72, 105)),
        TopLogprob(token="Ho", token_id=8, logprob=-1.5, bytes=(72, 111)),
    ),
)
LOGPROB_JSON = {
    "token": "Hi",
    "logprob": -0.5,
    "bytes": [72, 105],
    "top_logprobs": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
        {"token": "Ho", "logprob": -1.5, "bytes": [72, 111]},
    ],
}


def with_logprobs(text: str) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND_ID, model=ModelId(MODEL), text=text, token_ids=(7,), logprobs=(LOGPROB,)
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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
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


# ---------------------------------------------------------------- SSE stream


@pytest.mark.anyio
async def test_stream_shape_without_usage() -> None:
    events = await stream_events([token("Hel"), token("lo"), finish()])
    assert len(events) == 5
    first, *deltas, final, done = events
    for event in (first, *deltas, final):
        assert event["id"] == "chatcmpl-1"
        assert event["object"] == "chat.completion.chunk"
        assert event["created"] == 1700
        assert event["model"] == MODEL
        assert "usage" not in event
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
    ]
    assert [event["choices"][0]["delta"] for event in deltas] == [
        {"content": "Hel"},
        {"content": "lo"},
    ]
    assert all(event["choices"][0]["finish_reason"] is None for event in deltas)
    assert final["choices"] == [
        {"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}
    ]
    assert done == "[DONE]"


@pytest.mark.anyio
async def test_stream_usage_chunk_only_with_include_usage() -> None:
    events = await stream_events([token("a"), finish(prompt_tokens=4, completion_tokens=2)], True)
    *chunks, usage_event, done = events
    assert done == "[DONE]"
    assert all(event["usage"] is None for event in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage_event["choices"] == []
    assert usage_event["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@pytest.mark.anyio
async def test_stream_finishing_text_comes_before_the_finish_chunk() -> None:
    events = await stream_events([token("a"), token(""), finish("b", reason="length")])
    assert [event["choices"][0] for event in events[1:3]] == [
        {"index": 0, "delta": {"content": "a"}, "finish_reason": None, "logprobs": None},
        {"index": 0, "delta": {"content": "b"}, "finish_reason": None, "logprobs": None},
    ]
    assert events[3]["choices"][0]["delta"] == {}
    assert events[3]["choices"][0]["finish_reason"] == "length"
    assert events[4] == "[DONE]"
    assert len(events) == 5


@pytest.mark.anyio
async def test_stream_stops_reading_at_the_finish() -> None:
    source = ChunkSource([token("a"), finish(), token("never"), finish()])
    events = await stream_events(source)
    assert source.taken == 2
    assert events[-1] == "[DONE]"
    assert all("never" not in json.dumps(event) for event in events)


@pytest.mark.anyio
async def test_stream_error_mid_stream_sends_error_event_then_done() -> None:
    source = ChunkSource([token("partial"), error_chunk("runner crashed"), token("never")])
    events = await stream_events(source, include_usage=True)
    assert source.taken == 2
    assert events[1]["choices"][0]["delta"] == {"content": "partial"}
    assert events[2] == openai_error_body(
        "runner crashed", "server_error", None, "generation_failed"
    )
    ErrorResponse.model_validate(events[2])
    assert events[3] == "[DONE]"
    assert len(events) == 4


@pytest.mark.anyio
async def test_stream_cancelled_generation_is_reported_as_an_error() -> None:
    events = await stream_events([token("a"), finish(reason="cancelled")])
    assert events[-2]["error"]["code"] == "generation_cancelled"
    assert events[-1] == "[DONE]"
    assert not any(
        isinstance(event, dict) and event.get("choices") and event["choices"][0]["finish_reason"]
        for event in events
    )


@pytest.mark.anyio
async def test_stream_without_finish_ends_with_an_error() -> None:
    events = await stream_events([token("a")])
    assert "without a finish" in events[-2]["error"]["message"]
    assert events[-1] == "[DONE]"


@pytest.mark.anyio
async def test_stream_usage_falls_back_to_counted_tokens() -> None:
    events = await stream_events(
        [token("a", token_ids=(1, 2)), token("", token_ids=(3,), finish_reason="stop")], True
    )
    assert events[-2]["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 3,
        "total_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@pytest.mark.anyio
async def test_stream_events_parse_as_chunks() -> None:
    events = await stream_events([token("x"), finish()], include_usage=True)
    for event in events[:-1]:
        ChatCompletionChunk.model_validate(event)


@pytest.mark.anyio
async def test_stream_reasoning_then_tool_calls_then_tool_calls_finish() -> None:
    events = await stream_events(
        [
            reasoning("think"),
            calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}")),
            calls(("f", "{}"), finish_reason="tool_calls"),
        ],
        include_usage=True,
    )
    deltas = [event["choices"][0]["delta"] for event in events[1:5]]
    assert deltas == [
        {"reasoning_content": "think"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_get_weather",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ]
        },
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_get_time",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                }
            ]
        },
        {
            "tool_calls": [
                {
                    "index": 2,
                    "id": "call_f",
                    "type": "function",
                    "function": {"name": "f", "arguments": "{}"},
                }
            ]
        },
    ]
    assert events[5]["choices"] == [
        {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}
    ]
    assert events[6]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    assert events[7] == "[DONE]" and len(events) == 8
    for event in events[:-1]:
        ChatCompletionChunk.model_validate(event)


@pytest.mark.anyio
async def test_stream_logprobs_only_when_asked() -> None:
    asked = to_task_params(make_request(logprobs=True, top_logprobs=2))
    events = await stream_events([with_logprobs("Hi"), finish()], params=asked)
    assert events[1]["choices"][0] == {
        "index": 0,
        "delta": {"content": "Hi"},
        "finish_reason": None,
        "logprobs": {"content": [LOGPROB_JSON], "refusal": None},
    }
    unasked = await stream_events([with_logprobs("Hi"), finish()])
    assert unasked[1]["choices"][0]["logprobs"] is None


# ---------------------------------------------------------------- collect


@pytest.mark.anyio
async def test_collect_tool_calls_reasoning_and_usage_details() -> None:
    response = await collect(
        [reasoning("hmm"), calls(("get_weather", '{"city": "Paris"}'), finish_reason="tool_calls")]
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.model_dump_json()) == {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "reasoning_content": "hmm",
        "tool_calls": [
            {
                "id": "call_get_weather",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }
    assert response.usage is not None and response.usage.completion_tokens_details is not None
    assert response.usage.completion_tokens_details.reasoning_tokens == 2


@pytest.mark.anyio
async def test_collect_plain_answer_has_no_tool_or_reasoning_keys() -> None:
    response = await collect([token("Hi"), finish()])
    assert json.loads(response.choices[0].message.model_dump_json()) == {
        "role": "assistant",
        "content": "Hi",
        "refusal": None,
    }
    assert response.choices[0].logprobs is None


@pytest.mark.anyio
async def test_collect_logprobs_when_asked() -> None:
    asked = to_task_params(make_request(logprobs=True, top_logprobs=2))
    response = await collect([with_logprobs("Hi"), with_logprobs("Hi"), finish()], asked)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None
    assert json.loads(logprobs.model_dump_json()) == {
        "content": [LOGPROB_JSON, LOGPROB_JSON],
        "refusal": None,
    }


@pytest.mark.anyio
async def test_collect_concatenates_text_and_reports_usage() -> None:
    response = await collect([token("Hel"), token("lo"), finish("!", completion_tokens=3)])
    assert response.id == "chatcmpl-1"
    assert response.object == "chat.completion"
    assert response.created == 1700
    assert response.model == MODEL
    assert len(response.choices) == 1
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == "Hello!"
    assert response.choices[0].finish_reason == "stop"
    assert response.usage is not None
    assert response.usage.model_dump() == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


@pytest.mark.anyio
async def test_collect_length_finish_and_stops_reading() -> None:
    source = ChunkSource([token("a"), finish(reason="length"), token("never")])
    response = await collect(source)
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.content == "a"
    assert source.taken == 2


@pytest.mark.anyio
async def test_collect_error_chunk_raises() -> None:
    with pytest.raises(GenerationError, match="out of memory"):
        await collect([token("a"), error_chunk("out of memory")])


@pytest.mark.anyio
async def test_collect_cancelled_raises() -> None:
    with pytest.raises(GenerationError, match="cancelled"):
        await collect([token("a"), finish(reason="cancelled")])


@pytest.mark.anyio
async def test_collect_without_finish_raises() -> None:
    with pytest.raises(GenerationError, match="without a finish"):
        await collect([token("a")])


# ---------------------------------------------------------------- wire types and errors


def test_response_types_round_trip_through_json() -> None:
    response = ChatCompletionResponse.model_validate(
        {
            "id": new_completion_id(),
            "created": 1,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )
    models = ModelList(
        data=[ModelObject(id=MODEL, created=1, owned_by="exo", capabilities=["text"])]
    )
    error = ErrorResponse.model_validate(openai_error_body("bad", "invalid_request_error", "n"))
    for value in (response, models, error):
        assert type(value).model_validate_json(value.model_dump_json()) == value
    assert json.loads(models.model_dump_json()) == {
        "object": "list",
        "data": [
            {
                "id": MODEL,
                "object": "model",
                "created": 1,
                "owned_by": "exo",
                "capabilities": ["text"],
            }
        ],
    }


def test_new_completion_id_has_openai_prefix_and_is_unique() -> None:
    first, second = new_completion_id(), new_completion_id()
    assert first.startswith("chatcmpl-") and first != second


def test_validation_errors_name_the_parameter() -> None:
    with pytest.raises(ValidationError) as caught:
        make_request(temperature=5)
    message, param = describe_validation_errors(caught.value.errors())
    assert param == "temperature"
    assert message.startswith("temperature: ")
    located = [{"loc": ("body", "messages", 0, "content"), "msg": "bad"}]
    assert describe_validation_errors(located) == (
        "messages[0].content: bad",
        "messages[0].content",
    )


# ---------------------------------------------------------------- official openai client


SCRIPTED_CHUNKS: dict[str, list[Chunk]] = {
    "hello": [token("Hel"), token("lo"), token(""), finish(" world", prompt_tokens=7)],
    "crash": [token("partial"), error_chunk("runner crashed")],
    "long prompt": [prefill(256), prefill(1024), prefill(2048), token("Hi"), finish()],
    "tools": [
        reasoning("hmm"),
        calls(("get_weather", '{"city": "Paris"}'), finish_reason="tool_calls"),
    ],
}


def build_app() -> FastAPI:
    """A stand-in for the real route: the adapter fed by scripted chunks keyed by the last
    user message."""
    app = FastAPI()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        request: ChatCompletionRequest,
    ) -> JSONResponse | StreamingResponse:
        try:
            params = to_task_params(request)
        except InvalidRequestError as error:
            return JSONResponse(openai_error_body_for(error), status_code=error.status_code)
        chunks = ChunkSource(SCRIPTED_CHUNKS[params.messages[-1].content])
        completion_id, created = new_completion_id(), int(time.time())
        if params.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                stream_chat_completion(
                    chunks,
                    completion_id=completion_id,
                    model=request.model,
                    created=created,
                    include_usage=include_usage,
                    params=params,
                ),
                media_type="text/event-stream",
            )
        try:
            response = await collect_chat_completion(
                chunks,
                completion_id=completion_id,
                model=request.model,
                created=created,
                params=params,
            )
        except GenerationError as error:
            return JSONResponse(openai_error_body_for(error), status_code=error.status_code)
        return JSONResponse(response.model_dump(mode="json"))

    return app


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))  # the kernel picks a free port; no race with others
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(build_app(), log_level="warning", lifespan="off", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 10.0, "uvicorn to start")
        assert server.started, "uvicorn exited during startup"
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=10.0, max_retries=0
        )
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
        listener.close()
        assert not thread.is_alive(), "uvicorn did not stop within 10 s"


def user_says(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_openai_client_non_streaming(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=user_says("hello"))
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (7, 3)
    assert completion.usage.total_tokens == 10


@pytest.mark.anyio
async def test_prefill_progress_is_a_comment_line_before_the_first_token() -> None:
    chunks: list[Chunk] = [prefill(256), prefill(1024), token("Hi"), prefill(2048), finish()]
    lines = [
        line
        async for line in stream_chat_completion(
            ChunkSource(chunks), completion_id="chatcmpl-1", model=MODEL, created=1700,
            include_usage=False, params=None,
        )
    ]  # fmt: skip
    comments = [line for line in lines if line.startswith(":")]
    first_token = next(index for index, line in enumerate(lines) if '"content":"Hi"' in line)
    assert lines[1:3] == comments[:2]  # after the opening role chunk, before the token
    assert first_token == 3
    assert [json.loads(line.removeprefix(": prefill ")) for line in comments] == [
        {"prompt_tokens": 2048, "cached_tokens": 256, "prefilled_tokens": done}
        for done in (256, 1024, 2048)
    ]
    assert all(line.endswith("\n\n") and line.count("\n") == 2 for line in comments)
    data = [line for line in lines if line.startswith("data: ")]
    assert len(data) + len(comments) == len(lines)


def test_openai_client_skips_prefill_progress(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=user_says("long prompt"), stream=True)
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Hi"


def test_openai_client_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user_says("hello"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert content == "Hello world"
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 10
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_openai_client_streaming_without_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=user_says("hello"), stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in chunks)


def test_openai_client_raises_on_mid_stream_error(client: openai.OpenAI) -> None:
    received: list[str] = []
    stream = client.chat.completions.create(model=MODEL, messages=user_says("crash"), stream=True)
    with pytest.raises(openai.APIError, match="runner crashed"):
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "partial"


def test_openai_client_raises_on_non_streaming_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="runner crashed"):
        client.chat.completions.create(model=MODEL, messages=user_says("crash"))


def test_openai_client_gets_bad_request_for_unsupported_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported") as caught:
        client.chat.completions.create(model=MODEL, messages=user_says("hello"), n=3)
    assert caught.value.param == "n"


def test_seeds_outside_what_a_generator_takes_are_schema_errors() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ChatCompletionRequest.model_validate({**base, "seed": 2**64 - 1})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**base, "seed": 2**64})


def test_openai_client_tool_calls(client: openai.OpenAI) -> None:
    tools: Any = [WEATHER_TOOL]
    completion = client.chat.completions.create(
        model=MODEL, messages=user_says("tools"), tools=tools, tool_choice="required"
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id == "call_get_weather"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert completion.usage is not None and completion.usage.completion_tokens_details is not None
    assert completion.usage.completion_tokens_details.reasoning_tokens == 2

    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=user_says("tools"), tools=tools, stream=True
        )
    )
    deltas = [
        tool_call for chunk in streamed for tool_call in (chunk.choices[0].delta.tool_calls or [])
    ]
    assert [(d.index, d.id, d.function and d.function.name) for d in deltas] == [
        (0, "call_get_weather", "get_weather")
    ]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_streamed_forced_tool_call_accumulates_null_content(client: openai.OpenAI) -> None:
    """Trial 40: a "required" call streamed began with `content: ""`, so the SDK's
    accumulated message had content '' where OpenAI's (and exo's non-streaming) is null."""
    tools: Any = [WEATHER_TOOL]
    with client.chat.completions.stream(
        model=MODEL, messages=user_says("tools"), tools=tools, tool_choice="required"
    ) as events:
        for _ in events:
            pass
        final = events.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert message.content is None
