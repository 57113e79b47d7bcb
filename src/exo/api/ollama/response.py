"""Ollama output: one generation's chunks as newline-delimited JSON lines or one response
object (see `ollama` for the request side and the wire facts followed).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
from exo.api.wire import stream
from exo.api.wire.errors import ApiError, GenerationError
from exo.api.wire.logprobs import logprob_entries
from exo.api.wire.stream import CompletedReason
from exo.chat_protocol.cut_tool_call import complete_members, is_cut
from exo.shared.types.chunks import Chunk, TokenLogprob, Usage
from exo.shared.types.text_generation import ToolCall

# ---------------------------------------------------------------- responses


LoadDuration = Callable[[int], int]
"""Nanoseconds the request waited for its model to load, given its first chunk's time
(`exo.api.serving.load_wait.LoadWait.duration_ns`)."""


class _Timer:
    """The statistics of the final line: `load_duration` is the request's wait for its
    model to load (`LoadDuration`; 0 without one), prompt evaluation runs from the end of that
    wait (else the request's start) to the first chunk (queueing and the first token
    included), evaluation from the first chunk to the last."""

    def __init__(
        self, started_ns: int, clock: NanosecondClock, load_duration: LoadDuration | None
    ) -> None:
        self._started_ns = started_ns
        self._clock = clock
        self._load_duration = load_duration
        self._first_chunk_ns: int | None = None

    async def watch(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """`chunks`, noting when the first arrives."""
        async for chunk in chunks:
            if self._first_chunk_ns is None:
                self._first_chunk_ns = self._clock()
            yield chunk

    def timings(self, usage: Usage | None) -> OllamaTimings:
        prompt_tokens = usage.prompt_tokens if usage else 0
        completion_tokens = usage.completion_tokens if usage else 0
        now = self._clock()
        first = self._first_chunk_ns if self._first_chunk_ns is not None else now
        load = self._load_duration(first) if self._load_duration is not None else 0
        return OllamaTimings(
            total_duration=max(now - self._started_ns, 0),
            load_duration=load,
            prompt_eval_count=prompt_tokens,
            prompt_eval_duration=max(first - self._started_ns - load, 0),
            eval_count=completion_tokens,
            eval_duration=max(now - first, 0),
        )


def _done_reason(reason: CompletedReason) -> str:
    """Ollama's `done_reason`; a generation that called tools is "stop" there."""
    return "length" if reason == "length" else "stop"


def _tool_calls(
    dialect: Dialect, tool_calls: Sequence[ToolCall], first_index: int
) -> list[OllamaResponseToolCall]:
    if dialect == "generate" and tool_calls:
        raise GenerationError("a tool call in a generate request")
    calls: list[OllamaResponseToolCall] = []
    for offset, call in enumerate(tool_calls):
        # A call cut short by `max_tokens` (done_reason "length") shows the members written
        # whole, as its arguments are an object here (`cut_tool_call`).
        arguments = complete_members(call.arguments) if is_cut(call) else json.loads(call.arguments)
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
    return logprob_entries(
        entries, OllamaLogprob, OllamaTopLogprob, escape_partial_characters=False
    )


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
            timings=timings,
            logprobs=logprobs or None,
        )
    return OllamaGenerateResponse(
        model=model,
        created_at=created_at,
        response=text,
        thinking=thinking or None,
        done=done_reason is not None,
        done_reason=done_reason,
        timings=timings,
        logprobs=logprobs or None,
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
    load_duration: LoadDuration | None = None,
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
        load_duration: the request's wait for its model to load, from the time of its
            first chunk (`clock()`); None: no wait (`load_duration` 0).
    """
    timer = _Timer(started_ns, clock, load_duration)
    tool_call_count = 0
    try:
        async for piece in stream.generation_events(timer.watch(chunks), conversation_param=None):
            match piece:
                case stream.Text():
                    if piece.text or piece.reasoning or piece.logprobs:
                        line = _line(
                            dialect, model, rfc3339_nano(now_ns()), text=piece.text,
                            thinking=piece.reasoning, logprobs=_logprobs(piece.logprobs),
                        )  # fmt: skip
                        yield _json_line(line)
                case stream.ToolCalls():
                    calls = _tool_calls(dialect, piece.calls, tool_call_count)
                    tool_call_count += len(calls)
                    yield _json_line(
                        _line(dialect, model, rfc3339_nano(now_ns()), tool_calls=calls)
                    )
                case stream.Finished():
                    done_reason = _done_reason(piece.completed_reason)
                    line = _line(
                        dialect, model, rfc3339_nano(now_ns()), done_reason=done_reason,
                        timings=timer.timings(piece.usage),
                    )  # fmt: skip
                    yield _json_line(line)
                case stream.Failed():
                    raise piece.error
                case _:
                    assert_never(piece)
    except ApiError as error:
        yield _error_line(error)


async def collect_ollama(
    chunks: AsyncIterator[Chunk],
    *,
    dialect: Dialect,
    model: str,
    started_ns: int,
    clock: NanosecondClock = time.monotonic_ns,
    now_ns: NanosecondClock = time.time_ns,
    load_duration: LoadDuration | None = None,
) -> OllamaChatResponse | OllamaGenerateResponse:
    """Gather one generation into the single object of a `stream: false` request (the
    whole text, thinking, tool calls and logprobs, `done: true` with the statistics).

    Arguments as for `stream_ollama`.

    Raises:
        InvalidRequestError: the engine refused the request (an ErrorChunk with status 400).
        GenerationError: the generation failed, was cancelled, or ended without a finish.
    """
    timer = _Timer(started_ns, clock, load_duration)
    generation = await stream.collect_generation(timer.watch(chunks), conversation_param=None)
    return _line(
        dialect, model, rfc3339_nano(now_ns()), text=generation.text,
        thinking=generation.reasoning, tool_calls=_tool_calls(dialect, generation.tool_calls, 0),
        logprobs=_logprobs(generation.logprobs),
        done_reason=_done_reason(generation.finished.completed_reason),
        timings=timer.timings(generation.finished.usage),
    )  # fmt: skip


def _json_line(response: OllamaChatResponse | OllamaGenerateResponse) -> str:
    return response.model_dump_json() + "\n"


def _error_line(error: ApiError) -> str:
    return json.dumps({"error": error.message}, ensure_ascii=False) + "\n"
