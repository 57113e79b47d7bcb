"""A forced tool call cut short by `max_tokens`, in every dialect: the model's output runs
through the runner's parser (`parse_generation`) and chunks (`piece_chunks`) into each
adapter. OpenAI returns the call with its arguments cut where the tokens ran out and
`finish_reason: "length"` (Responses: the item and the response incomplete); Anthropic
`stop_reason: "max_tokens"` with the `tool_use` block's input written whole so far; Ollama
(arguments as an object) the same input with `done_reason: "length"`. Never the call's raw
JSON as text, which the old parser released."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exo.api.tests import chat_completions_builders as chat
from exo.api.tests import claude_messages_builders as claude
from exo.api.tests import ollama_builders as ollama
from exo.api.tests import openai_responses_builders as responses
from exo.chat_protocol.output_parsing import OutputParser
from exo.shared.types.chunks import Chunk, FinishReason, Usage
from exo.shared.types.common import InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.tasks import TextGeneration
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams, ToolDefinition
from exo.worker.engines.parsed_generation import parse_generation
from exo.worker.engines.torch.batching.request_state import GeneratedPiece
from exo.worker.runner.piece_chunks import piece_chunks

WEATHER = ToolDefinition(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    },
)
# What the constrained decoder wrote before `max_tokens` ran out (`ToolCallRecognizer`'s
# frame): the first argument whole, the second cut inside its value.
CUT_OUTPUT = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel'
CUT_ARGUMENTS = '{"city": "Paris", "unit": "cel'
WHOLE_SO_FAR = {"city": "Paris"}
PARAMS = TextGenerationTaskParams(
    model=ModelId(chat.MODEL),
    messages=(ChatMessage(role="user", content="Weather in Paris?"),),
    tools=(WEATHER,),
    tool_choice="required",
    max_tokens=12,
)
RESPONSES_TOOLS = [{"type": "function", "name": WEATHER.name, "parameters": WEATHER.parameters}]


def chunks_for(output: str, finish_reason: FinishReason = "length") -> list[Chunk]:
    """The runner's chunks for a forced call whose output was `output`, a few characters a
    token, ended by `finish_reason`."""
    pieces = [
        GeneratedPiece(output[start : start + 5], (start,), None, None)
        for start in range(0, len(output), 5)
    ]
    usage = Usage(prompt_tokens=9, completion_tokens=len(pieces))
    pieces.append(GeneratedPiece("", (), finish_reason, usage))
    parser = OutputParser(
        PARAMS.offered_tools,
        "hermes",
        thinking_open=False,
        forced_tool_call=True,
        parse_reasoning=False,
    )
    task = TextGeneration(
        task_id=TaskId("task-1"),
        command_id=chat.COMMAND_ID,
        instance_id=InstanceId("instance-1"),
        origin_node_id=NodeId("node-1"),
        params=PARAMS,
    )
    chunks: list[Chunk] = []
    for index, piece in enumerate(parse_generation(pieces, parser, PARAMS)):
        cut = piece_chunks(task, piece, 9 if index == 0 else None)
        chunks.extend([cut.text] if cut.text is not None else [])
        chunks.extend(cut.after)
    return chunks


@pytest.mark.anyio
async def test_chat_returns_the_cut_call_with_finish_length() -> None:
    choice = (await chat.collect(chunks_for(CUT_OUTPUT), PARAMS)).model_dump()["choices"][0]
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": CUT_ARGUMENTS}


@pytest.mark.anyio
async def test_chat_stream_returns_the_cut_call_with_finish_length() -> None:
    events = await chat.stream_events(chunks_for(CUT_OUTPUT), params=PARAMS)
    deltas = [event["choices"][0] for event in events if event != "[DONE]"]
    assert all(choice["delta"].get("content") is None for choice in deltas)
    calls = [call for choice in deltas for call in choice["delta"].get("tool_calls") or []]
    assert [call["function"] for call in calls] == [
        {"name": "get_weather", "arguments": CUT_ARGUMENTS}
    ]
    assert [choice["finish_reason"] for choice in deltas if choice["finish_reason"]] == ["length"]


def _function_call(items: list[dict[str, Any]]) -> dict[str, Any]:
    assert [item["type"] for item in items] == ["function_call"], "no message item"
    return items[0]


@pytest.mark.anyio
async def test_responses_returns_the_cut_call_incomplete() -> None:
    context = responses.context_for(
        tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=16
    )
    response = (await responses.collect(chunks_for(CUT_OUTPUT), context)).model_dump()
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    call = _function_call(response["output"])
    assert (call["name"], call["arguments"], call["status"]) == (
        "get_weather",
        CUT_ARGUMENTS,
        "incomplete",
    )


@pytest.mark.anyio
async def test_responses_stream_returns_the_cut_call_incomplete() -> None:
    context = responses.context_for(
        tools=RESPONSES_TOOLS, tool_choice="required", max_output_tokens=16
    )
    events = await responses.stream_events(chunks_for(CUT_OUTPUT), context)
    assert events[-1]["type"] == "response.incomplete"
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    call = _function_call(done)
    assert (call["arguments"], call["status"]) == (CUT_ARGUMENTS, "incomplete")


@pytest.mark.anyio
async def test_claude_returns_the_tool_use_block_with_its_whole_members() -> None:
    message = (await claude.collect(chunks_for(CUT_OUTPUT))).model_dump()
    assert message["stop_reason"] == "max_tokens"
    assert [block["type"] for block in message["content"]] == ["tool_use"]
    [block] = message["content"]
    assert (block["name"], block["input"]) == ("get_weather", WHOLE_SO_FAR)


@pytest.mark.anyio
async def test_claude_stream_returns_the_tool_use_block_with_its_whole_members() -> None:
    events = await claude.stream_events(chunks_for(CUT_OUTPUT))
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert [delta["type"] for delta in deltas] == ["input_json_delta"]
    assert json.loads(deltas[0]["partial_json"]) == WHOLE_SO_FAR
    [stop] = [data["delta"]["stop_reason"] for name, data in events if name == "message_delta"]
    assert stop == "max_tokens"


@pytest.mark.anyio
async def test_ollama_returns_the_cut_call_with_done_reason_length() -> None:
    response = await ollama.collected(chunks_for(CUT_OUTPUT))
    assert response["done_reason"] == "length"
    assert response["message"]["content"] == ""
    [call] = response["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == WHOLE_SO_FAR


@pytest.mark.anyio
async def test_ollama_stream_returns_the_cut_call_with_done_reason_length() -> None:
    lines = await ollama.stream_lines(chunks_for(CUT_OUTPUT))
    assert "".join(line["message"]["content"] for line in lines) == ""
    calls = [call for line in lines for call in line["message"].get("tool_calls") or []]
    assert [call["function"]["arguments"] for call in calls] == [WHOLE_SO_FAR]
    assert lines[-1]["done_reason"] == "length"


@pytest.mark.anyio
async def test_a_call_cut_inside_its_name_names_the_one_tool_it_can_be() -> None:
    choice = (await chat.collect(chunks_for('{"name": "get_w'), PARAMS)).model_dump()
    [call] = choice["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ""}
    assert choice["choices"][0]["finish_reason"] == "length"


@pytest.mark.anyio
async def test_a_whole_call_finishes_tool_calls_as_before() -> None:
    whole = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    choice = (await chat.collect(chunks_for(whole, "stop"), PARAMS)).model_dump()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
