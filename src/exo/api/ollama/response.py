"""Ollama output: one generation's chunks as newline-delimited JSON lines or one response
object (see `ollama` for the request side and the wire facts followed).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Literal, assert_never

from exo.api.ollama.request import Dialect, NanosecondClock, rfc3339_nano
from exo.api.ollama.wire_types import (
    OllamaChatResponse,
    OllamaGenerateResponse,
    OllamaLogprob,
    OllamaResponseMessage,
    OllamaResponseToolCall,
    OllamaResponseToolCallFunction,
    OllamaTimings,
    OllamaTopLogprob,
)
from exo.api.wire.common import (
    ended_without_finish,
    error_chunk_error,
    unfinished_generation_error,
)
from exo.api.wire.errors import ApiError, GenerationError
from exo.shared.types.chunks import Chunk, ErrorChunk, TokenChunk, TokenLogprob, ToolCallChunk

# ---------------------------------------------------------------- responses


class _Timer:
    """The statistics of the final line: prompt evaluation is timed from the request's
    start to the first chunk (queueing and the first token included), evaluation from
    the first chunk to the last."""

    def __init__(self, started_ns: int, clock: NanosecondClock) -> None:
        self._started_ns = started_ns
        self._clock = clock
        self._first_chunk_ns: int | None = None

    def saw_chunk(self) -> None:
        if self._first_chunk_ns is None:
            self._first_chunk_ns = self._clock()

    def timings(self, prompt_tokens: int, completion_tokens: int) -> OllamaTimings:
        now = self._clock()
        first = self._first_chunk_ns if self._first_chunk_ns is not None else now
        return OllamaTimings(
            total_duration=max(now - self._started_ns, 0),
            load_duration=0,
            prompt_eval_count=prompt_tokens,
            prompt_eval_duration=max(first - self._started_ns, 0),
            eval_count=completion_tokens,
            eval_duration=max(now - first, 0),
        )


def _done_reason(chunk: TokenChunk | ToolCallChunk) -> str:
    """Ollama's `done_reason`; a generation that called tools is "stop" there.

    Raises:
        GenerationError: the generation failed or was cancelled (Ollama has no value for
            either, and "stop" would make a truncated answer look complete).
    """
    assert chunk.finish_reason is not None
    match chunk.finish_reason:
        case "stop" | "tool_calls":
            return "stop"
        case "length":
            return "length"
        case "error" | "cancelled":
            raise unfinished_generation_error(chunk.finish_reason)
        case _:
            assert_never(chunk.finish_reason)


def _error_chunk_error(chunk: ErrorChunk) -> ApiError:
    return error_chunk_error(chunk, param=None)


def _tool_calls(chunk: ToolCallChunk, first_index: int) -> list[OllamaResponseToolCall]:
    calls: list[OllamaResponseToolCall] = []
    for offset, call in enumerate(chunk.tool_calls):
        arguments = json.loads(call.arguments)
        if not isinstance(arguments, dict):
            raise GenerationError(
                f"tool call {call.name!r} has arguments that are not a JSON object",
                code="generation_failed",
            )
        function = OllamaResponseToolCallFunction(
            index=first_index + offset, name=call.name, arguments=arguments
        )
        calls.append(OllamaResponseToolCall(id=call.id, function=function))
    return calls


def _logprobs(entries: Sequence[TokenLogprob]) -> list[OllamaLogprob]:
    return [
        OllamaLogprob(
            token=entry.token,
            logprob=entry.logprob,
            bytes=list(entry.bytes),
            top_logprobs=[
                OllamaTopLogprob(token=top.token, logprob=top.logprob, bytes=list(top.bytes))
                for top in entry.top_logprobs
            ],
        )
        for entry in entries
    ]


def _line(
    dialect: Dialect,
    model: str,
    created_at: str,
    *,
    text: str = "",
    thinking: str = "",
    tool_calls: list[OllamaResponseToolCall] | None = None,
    logprobs: list[OllamaLogprob] | None = None,
    done_reason: str | None = None,
    timings: OllamaTimings | None = None,
) -> OllamaChatResponse | OllamaGenerateResponse:
    statistics = timings.model_dump() if timings is not None else {}
    if dialect == "chat":
        message = OllamaResponseMessage(
            content=text, thinking=thinking or None, tool_calls=tool_calls or None
        )
        return OllamaChatResponse(
            model=model,
            created_at=created_at,
            message=message,
            done=done_reason is not None,
            done_reason=done_reason,
            logprobs=logprobs or None,
            **statistics,
        )
    return OllamaGenerateResponse(
        model=model,
        created_at=created_at,
        response=text,
        thinking=thinking or None,
        done=done_reason is not None,
        done_reason=done_reason,
        logprobs=logprobs or None,
        **statistics,
    )


def load_response(
    dialect: Dialect,
    model: str,
    now_ns: NanosecondClock = time.time_ns,
    done_reason: Literal["load", "unload"] = "load",
) -> OllamaChatResponse | OllamaGenerateResponse:
    """Ollama's answer to a request without messages / with an empty prompt: the model is
    loaded (`done_reason: "load"`), or unloaded with `keep_alive: 0` (`"unload"`); no
    statistics."""
    return _line(dialect, model, rfc3339_nano(now_ns()), done_reason=done_reason)


async def stream_ollama(
    chunks: AsyncIterator[Chunk],
    *,
    dialect: Dialect,
    model: str,
    started_ns: int,
    clock: NanosecondClock = time.monotonic_ns,
    now_ns: NanosecondClock = time.time_ns,
) -> AsyncIterator[str]:
    """Render one generation as Ollama's newline-delimited JSON.

    Yields one line per chunk that carries text, thinking, tool calls or logprobs (`done:
    false`), then one `done: true` line with an empty message, `done_reason` ("stop" or
    "length") and the statistics. On failure that last line is `{"error": "..."}` instead.

    Args:
        chunks: The generation's chunks; read up to the first one with a finish reason.
        dialect: "chat" (`message` objects) or "generate" (`response` strings).
        model: The model name to report (as the client spelled it).
        started_ns: `clock()` when the request arrived.
        clock: Monotonic nanoseconds, for the durations.
        now_ns: Unix time in nanoseconds, for `created_at`.
    """
    timer = _Timer(started_ns, clock)
    tool_call_count = 0
    async for chunk in chunks:
        timer.saw_chunk()
        try:
            match chunk:
                case TokenChunk():
                    if chunk.text or chunk.reasoning_text or chunk.logprobs:
                        line = _line(
                            dialect, model, rfc3339_nano(now_ns()), text=chunk.text,
                            thinking=chunk.reasoning_text, logprobs=_logprobs(chunk.logprobs),
                        )  # fmt: skip
                        yield _json_line(line)
                case ToolCallChunk():
                    if dialect == "generate":
                        raise GenerationError("a tool call in a generate request")
                    calls = _tool_calls(chunk, tool_call_count)
                    tool_call_count += len(calls)
                    yield _json_line(
                        _line(dialect, model, rfc3339_nano(now_ns()), tool_calls=calls)
                    )
                case ErrorChunk():
                    raise _error_chunk_error(chunk)
                case _:
                    assert_never(chunk)
            if chunk.finish_reason is None:
                continue
            done_reason = _done_reason(chunk)
        except ApiError as error:
            yield _error_line(error)
            return
        usage = chunk.usage
        timings = timer.timings(
            usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0
        )
        yield _json_line(
            _line(dialect, model, rfc3339_nano(now_ns()), done_reason=done_reason, timings=timings)
        )
        return
    yield _error_line(ended_without_finish())


async def collect_ollama(
    chunks: AsyncIterator[Chunk],
    *,
    dialect: Dialect,
    model: str,
    started_ns: int,
    clock: NanosecondClock = time.monotonic_ns,
    now_ns: NanosecondClock = time.time_ns,
) -> OllamaChatResponse | OllamaGenerateResponse:
    """Gather one generation into the single object of a `stream: false` request (the
    whole text, thinking, tool calls and logprobs, `done: true` with the statistics).

    Arguments as for `stream_ollama`.

    Raises:
        InvalidRequestError: the engine refused the request (an ErrorChunk with status 400).
        GenerationError: the generation failed, was cancelled, or ended without a finish.
    """
    timer = _Timer(started_ns, clock)
    texts: list[str] = []
    thinking: list[str] = []
    tool_calls: list[OllamaResponseToolCall] = []
    logprobs: list[OllamaLogprob] = []
    async for chunk in chunks:
        timer.saw_chunk()
        match chunk:
            case TokenChunk():
                texts.append(chunk.text)
                thinking.append(chunk.reasoning_text)
                logprobs.extend(_logprobs(chunk.logprobs))
            case ToolCallChunk():
                if dialect == "generate":
                    raise GenerationError("a tool call in a generate request")
                tool_calls.extend(_tool_calls(chunk, len(tool_calls)))
            case ErrorChunk():
                raise _error_chunk_error(chunk)
            case _:
                assert_never(chunk)
        if chunk.finish_reason is None:
            continue
        done_reason = _done_reason(chunk)
        usage = chunk.usage
        timings = timer.timings(
            usage.prompt_tokens if usage else 0, usage.completion_tokens if usage else 0
        )
        return _line(
            dialect, model, rfc3339_nano(now_ns()), text="".join(texts),
            thinking="".join(thinking), tool_calls=tool_calls, logprobs=logprobs,
            done_reason=done_reason, timings=timings,
        )  # fmt: skip
    raise ended_without_finish()


def _json_line(response: OllamaChatResponse | OllamaGenerateResponse) -> str:
    return response.model_dump_json() + "\n"


def _error_line(error: ApiError) -> str:
    return json.dumps({"error": error.message}, ensure_ascii=False) + "\n"
