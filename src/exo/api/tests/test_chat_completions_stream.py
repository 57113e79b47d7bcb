"""The OpenAI Chat Completions adapter's output: the SSE chunk sequence, the collected
response, the wire types and the error bodies."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from exo.api.openai_chat.request import (
    new_completion_id,
    to_task_params,
)
from exo.api.openai_chat.wire_types import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ErrorResponse,
    ModelList,
    ModelObject,
)
from exo.api.tests.chat_completions_builders import (
    LOGPROB_JSON,
    MODEL,
    calls,
    collect,
    error_chunk,
    finish,
    make_request,
    reasoning,
    stream_events,
    token,
    with_logprobs,
)
from exo.api.wire.errors import (
    GenerationError,
    describe_validation_errors,
    openai_error_body,
)
from exo.testing.chunks import ChunkSource

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
