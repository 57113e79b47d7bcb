"""OpenAI's server-sent events (Chat Completions and legacy Completions): `data: <json>`
lines, ended by `data: [DONE]`.

Failure after the HTTP status has been sent is reported in-band, the way vLLM does: one
`data: {"error": {...}}` event in OpenAI's error shape, then `data: [DONE]`. The official
`openai` client raises `APIError` on any event whose JSON has a truthy `error` key (checked
in openai 3.57, `_streaming.Stream.__stream__`), before it reaches `[DONE]`; clients that
ignore unknown events still see a well-terminated stream.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import BaseModel

from exo.api.wire.errors import ApiError, openai_error_body_for
from exo.api.wire.stream import Failed, Finished
from exo.shared.types.chunks import Usage

SSE_DONE = "data: [DONE]\n\n"


def openai_sse(data: str) -> str:
    """One OpenAI SSE event carrying `data` (a JSON text)."""
    return f"data: {data}\n\n"


def openai_chunk_event(chunk: BaseModel, include_usage: bool) -> str:
    """A streamed chunk object as an event. OpenAI sends `usage: null` on ordinary chunks
    only when usage was asked for (`stream_options.include_usage`)."""
    excluded = {"system_fingerprint"} if include_usage else {"system_fingerprint", "usage"}
    return openai_sse(chunk.model_dump_json(exclude=excluded))


def openai_error_events(error: ApiError) -> tuple[str, str]:
    """The end of a failed stream: the error in OpenAI's shape, then `[DONE]`."""
    return openai_sse(json.dumps(openai_error_body_for(error), ensure_ascii=False)), SSE_DONE


def openai_stream_end(
    end: Finished | Failed,
    finish_event: Callable[[Finished], str],
    usage_event: Callable[[Usage], str] | None,
) -> tuple[str, ...]:
    """The last events of a stream: `finish_event(end)`, then `usage_event` of the final
    usage (None: the request did not ask for usage), then `[DONE]`; for a failure the
    error event and `[DONE]`."""
    if isinstance(end, Failed):
        return openai_error_events(end.error)
    usage = () if usage_event is None else (usage_event(end.final_usage),)
    return (finish_event(end), *usage, SSE_DONE)
