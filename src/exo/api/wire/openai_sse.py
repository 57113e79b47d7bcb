"""OpenAI's server-sent events (Chat Completions and legacy Completions): `data: <json>`
lines, ended by `data: [DONE]`.

Failure after the HTTP status has been sent is reported in-band, the way vLLM does: one
`data: {"error": {...}}` event in OpenAI's error shape, then `data: [DONE]`. The official
`openai` client raises `APIError` on any event whose JSON has a truthy `error` key (checked
in openai 3.57, `_streaming.Stream.__stream__`), before it reaches `[DONE]`; clients that
ignore unknown events still see a well-terminated stream. `OpenAIChunkStream` is the one
stream both dialects render, each with its own chunk, choice and usage types.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar, assert_never

from pydantic import BaseModel

from exo.api.wire.errors import ApiError, openai_error_body_for
from exo.api.wire.stream import (
    Failed,
    Finished,
    Prefilling,
    Text,
    ToolCalls,
    generation_events,
)
from exo.shared.types.chunks import Chunk, Usage

SSE_DONE = "data: [DONE]\n\n"
PREFILL_COMMENT = ": prefill "
"""How a prefill-progress comment line begins (`prefill_progress_comment`)."""
ChoiceT = TypeVar("ChoiceT")


def openai_sse(data: str) -> str:
    """One OpenAI SSE event carrying `data` (a JSON text)."""
    return f"data: {data}\n\n"


def openai_chunk_event(chunk: BaseModel, include_usage: bool) -> str:
    """A streamed chunk object as an event. OpenAI sends `usage: null` on ordinary chunks
    only when usage was asked for (`stream_options.include_usage`)."""
    excluded = {"system_fingerprint"} if include_usage else {"system_fingerprint", "usage"}
    return openai_sse(chunk.model_dump_json(exclude=excluded))


def prefill_progress_comment(progress: Prefilling) -> str:
    """A long prompt's prefill progress as an SSE comment line, which every SSE parser
    (the `openai` SDKs included) skips and the dashboard's chat reads:
    `: prefill {"prompt_tokens": P, "cached_tokens": C, "prefilled_tokens": D}`."""
    fields = {
        "prompt_tokens": progress.prompt_tokens,
        "cached_tokens": progress.cached_tokens,
        "prefilled_tokens": progress.prefilled_tokens,
    }
    return f"{PREFILL_COMMENT}{json.dumps(fields)}\n\n"


def openai_error_events(error: ApiError) -> tuple[str, str]:
    """The end of a failed stream: the error in OpenAI's shape, then `[DONE]`."""
    return openai_sse(json.dumps(openai_error_body_for(error), ensure_ascii=False)), SSE_DONE


@dataclass(frozen=True, slots=True)
class OpenAIChunkStream(Generic[ChoiceT]):
    """The events of one streamed answer in the OpenAI-shaped dialects (Chat Completions
    and legacy Completions), which differ only in their chunk and choice types and in how
    they render a piece of text or a tool call.

    Every chunk repeats the answer's id, creation time and model. After the pieces comes
    the finish chunk, then (with `include_usage`) a chunk with no choices and the usage,
    then `[DONE]`; a failure ends the stream with the error event and `[DONE]` instead.

    Args:
        chunk: The dialect's chunk type, called with `id`, `created`, `model`, `choices`
            and `usage`.
        usage: The dialect's usage object of the internal usage.
        completion_id: Every chunk's `id`.
        created: Unix time in seconds, the same in every chunk.
        model: The model name to report.
        include_usage: The request's `stream_options.include_usage`.
    """

    chunk: Callable[..., BaseModel]
    usage: Callable[[Usage], BaseModel]
    completion_id: str
    created: int
    model: str
    include_usage: bool

    def event(self, choices: list[ChoiceT], usage: Usage | None = None) -> str:
        """One chunk of `choices` (and the usage, for the usage chunk) as an event."""
        chunk = self.chunk(
            id=self.completion_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=None if usage is None else self.usage(usage),
        )
        return openai_chunk_event(chunk, self.include_usage)

    async def events(
        self,
        chunks: AsyncIterator[Chunk],
        conversation_param: str,
        opening: Iterable[str],
        render: Callable[[Text | ToolCalls], Iterable[str]],
        finish_choice: Callable[[Finished], ChoiceT],
    ) -> AsyncIterator[str]:
        """The whole stream: the `opening` events, the events `render` makes of each text
        and tool-call piece of `chunks` (read through `generation_events`, a 400 blaming
        `conversation_param`), then the chunk of `finish_choice(finished)`, the usage
        chunk and `[DONE]`, or the error event and `[DONE]`. Before the first piece, each
        prefill-progress report of the runner is a comment line
        (`prefill_progress_comment`)."""
        for line in opening:
            yield line
        pieces = generation_events(chunks, conversation_param=conversation_param, progress=True)
        async for piece in pieces:
            match piece:
                case Prefilling():
                    yield prefill_progress_comment(piece)
                case Text() | ToolCalls():
                    for line in render(piece):
                        yield line
                case Finished():
                    yield self.event([finish_choice(piece)])
                    if self.include_usage:
                        yield self.event([], piece.final_usage)
                    yield SSE_DONE
                case Failed():
                    for line in openai_error_events(piece.error):
                        yield line
                case _:
                    assert_never(piece)
