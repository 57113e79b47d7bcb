"""The MoE families' chat formats end to end in every dialect: a model's output as token
ids (byte-level tokenizers with the family's markers as special tokens), decoded token by
token as the engine decodes (`StreamingDetokenizer` over `decode_keeping_markers`), parsed
by the runner's `parse_generation`, cut into the runner's chunks (`piece_chunks`) and
rendered by each dialect's adapter, streamed and collected: the reasoning, the answer text
and the tool calls (names, typed arguments) each dialect shows, and its tool-call finish."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from exo.api.tests import chat_completions_builders as chat
from exo.api.tests import claude_messages_builders as claude
from exo.api.tests import ollama_builders as ollama
from exo.api.tests import openai_responses_builders as responses
from exo.chat_protocol.harmony import HARMONY_TOKENS
from exo.chat_protocol.output_parsing import OutputParser
from exo.chat_protocol.prompt import decode_keeping_markers, detect_tool_call_format
from exo.chat_protocol.tests.test_tool_formats import TOOLS, TYPED
from exo.chat_protocol.tool_call_markup import FORMAT_TOKENS
from exo.chat_protocol.tool_call_parsing import ToolCallFormat
from exo.shared.types.chunks import Chunk, Usage
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.tasks import TextGeneration
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.chat_formats import GPT_OSS_LIKE, byte_tokenizer
from exo.worker.engines.parsed_generation import parse_generation
from exo.worker.engines.torch.batching.request_state import GeneratedPiece
from exo.worker.engines.torch.decoding.detokenizer import StreamingDetokenizer
from exo.worker.runner.piece_chunks import piece_chunks

Calls = list[tuple[str, dict[str, Any]]]
# (reasoning, answer text, calls, whether the dialect reported a tool-call finish)
Seen = tuple[str, str, Calls, bool]

# Per format: its markers (special tokens), a template that shows it, a model output (an
# end-of-sequence token such as gpt-oss's `<|call|>` is not decoded, so it is not there),
# and what the client must see.
FORMATS: dict[ToolCallFormat, tuple[tuple[str, ...], str, str, Seen]] = {
    "harmony": (
        HARMONY_TOKENS,
        GPT_OSS_LIKE,
        "<|channel|>analysis<|message|>Weather, then edit.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>On it.<|end|>"
        "<|start|>assistant to=functions.edit_file<|channel|>commentary json<|message|>"
        '{"path": "42", "line": 7, "ratio": 0.5, "dry_run": true, "options": {"mode": "fast"}'
        ', "tags": ["a", "b"]}',
        ("Weather, then edit.", "On it.", [("edit_file", TYPED)], True),
    ),
    "qwen3_coder": (
        ("<tool_call>", "</tool_call>"),
        "{{ tools }}<tool_call>\n<function=",
        "Editing.\n<tool_call>\n<function=edit_file>\n<parameter=path>\n42\n</parameter>\n"
        "<parameter=line>\n7\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=dry_run>\ntrue\n</parameter>\n<parameter=options>\n"
        '{"mode": "fast"}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
        "</function>\n</tool_call>",
        ("", "Editing.\n", [("edit_file", TYPED)], True),
    ),
    "deepseek_v3": (
        (*FORMAT_TOKENS["deepseek_v3"], "<think>", "</think>"),
        "{{ tools }}<｜tool▁calls▁begin｜>",
        "<think>Tokyo.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
        '<｜tool▁sep｜>{"city": "Tokyo", "days": "3"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ("Tokyo.", "", [("get_weather", {"city": "Tokyo", "days": 3})], True),
    ),
    "kimi_k2": (
        FORMAT_TOKENS["kimi_k2"],
        "{{ tools }}<|tool_calls_section_begin|>",
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Lima"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        ("", "Checking.", [("get_weather", {"city": "Lima"})], True),
    ),
    "glm45": (
        (*FORMAT_TOKENS["glm45"], "<tool_call>", "</tool_call>", "<think>", "</think>"),
        "{{ tools }}<tool_call>{{ name }}<arg_key>",
        "<think>Edit.</think>\n<tool_call>edit_file\n<arg_key>path</arg_key>\n"
        "<arg_value>42</arg_value>\n<arg_key>line</arg_key>\n<arg_value>7</arg_value>\n"
        "<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n<arg_key>dry_run</arg_key>\n"
        '<arg_value>true</arg_value>\n<arg_key>options</arg_key>\n<arg_value>{"mode": '
        '"fast"}</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["a", "b"]</arg_value>\n'
        "</tool_call>",
        ("Edit.", "", [("edit_file", TYPED)], True),
    ),
    "minimax_m2": (
        (*FORMAT_TOKENS["minimax_m2"], "<think>", "</think>"),
        "{{ tools }}<minimax:tool_call>",
        '<think>Cairo.</think>\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Cairo</parameter>\n<parameter name="days">2</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        ("Cairo.", "", [("get_weather", {"city": "Cairo", "days": 2})], True),
    ),
}
# gpt-oss answering without a call: analysis and final channels, `<|return|>` not decoded.
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>Four."
)

COMMAND = CommandId("command-1")


def chunks_for(tool_call_format: ToolCallFormat, output: str) -> list[Chunk]:
    """The runner's chunks for a model that wrote `output` (then an end-of-sequence)."""
    markers, template, _, _ = FORMATS[tool_call_format]
    tokenizer = byte_tokenizer([*markers, "<|endoftext|>"], template)
    assert detect_tool_call_format(tokenizer) == tool_call_format
    detokenizer = StreamingDetokenizer(decode_keeping_markers(tokenizer))
    pieces = [
        GeneratedPiece(detokenizer.add_token(token), (token,), None, None)
        for token in tokenizer(output, add_special_tokens=False)["input_ids"]
    ]
    usage = Usage(prompt_tokens=5, completion_tokens=len(pieces) + 1)
    pieces.append(GeneratedPiece(detokenizer.flush(), (), "stop", usage))
    params = TextGenerationTaskParams(
        model=ModelId(chat.MODEL),
        messages=(ChatMessage(role="user", content="Go"),),
        tools=TOOLS,
    )
    parser = OutputParser(TOOLS, tool_call_format, thinking_open=False, forced_tool_call=False)
    task = TextGeneration(
        task_id=TaskId("task-1"),
        command_id=COMMAND,
        instance_id=InstanceId("instance-1"),
        origin_node_id=NodeId("node-1"),
        params=params,
    )
    chunks: list[Chunk] = []
    for index, piece in enumerate(parse_generation(pieces, parser, params)):
        cut = piece_chunks(task, piece, 5 if index == 0 else None)
        chunks.extend([cut.text] if cut.text is not None else [])
        chunks.extend(cut.after)
    return chunks


def _arguments(text: str | dict[str, Any]) -> dict[str, Any]:
    return text if isinstance(text, dict) else json.loads(text)


async def chat_collected(chunks: list[Chunk]) -> Seen:
    choice = (await chat.collect(chunks)).model_dump()["choices"][0]
    message = choice["message"]
    calls = [
        (call["function"]["name"], _arguments(call["function"]["arguments"]))
        for call in message.get("tool_calls") or []
    ]
    return (
        message.get("reasoning_content") or "",
        message.get("content") or "",
        calls,
        choice["finish_reason"] == "tool_calls",
    )


async def chat_streamed(chunks: list[Chunk]) -> Seen:
    reasoning, text, calls, finish = "", "", [], False
    for event in await chat.stream_events(chunks):
        if event == "[DONE]" or not event["choices"]:
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        reasoning += delta.get("reasoning_content") or ""
        text += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            calls.append((call["function"]["name"], _arguments(call["function"]["arguments"])))
        finish = finish or choice["finish_reason"] == "tool_calls"
    return reasoning, text, calls, finish


async def claude_collected(chunks: list[Chunk]) -> Seen:
    message = (await claude.collect(chunks)).model_dump()
    blocks = message["content"]
    return (
        "".join(block["thinking"] for block in blocks if block["type"] == "thinking"),
        "".join(block["text"] for block in blocks if block["type"] == "text"),
        [(block["name"], block["input"]) for block in blocks if block["type"] == "tool_use"],
        message["stop_reason"] == "tool_use",
    )


async def claude_streamed(chunks: list[Chunk]) -> Seen:
    reasoning, text, finish = "", "", False
    names: dict[int, str] = {}
    inputs: dict[int, str] = {}
    for name, data in await claude.stream_events(chunks):
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            names[data["index"]] = data["content_block"]["name"]
            inputs[data["index"]] = ""
        elif name == "content_block_delta":
            delta = data["delta"]
            reasoning += delta.get("thinking", "")
            text += delta.get("text", "")
            if delta["type"] == "input_json_delta":
                inputs[data["index"]] += delta["partial_json"]
        elif name == "message_delta":
            finish = data["delta"]["stop_reason"] == "tool_use"
    calls = [(names[index], json.loads(inputs[index])) for index in sorted(names)]
    return reasoning, text, calls, finish


def _response_output(items: list[dict[str, Any]]) -> Seen:
    reasoning = "".join(
        part["text"] for item in items if item["type"] == "reasoning" for part in item["summary"]
    )
    text = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    calls = [
        (item["name"], json.loads(item["arguments"]))
        for item in items
        if item["type"] == "function_call"
    ]
    return reasoning, text, calls, bool(calls)


async def responses_collected(chunks: list[Chunk]) -> Seen:
    response = (await responses.collect(chunks)).model_dump()
    assert response["status"] == "completed"
    return _response_output(response["output"])


async def responses_streamed(chunks: list[Chunk]) -> Seen:
    events = await responses.stream_events(chunks)
    assert events[-1]["type"] == "response.completed"
    items = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    return _response_output(items)


async def ollama_collected(chunks: list[Chunk]) -> Seen:
    message = (await ollama.collected(chunks))["message"]
    calls = [
        (call["function"]["name"], call["function"]["arguments"])
        for call in message.get("tool_calls") or []
    ]
    return message.get("thinking") or "", message["content"], calls, bool(calls)


async def ollama_streamed(chunks: list[Chunk]) -> Seen:
    reasoning, text, calls = "", "", []
    for line in await ollama.stream_lines(chunks):
        message = line["message"]
        reasoning += message.get("thinking") or ""
        text += message["content"]
        calls += [
            (call["function"]["name"], call["function"]["arguments"])
            for call in message.get("tool_calls") or []
        ]
    return reasoning, text, calls, bool(calls)


DIALECTS: dict[str, Callable[[list[Chunk]], Any]] = {
    "chat": chat_collected,
    "chat-stream": chat_streamed,
    "claude": claude_collected,
    "claude-stream": claude_streamed,
    "responses": responses_collected,
    "responses-stream": responses_streamed,
    "ollama": ollama_collected,
    "ollama-stream": ollama_streamed,
}


@pytest.mark.anyio
@pytest.mark.parametrize("tool_call_format", list(FORMATS))
async def test_every_dialect_shows_the_formats_reasoning_text_and_calls(
    tool_call_format: ToolCallFormat,
) -> None:
    _, _, output, expected = FORMATS[tool_call_format]
    chunks = chunks_for(tool_call_format, output)
    for dialect, seen in DIALECTS.items():
        assert await seen(chunks) == expected, dialect


@pytest.mark.anyio
async def test_every_dialect_shows_gpt_oss_channels_without_calls() -> None:
    chunks = chunks_for("harmony", HARMONY_ANSWER)
    for dialect, seen in DIALECTS.items():
        assert await seen(chunks) == ("Simple.", "Four.", [], False), dialect


@pytest.mark.anyio
async def test_no_dialect_shows_gpt_oss_markers_out_of_place() -> None:
    """Markers a model writes out of place (a `logit_bias` forcing them, or a wandering
    model) are the format's structure, never content or reasoning, streamed or not."""
    output = (
        "<|message|><|end|>Hi<|constrain|><|message|>"
        "<|channel|>analysis<|message|>Hm<|channel|>m<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Fo<|constrain|>ur.<|start|><|start|>"
    )
    chunks = chunks_for("harmony", output)
    for dialect, seen in DIALECTS.items():
        assert await seen(chunks) == ("Hmm", "HiFour.", [], False), dialect
