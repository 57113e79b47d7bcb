"""Claude's stream reports the prompt's token count as it opens (`message_start`), as
Anthropic's does, and the final `message_delta` usage agrees with it."""

from __future__ import annotations

import json
from typing import Any

import anyio

from exo.api.claude_messages.response import stream_message
from exo.shared.types.chunks import Chunk, ErrorChunk, TokenChunk, Usage
from exo.shared.types.common import CommandId, ModelId
from exo.testing.chunks import ChunkSource

COMMAND = CommandId("command-1")
MODEL = ModelId("m")


def token(text: str, **fields: Any) -> TokenChunk:
    return TokenChunk(command_id=COMMAND, model=MODEL, text=text, token_ids=(1,), **fields)


def events_of(chunks: list[Chunk]) -> list[dict[str, Any]]:
    async def render() -> list[str]:
        return [
            piece
            async for piece in stream_message(ChunkSource(chunks), message_id="msg_1", model="m")
        ]

    events = []
    for piece in anyio.run(render):
        event_line, data_line = piece.strip().split("\n")
        events.append({"event": event_line.removeprefix("event: "), **json.loads(data_line[6:])})
    return events


def test_message_start_reports_the_prompt_tokens_of_the_first_chunk() -> None:
    events = events_of(
        [
            token("Hi", prompt_tokens=23),
            token(
                " there",
                finish_reason="stop",
                usage=Usage(prompt_tokens=23, completion_tokens=3),
            ),
        ]
    )
    assert [event["event"] for event in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["usage"]["input_tokens"] == 23
    assert events[0]["message"]["usage"]["output_tokens"] == 0
    final_usage = events[-2]["usage"]
    assert final_usage["input_tokens"] == 23 and final_usage["output_tokens"] == 3


def test_a_stream_whose_first_chunk_has_no_count_opens_with_zero() -> None:
    events = events_of(
        [token("", finish_reason="stop", usage=Usage(prompt_tokens=5, completion_tokens=1))]
    )
    assert events[0]["message"]["usage"]["input_tokens"] == 0
    assert events[-2]["usage"]["input_tokens"] == 5


def test_an_error_first_still_opens_the_message_then_fails() -> None:
    events = events_of([ErrorChunk(command_id=COMMAND, model=MODEL, error_message="boom")])
    assert [event["event"] for event in events] == ["message_start", "error"]
    assert events[0]["message"]["usage"]["input_tokens"] == 0
