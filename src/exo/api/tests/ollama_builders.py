"""What the Ollama adapter's tests build and read: requests, the chunks a runner sends, a fake
clock, and the adapter's NDJSON lines and collected response as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from exo.api.ollama.response import collect_ollama, stream_ollama
from exo.api.ollama.wire_types import OllamaChatRequest, OllamaGenerateRequest
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ToolCall
from exo.testing.chunks import ChunkSource

MODEL = "test-model"
COMMAND_ID = CommandId("command-1")
START_NS = 1_000


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
