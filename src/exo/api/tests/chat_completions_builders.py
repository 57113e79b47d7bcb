"""What the Chat Completions adapter's tests build and read: requests, the chunks a runner
sends, and the adapter's SSE stream and collected response."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from exo.api.openai_chat.response import collect_chat_completion, stream_chat_completion
from exo.api.openai_chat.wire_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
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
    TextGenerationTaskParams,
    ToolCall,
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


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
