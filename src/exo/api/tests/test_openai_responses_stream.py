"""The OpenAI Responses adapter's output: the SSE event sequence (checked against the
official SDK's event types) and the collected response."""

from __future__ import annotations

import pytest
from openai.types.responses import Response as SdkResponse

from exo.api.openai_responses.response_types import ResponseObject
from exo.api.serving.response_ids import command_id_in_response_id
from exo.api.tests.openai_responses_builders import (
    COMMAND_ID,
    HEX,
    MODEL,
    MSG0,
    MSG1,
    RESPONSE_ID,
    RS0,
    collect,
    context_for,
    error_chunk,
    finish,
    shape,
    stream_events,
    token,
    tool_calls,
)
from exo.api.wire.errors import ApiError, GenerationError, InvalidRequestError
from exo.shared.types.chunks import (
    Chunk,
    TokenLogprob,
    TopLogprob,
)
from exo.testing.chunks import ChunkSource

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
