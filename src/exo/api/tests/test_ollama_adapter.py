"""The Ollama adapter: request conversion, NDJSON lines, collection, model listings, and
the official `ollama` client against the real app over a scripted cluster."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import httpx
import ollama
import openai
import pytest
import uvicorn

from exo.api.app import create_app
from exo.api.ollama.model_listings import model_digest, process_model, show_response, tag_model
from exo.api.ollama.request import (
    chat_to_task_params,
    generate_to_task_params,
    resolve_model_name,
    rfc3339_nano,
)
from exo.api.ollama.response import collect_ollama, load_response, stream_ollama
from exo.api.ollama.wire_types import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaShowResponse,
)
from exo.api.serving.cluster_client import ClusterClient, LoadOnRequest
from exo.api.serving.load_wait import ReadyTimes
from exo.api.serving.node_stop import NodeStop
from exo.api.wire.errors import GenerationError, InvalidRequestError
from exo.api.wire.images import ImagePolicy
from exo.shared.models.cards import load_builtin_cards
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
from exo.shared.types.commands import Command, GenerateText
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.state import State
from exo.shared.types.text_generation import ChatMessage, NamedToolChoice, ToolCall
from exo.testing.builders import SMOLLM2, make_instance, smollm2_card
from exo.testing.chunks import ChunkSource

MODEL = "test-model"
COMMAND_ID = CommandId("command-1")
START_NS = 1_000


# ---------------------------------------------------------------- builders


def chat_request(**fields: Any) -> OllamaChatRequest:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return OllamaChatRequest.model_validate(body)


def generate_request(**fields: Any) -> OllamaGenerateRequest:
    body: dict[str, Any] = {"model": MODEL, "prompt": "hi"}
    body.update(fields)
    return OllamaGenerateRequest.model_validate(body)


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
    reason: FinishReason = "stop", prompt_tokens: int = 5, completion_tokens: int = 3
) -> TokenChunk:
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    return token(finish_reason=reason, usage=usage)


def tool_calls(*calls: tuple[str, str], finish_reason: FinishReason | None = None) -> ToolCallChunk:
    return ToolCallChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        tool_calls=tuple(
            ToolCall(id=f"call_{index}", name=name, arguments=arguments)
            for index, (name, arguments) in enumerate(calls)
        ),
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=5, completion_tokens=7) if finish_reason else None,
    )


def error_chunk(message: str = "runner crashed", status_code: int = 500) -> ErrorChunk:
    return ErrorChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        error_message=message,
        status_code=status_code,
    )


class FakeClock:
    """Monotonic nanoseconds that advance 100 ns per reading."""

    def __init__(self, start: int = START_NS) -> None:
        self.now = start

    def __call__(self) -> int:
        self.now += 100
        return self.now


WALL_NS = 1_700_000_000_123_456_789
CREATED_AT = "2023-11-14T22:13:20.123456789Z"


async def stream_lines(
    chunks: Sequence[Chunk] | ChunkSource, dialect: str = "chat"
) -> list[dict[str, Any]]:
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    lines = []
    async for line in stream_ollama(
        source,
        dialect="chat" if dialect == "chat" else "generate",
        model=MODEL,
        started_ns=START_NS,
        clock=FakeClock(),
        now_ns=lambda: WALL_NS,
    ):
        assert line.endswith("\n") and "\n" not in line[:-1], "one JSON object per line"
        lines.append(json.loads(line))
    return lines


async def collected(chunks: Sequence[Chunk], dialect: str = "chat") -> dict[str, Any]:
    response = await collect_ollama(
        ChunkSource(chunks),
        dialect="chat" if dialect == "chat" else "generate",
        model=MODEL,
        started_ns=START_NS,
        clock=FakeClock(),
        now_ns=lambda: WALL_NS,
    )
    result: dict[str, Any] = json.loads(response.model_dump_json())
    return result


def text_line(content: str = "", thinking: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking is not None:
        message["thinking"] = thinking
    return {"model": MODEL, "created_at": CREATED_AT, "message": message, "done": False}


def done_line(reason: str = "stop", prompt: int = 5, evals: int = 3) -> dict[str, Any]:
    # The clock is read when the first chunk arrives (START+100) and at the end (START+200).
    first = START_NS + 100
    now = START_NS + 200
    return {
        "model": MODEL,
        "created_at": CREATED_AT,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": reason,
        "total_duration": now - START_NS,
        "load_duration": 0,
        "prompt_eval_count": prompt,
        "prompt_eval_duration": first - START_NS,
        "eval_count": evals,
        "eval_duration": now - first,
    }


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


# ---------------------------------------------------------------- streaming


@pytest.mark.anyio
async def test_stream_text_then_done_with_measured_timings() -> None:
    lines = await stream_lines(
        [token("Hel"), token("lo"), finish(prompt_tokens=9, completion_tokens=2)]
    )
    assert lines == [text_line("Hel"), text_line("lo"), done_line(prompt=9, evals=2)]


@pytest.mark.anyio
async def test_stream_thinking_and_final_text_in_the_finishing_chunk() -> None:
    last = token("!", finish_reason="length", usage=Usage(prompt_tokens=5, completion_tokens=3))
    lines = await stream_lines([token(reasoning="hmm"), token("Hi", reasoning=" ok"), last])
    assert lines == [
        text_line("", thinking="hmm"),
        text_line("Hi", thinking=" ok"),
        text_line("!"),
        done_line("length"),
    ]


@pytest.mark.anyio
async def test_stream_tool_calls_as_objects_then_done_stop() -> None:
    lines = await stream_lines(
        [
            tool_calls(("get_weather", '{"city": "Paris"}')),
            tool_calls(("get_time", "{}"), finish_reason="tool_calls"),
        ]
    )
    calls = [line["message"].get("tool_calls") for line in lines[:2]]
    assert calls == [
        [
            {
                "id": "call_0",
                "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
        [{"id": "call_0", "function": {"index": 1, "name": "get_time", "arguments": {}}}],
    ]
    assert [line["done"] for line in lines] == [False, False, True]
    assert lines[2] == done_line("stop", evals=7)


@pytest.mark.anyio
async def test_stream_logprobs_per_line() -> None:
    entry = TokenLogprob(
        token="Hi",
        token_id=5,
        logprob=-0.1,
        bytes=(72, 105),
        top_logprobs=(TopLogprob(token="Hi", token_id=5, logprob=-0.1, bytes=(72, 105)),),
    )
    lines = await stream_lines([token("Hi", logprobs=(entry,)), finish()])
    assert lines[0]["logprobs"] == [
        {
            "token": "Hi",
            "logprob": -0.1,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
        }
    ]
    assert "logprobs" not in lines[1]


@pytest.mark.anyio
async def test_stream_generate_lines_use_response() -> None:
    lines = await stream_lines([token("Paris", reasoning="hm"), finish()], dialect="generate")
    assert lines[0] == {
        "model": MODEL,
        "created_at": CREATED_AT,
        "response": "Paris",
        "thinking": "hm",
        "done": False,
    }
    final = done_line()
    del final["message"]
    assert lines[1] == {**final, "response": ""}


@pytest.mark.parametrize(
    ("last", "message"),
    [
        (error_chunk("runner crashed"), "runner crashed"),
        (error_chunk("prompt too long", status_code=400), "prompt too long"),
        (finish("cancelled"), "cancelled before it finished"),
        (finish("error"), "generation failed"),
    ],
)
@pytest.mark.anyio
async def test_stream_failure_is_one_error_line(last: Chunk, message: str) -> None:
    source = ChunkSource([token("Hi"), last, token("never read")])
    lines = await stream_lines(source)
    assert lines[0] == text_line("Hi")
    assert len(lines) == 2 and set(lines[1]) == {"error"} and message in lines[1]["error"]
    assert source.taken == 2, "nothing is read after the finishing chunk"


@pytest.mark.anyio
async def test_stream_without_finish_ends_with_an_error_line() -> None:
    lines = await stream_lines([token("Hi")])
    assert lines == [text_line("Hi"), {"error": "generation stream ended without a finish"}]


# ---------------------------------------------------------------- collecting


@pytest.mark.anyio
async def test_collect_chat_joins_everything() -> None:
    response = await collected(
        [
            token(reasoning="think "),
            token("Hel", reasoning="more"),
            tool_calls(("f", '{"a": 1}')),
            token("lo"),
            finish(),
        ]
    )
    assert response == {
        **done_line(),
        "message": {
            "role": "assistant",
            "content": "Hello",
            "thinking": "think more",
            "tool_calls": [
                {"id": "call_0", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}
            ],
        },
    }


@pytest.mark.anyio
async def test_collect_generate() -> None:
    response = await collected([token("Paris"), finish("length")], dialect="generate")
    assert response["response"] == "Paris" and response["done_reason"] == "length"
    assert "message" not in response and "context" not in response


@pytest.mark.anyio
async def test_collect_failures_raise() -> None:
    with pytest.raises(InvalidRequestError, match="too long"):
        await collected([error_chunk("too long", status_code=400)])
    with pytest.raises(GenerationError, match="crashed"):
        await collected([token("a"), error_chunk("crashed")])
    with pytest.raises(GenerationError, match="cancelled"):
        await collected([finish("cancelled")])
    with pytest.raises(GenerationError, match="without a finish"):
        await collected([token("a")])


def test_load_responses() -> None:
    chat = load_response("chat", MODEL, now_ns=lambda: WALL_NS).model_dump(mode="json")
    assert chat == {
        "model": MODEL,
        "created_at": CREATED_AT,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "load",
    }
    generate = load_response("generate", MODEL, now_ns=lambda: WALL_NS).model_dump(mode="json")
    assert generate["response"] == "" and generate["done_reason"] == "load"


# ---------------------------------------------------------------- model listings


def test_tag_entry_from_card() -> None:
    card = smollm2_card()
    entry = tag_model(card, "2024-01-01T00:00:00Z", on_gpus=False).model_dump(mode="json")
    assert entry == {
        "name": SMOLLM2,
        "model": SMOLLM2,
        "modified_at": "2024-01-01T00:00:00Z",
        "size": card.storage_size_bytes,
        "digest": model_digest(SMOLLM2),
        "details": {
            "parent_model": "",
            "format": "gguf",  # SmolLM2-135M-Instruct.Q4_1.gguf
            "family": "llama",
            "families": ["llama"],
            "parameter_size": "135M",
            "quantization_level": "Q4_1",  # the GGUF's file type
        },
        "capabilities": ["completion", "tools"],
    }
    assert len(entry["digest"]) == 64 and entry["digest"] == model_digest(SMOLLM2)
    assert model_digest("a") != model_digest("b")


def test_show_from_card_and_template() -> None:
    card = smollm2_card()
    template = "{% for message in messages %}{{ message.content }}{% endfor %}{# tools #}"
    show = show_response(card, template, "2024-01-01T00:00:00Z", on_gpus=True)
    OllamaShowResponse.model_validate_json(show.model_dump_json())  # round trip
    assert show.template == template
    assert f"FROM {SMOLLM2}" in show.modelfile and template in show.modelfile
    assert "temperature" in show.parameters and "0.2" in show.parameters
    assert show.capabilities == ["completion", "tools"]
    assert show.details.quantization_level == "Q4_1"  # the GGUF's, on GPUs too
    assert show.model_info["general.architecture"] == "llama"
    assert show.model_info["general.parameter_count"] == 134_515_008
    assert show.model_info["llama.context_length"] == card.context_length
    assert show.model_info["llama.block_count"] == card.n_layers
    # Tool calls work without a template that names tools (exo's fallback prompt).
    assert show_response(card, "", "x", False).capabilities == ["completion", "tools"]


def test_show_capabilities_follow_the_card() -> None:
    cards = load_builtin_cards()
    qwen3 = show_response(cards[ModelId("Qwen/Qwen3-0.6B")], "", "x", False)
    assert qwen3.capabilities == ["completion", "tools", "thinking"]
    distill = cards[ModelId("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")]
    assert show_response(distill, "", "x", False).capabilities == [
        "completion",
        "tools",
        "thinking",
    ]
    # Gemma 3 4B's card says it reads images.
    gemma = show_response(cards[ModelId("google/gemma-3-4b-it")], "", "x", False)
    assert gemma.capabilities == ["completion", "tools", "vision"]
    assert gemma.details.parameter_size == "4.3B" and gemma.details.family == "gemma3"
    assert gemma.model_info["gemma3.attention.key_length"] == 256


def test_process_entry() -> None:
    entry = process_model(smollm2_card(), size=1000, on_gpus=False).model_dump(mode="json")
    assert (entry["size"], entry["size_vram"], entry["name"]) == (1000, 0, SMOLLM2)
    assert entry["context_length"] == smollm2_card().context_length
    assert entry["expires_at"].startswith("9999-")


def test_response_wire_types_round_trip() -> None:
    chat = OllamaChatResponse.model_validate_json(json.dumps(done_line()))
    assert json.loads(chat.model_dump_json()) == done_line()
    generate_line = {"model": MODEL, "created_at": CREATED_AT, "response": "x", "done": False}
    generate = OllamaGenerateResponse.model_validate_json(json.dumps(generate_line))
    assert json.loads(generate.model_dump_json()) == generate_line


# ---------------------------------------------------------------- the official client


class ScriptedCluster:
    """Just enough of ClusterClient for the routes: one node holding a placed SmolLM2, and
    every generation answered with `script`."""

    def __init__(self) -> None:
        self.node_id = NodeId("node-a")
        self.cards = {SMOLLM2: smollm2_card()}
        instance = make_instance(self.node_id)
        self.state = State(instances={instance.instance_id: instance})
        self.script: list[Chunk] = []
        self.submitted: list[GenerateText] = []
        self.load_on_request = LoadOnRequest()
        self.ready_times = ReadyTimes()  # none seen ready: `load_duration` is measured
        self.stop = NodeStop()
        self.image_policy = ImagePolicy()

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        return True  # the state is what the test set

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            for chunk in self.script:
                yield chunk

        yield chunks()

    async def submit(self, command: Command) -> None:
        assert isinstance(command, GenerateText)
        self.submitted.append(command)

    def send_and_forget(self, command: Command) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedCluster]]:
    cluster = ScriptedCluster()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    app = create_app(cast(ClusterClient, cluster))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", cluster
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


@pytest.fixture
def client(server: tuple[str, ScriptedCluster]) -> ollama.Client:
    return ollama.Client(host=f"{server[0]}/ollama", timeout=10)


@pytest.fixture
def cluster(server: tuple[str, ScriptedCluster]) -> ScriptedCluster:
    server[1].script = [token("Par"), token("is"), finish()]
    server[1].submitted.clear()
    return server[1]


def test_client_chat_plain_and_streaming(client: ollama.Client, cluster: ScriptedCluster) -> None:
    messages = [{"role": "user", "content": "capital of France?"}]
    answer = client.chat(model=f"{SMOLLM2}:latest", messages=messages, options={"temperature": 0})
    assert answer.message.content == "Paris" and answer.done and answer.done_reason == "stop"
    assert answer.model == f"{SMOLLM2}:latest"
    assert answer.prompt_eval_count == 5 and answer.eval_count == 3
    assert answer.total_duration is not None and answer.total_duration > 0
    params = cluster.submitted[0].params
    assert params.model == SMOLLM2 and params.temperature == 0 and params.stream is False

    parts = list(client.chat(model=SMOLLM2, messages=messages, stream=True))
    assert [part.message.content for part in parts] == ["Par", "is", ""]
    assert [part.done for part in parts] == [False, False, True]
    assert cluster.submitted[1].params.stream is True


def test_client_chat_tool_call_and_thinking(
    client: ollama.Client, cluster: ScriptedCluster
) -> None:
    cluster.script = [
        token(reasoning="need weather"),
        tool_calls(("get_weather", '{"city": "Paris"}'), finish_reason="tool_calls"),
    ]

    def get_weather(city: str) -> str:
        """Weather of a city.

        Args:
            city: The city.
        """
        return "sunny"

    # `think` asks for a thinking model (else Ollama's 400: test_ollama_thinking_support.py).
    plain = cluster.cards[SMOLLM2]
    cluster.cards[SMOLLM2] = plain.model_copy(
        update={"capabilities": (*plain.capabilities, "thinking")}
    )
    try:
        answer = client.chat(
            model=SMOLLM2,
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=[get_weather],
            think=True,
            stream=False,
        )
    finally:
        cluster.cards[SMOLLM2] = plain
    assert answer.message.thinking == "need weather"
    assert answer.message.tool_calls is not None
    call = answer.message.tool_calls[0].function
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
    params = cluster.submitted[0].params
    assert [tool.name for tool in params.tools] == ["get_weather"]
    assert params.enable_thinking is True and params.tool_choice == "auto"


def test_client_generate_list_show_ps(client: ollama.Client, cluster: ScriptedCluster) -> None:
    generated = client.generate(model=SMOLLM2, prompt="capital of France?", system="be brief")
    assert generated.response == "Paris" and generated.done_reason == "stop"
    assert [m.role for m in cluster.submitted[0].params.messages] == ["system", "user"]
    loaded = client.generate(model=SMOLLM2, prompt="")
    assert loaded.done and loaded.done_reason == "load"
    assert len(cluster.submitted) == 1, "an empty prompt only loads the model"

    listed = client.list()
    assert [m.model for m in listed.models] == [SMOLLM2]
    assert listed.models[0].size == smollm2_card().storage_size_bytes
    assert listed.models[0].details is not None
    assert listed.models[0].details.family == "llama"

    shown = client.show(SMOLLM2)
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"

    running = client.ps()
    assert [m.model for m in running.models] == [SMOLLM2]
    assert running.models[0].size_vram == 0


def test_client_generate_with_every_option_the_client_declares(
    client: ollama.Client, cluster: ScriptedCluster
) -> None:
    """The `ollama` client's `Options` in full: each has its effect, is accepted as a
    documented no-op (neutral values, load-time options), or is a 400 naming it."""
    accepted = ollama.Options(
        numa=False, num_ctx=2048, num_batch=512, num_gpu=0, main_gpu=0, low_vram=False,
        f16_kv=True, logits_all=False, vocab_only=False, use_mmap=True, use_mlock=False,
        embedding_only=False, num_thread=2, num_keep=4, seed=7, num_predict=5, top_k=20,
        top_p=0.9, tfs_z=1.0, typical_p=1.0, repeat_last_n=-1, temperature=0.2,
        repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.2, mirostat=0,
        mirostat_tau=5.0, mirostat_eta=0.1, penalize_newline=True, stop=["END"],
    )  # fmt: skip
    generated = client.generate(model=SMOLLM2, prompt="hi", options=accepted)
    assert generated.response == "Paris"
    params = cluster.submitted[-1].params
    assert (params.context_tokens, params.seed, params.max_tokens, params.top_k) == (2048, 7, 5, 20)
    assert (params.repetition_penalty, params.stop) == (1.1, ("END",))
    for refused in ({"mirostat": 2}, {"typical_p": 0.5}, {"repeat_last_n": -2}):
        with pytest.raises(ollama.ResponseError) as raised:
            client.generate(model=SMOLLM2, prompt="hi", options=ollama.Options(**refused))
        (name,) = refused
        assert raised.value.status_code == 400 and f"options.{name}" in raised.value.error


def test_client_errors(client: ollama.Client, cluster: ScriptedCluster, server: Any) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert (raised.value.status_code, raised.value.error) == (404, "model 'nope' not found")
    with pytest.raises(ollama.ResponseError) as raised:
        client.show("nope")
    assert raised.value.status_code == 404

    cluster.script = [token("Hi"), error_chunk("runner crashed")]
    stream = client.chat(model=SMOLLM2, messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(ollama.ResponseError, match="runner crashed"):
        list(stream)

    base = server[0]
    wrong_type = httpx.post(f"{base}/ollama/api/chat", json={"model": SMOLLM2, "messages": "x"})
    assert wrong_type.status_code == 400 and set(wrong_type.json()) == {"error"}
    missing = httpx.post(f"{base}/ollama/api/chat", json={"messages": []})
    assert missing.status_code == 400 and "model" in missing.json()["error"]
    images = httpx.post(
        f"{base}/ollama/api/chat",
        json={"model": SMOLLM2, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
    )
    assert images.status_code == 400 and "vision" in images.json()["error"]
    empty = httpx.post(f"{base}/ollama/api/chat", json={"model": SMOLLM2, "messages": []})
    assert empty.status_code == 200 and empty.json()["done_reason"] == "load"


def test_version_root_and_openai_routes(server: tuple[str, ScriptedCluster], cluster: Any) -> None:
    base = server[0]
    assert httpx.get(f"{base}/ollama/api/version").json() == {"version": "0.13.4"}
    assert httpx.head(f"{base}/ollama/api/version").status_code == 200
    assert httpx.get(f"{base}/ollama").text == "Ollama is running"
    openai_client = openai.OpenAI(base_url=f"{base}/ollama/v1", api_key="x", max_retries=0)
    assert [m.id for m in openai_client.models.list()] == [SMOLLM2]
    completion = openai_client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "x"}]
    )
    assert completion.choices[0].message.content == "Paris"
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.body is not None and "message" in cast(dict[str, Any], raised.value.body)


def test_curl_style_body_without_json_content_type(
    server: tuple[str, ScriptedCluster], cluster: ScriptedCluster
) -> None:
    """`curl -d '{...}'` (Ollama's own examples) sends a form content type."""
    body = json.dumps(
        {"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    )
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        response = httpx.post(
            f"{server[0]}/ollama/api/chat", content=body, headers={"content-type": content_type}
        )
        assert response.status_code == 200, response.text
        assert response.json()["message"]["content"] == "Paris"
    garbage = httpx.post(
        f"{server[0]}/ollama/api/chat",
        content=b"model=x",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert garbage.status_code == 400 and "error" in garbage.json()
