"""The one walk over a generation's internal chunks that every dialect renders.

`generation_events` folds the chunk stream into text, tool-call, finish and failure events
(a text event carries the chunk's text, reasoning and logprobs); a dialect only turns
those into its own SSE events, JSON lines or response object. The stream ends with the
first chunk whose `finish_reason` is set: nothing after it is read, and exactly one
`Finished` or `Failed` is the last event. The caller owns the chunk iterator and closes it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, assert_never, overload

from exo.api.wire.errors import ApiError, GenerationError, InvalidRequestError, NoCapacityError
from exo.shared.types.chunks import (
    Chunk,
    EmbeddingChunk,
    ErrorChunk,
    FinishReason,
    PrefillProgressChunk,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.text_generation import ToolCall

CompletedReason = Literal["stop", "length", "tool_calls"]
"""How a generation that completed ended (`FinishReason` without "error" and "cancelled")."""


@dataclass(frozen=True, slots=True)
class Text:
    """One `TokenChunk`: its answer text, its reasoning text (either may be empty) and its
    tokens' logprobs (empty unless the request asked for them)."""

    text: str
    reasoning: str
    logprobs: tuple[TokenLogprob, ...]


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """One `ToolCallChunk`: the calls it completed, each whole."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True, slots=True)
class Finished:
    """The generation finished. `usage` is what the last chunk carried (None if its
    producer left it out); `counted_completion_tokens` the tokens the stream itself showed;
    `stop_sequence` the stop string that ended it, if one did."""

    reason: FinishReason
    usage: Usage | None
    counted_completion_tokens: int
    stop_sequence: str | None

    @property
    def final_usage(self) -> Usage:
        return final_usage(self.usage, self.counted_completion_tokens)

    @property
    def completed_reason(self) -> CompletedReason:
        """`reason`, which `generation_events` (`fail_unfinished`) never makes "error" or
        "cancelled".

        Raises:
            GenerationError: it is one of those after all.
        """
        match self.reason:
            case "stop" | "length" | "tool_calls":
                return self.reason
            case "error" | "cancelled":
                raise unfinished_generation_error(self.reason)
            case _:
                assert_never(self.reason)


@dataclass(frozen=True, slots=True)
class Failed:
    """The generation failed: an `ErrorChunk`, an unfinished finish (when asked for), or a
    stream that ended without a finish."""

    error: ApiError


GenerationEvent = Text | ToolCalls | Finished | Failed


@dataclass(frozen=True, slots=True)
class Prefilling:
    """One `PrefillProgressChunk`, for a dialect that shows prefill progress
    (`generation_events(progress=True)`): the prompt's tokens, how many came from the
    prefix cache, and how many are prefilled so far (the cached ones included)."""

    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int


@overload
def generation_events(
    chunks: AsyncIterator[Chunk],
    *,
    conversation_param: str | None,
    fail_unfinished: bool = True,
    progress: Literal[False] = False,
) -> AsyncIterator[GenerationEvent]: ...


@overload
def generation_events(
    chunks: AsyncIterator[Chunk],
    *,
    conversation_param: str | None,
    fail_unfinished: bool = True,
    progress: Literal[True],
) -> AsyncIterator[GenerationEvent | Prefilling]: ...


async def generation_events(
    chunks: AsyncIterator[Chunk],
    *,
    conversation_param: str | None,
    fail_unfinished: bool = True,
    progress: bool = False,
) -> AsyncIterator[GenerationEvent | Prefilling]:
    """One event per chunk (`Text` or `ToolCalls`), then `Finished` after the chunk that
    sets a finish reason; `Failed` in place of the rest on failure.

    Args:
        chunks: The generation's internal chunks.
        conversation_param: The dialect's name for the conversation, blamed by a 400 that
            an `ErrorChunk` stands for (`messages`, `prompt`, `input`; None: no parameter).
        fail_unfinished: A finish reason of "error" or "cancelled" is a `Failed` (the
            dialect has no value for it, and a normal finish would make a truncated answer
            look complete); False: a `Finished` like any other.
        progress: A `Prefilling` event per `PrefillProgressChunk` (the runner's reports
            while a prompt is prefilled, at most one a second, until the first token);
            False: those chunks make no event.
    """
    counted_completion_tokens = 0
    async for chunk in chunks:
        stop_sequence: str | None = None
        match chunk:
            case TokenChunk():
                counted_completion_tokens += len(chunk.token_ids)
                stop_sequence = chunk.stop_sequence
                yield Text(chunk.text, chunk.reasoning_text, chunk.logprobs)
            case ToolCallChunk():
                counted_completion_tokens += len(chunk.token_ids)
                yield ToolCalls(chunk.tool_calls)
            case ErrorChunk():
                yield Failed(error_chunk_error(chunk, conversation_param))
                return
            case PrefillProgressChunk():
                # Read by `/metrics` and as a stream opens; shown only where asked for.
                if progress:
                    yield Prefilling(
                        chunk.prompt_tokens, chunk.cached_tokens, chunk.prefilled_tokens
                    )
                continue
            case EmbeddingChunk():  # an embedding's answer never reaches a generation
                yield Failed(GenerationError("the runner answered with embeddings"))
                return
            case _:
                assert_never(chunk)
        reason = chunk.finish_reason
        if reason is None:
            continue
        if fail_unfinished and reason in ("error", "cancelled"):
            yield Failed(unfinished_generation_error(reason))
        else:
            yield Finished(reason, chunk.usage, counted_completion_tokens, stop_sequence)
        return
    yield Failed(ended_without_finish())


@dataclass(frozen=True, slots=True)
class CollectedGeneration:
    """A whole generation, for an answer that is not streamed."""

    texts: tuple[Text, ...]
    tool_calls: tuple[ToolCall, ...]
    finished: Finished

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.texts)

    @property
    def reasoning(self) -> str:
        return "".join(piece.reasoning for piece in self.texts)

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return tuple(entry for piece in self.texts for entry in piece.logprobs)


async def collect_generation(
    chunks: AsyncIterator[Chunk], *, conversation_param: str | None
) -> CollectedGeneration:
    """Every event of `generation_events` (`fail_unfinished`), gathered.

    Raises:
        ApiError: the generation failed (the error of its `Failed` event).
    """
    texts: list[Text] = []
    tool_calls: list[ToolCall] = []
    end: Finished | Failed | None = None
    # Read to the end (the events stop after the finish), so nothing is left suspended.
    async for piece in generation_events(chunks, conversation_param=conversation_param):
        match piece:
            case Text():
                texts.append(piece)
            case ToolCalls():
                tool_calls.extend(piece.calls)
            case Finished() | Failed():
                end = piece
            case _:
                assert_never(piece)
    if isinstance(end, Failed):
        raise end.error
    assert end is not None, "generation_events ends with a Finished or a Failed"
    return CollectedGeneration(tuple(texts), tuple(tool_calls), end)


def unfinished_generation_error(reason: Literal["error", "cancelled"]) -> GenerationError:
    """The error for a generation that did not finish. No dialect has a value for a
    cancelled generation, and reporting "stop" would make a truncated answer look
    complete."""
    if reason == "error":
        return GenerationError("generation failed", code="generation_failed")
    return GenerationError(
        "generation was cancelled before it finished", code="generation_cancelled"
    )


def error_chunk_error(chunk: ErrorChunk, param: str | None) -> ApiError:
    """The `ApiError` an `ErrorChunk` stands for: a 400 blaming `param` (the dialect's name
    for the conversation) when the request was at fault, a 503 when its instance became
    unavailable, else a generation failure."""
    if chunk.status_code == 400:
        return InvalidRequestError(chunk.error_message, param=param, code=chunk.error_code)
    if chunk.status_code == 503:
        return NoCapacityError(chunk.error_message, code=chunk.error_code)
    return GenerationError(chunk.error_message, code=chunk.error_code or "generation_failed")


def ended_without_finish() -> GenerationError:
    return GenerationError("generation stream ended without a finish", code="generation_failed")


def final_usage(usage: Usage | None, counted_completion_tokens: int) -> Usage:
    """The last chunk carries usage by contract; should a producer omit it, report what the
    stream itself shows (prompt tokens are then unknown, so 0) rather than fail."""
    if usage is None:
        return Usage(prompt_tokens=0, completion_tokens=counted_completion_tokens)
    return usage
