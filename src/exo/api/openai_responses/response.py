"""OpenAI Responses output: one generation's chunks as Responses SSE events or one
`ResponseObject` (see `request` for the request side and the choices made).

Both go through one `ResponseAssembler` (`assembler`), so the streamed
events and the final object always agree (ids, output indexes, texts). A chunk stream ends
with the first chunk whose `finish_reason` is set; nothing after it is read. The caller owns
the chunk iterator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import assert_never

from exo.api.openai_responses.assembler import ResponseAssembler
from exo.api.openai_responses.context import ResponseContext
from exo.api.openai_responses.response_types import (
    LogprobEntry,
    ResponseLifecycleEvent,
    ResponseObject,
    StreamEvent,
    TopLogprobEntry,
)
from exo.api.serving.early_stream import WaitingFrames
from exo.api.wire import stream
from exo.api.wire.logprobs import logprob_entries
from exo.shared.types.chunks import Chunk, TokenLogprob


def _logprob_entries(logprobs: tuple[TokenLogprob, ...]) -> list[LogprobEntry]:
    return logprob_entries(logprobs, LogprobEntry, TopLogprobEntry)


async def _events(
    chunks: AsyncIterator[Chunk], assembler: ResponseAssembler
) -> AsyncIterator[StreamEvent]:
    """Every event of one generation, `response.created` to the terminal event."""
    for event in assembler.start():
        yield event
    # Logprobs of a chunk with no text (a token inside a character the engine holds back)
    # go with the next text, or are dropped with a thinking text or a tool call (module
    # docstring). Those of a generation that ends inside a character (its bytes dropped
    # from the text) go in one last delta with no text, as Chat Completions keeps them.
    held_logprobs: list[LogprobEntry] = []
    pieces = stream.generation_events(chunks, conversation_param="input", fail_unfinished=False)
    async for piece in pieces:
        match piece:
            case stream.Text():
                if piece.reasoning:
                    held_logprobs.clear()
                    for event in assembler.add_reasoning(piece.reasoning):
                        yield event
                if piece.text:
                    logprobs = held_logprobs + _logprob_entries(piece.logprobs)
                    held_logprobs = []
                    for event in assembler.add_text(piece.text, logprobs):
                        yield event
                elif not piece.reasoning:
                    held_logprobs.extend(_logprob_entries(piece.logprobs))
            case stream.ToolCalls():
                held_logprobs.clear()
                for call in piece.calls:
                    for event in assembler.add_tool_call(call):
                        yield event
            case stream.Finished():
                if held_logprobs:
                    for event in assembler.add_text("", held_logprobs):
                        yield event
                for event in assembler.finish(piece.reason, piece.final_usage):
                    yield event
            case stream.Failed():
                for event in assembler.fail(piece.error):
                    yield event
            case _:
                assert_never(piece)


def _sse(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def stream_response(
    chunks: AsyncIterator[Chunk],
    context: ResponseContext,
    assembler: ResponseAssembler | None = None,
) -> AsyncIterator[str]:
    """Render one generation as Responses SSE events (`event: <type>\\ndata: <json>`).

    Order: `response.created`, `response.in_progress`; per output item
    `response.output_item.added`, its content events (message: `content_part.added`,
    `output_text.delta`…, `output_text.done`, `content_part.done`; reasoning:
    `reasoning_summary_part.added`, `reasoning_summary_text.delta`…, `.done`,
    `reasoning_summary_part.done`; function call: `function_call_arguments.delta`,
    `.done`), `response.output_item.done`; finally `response.completed`,
    `response.incomplete` (max_output_tokens, cancelled) or `response.failed`.
    `sequence_number` counts from 0. No `[DONE]` (OpenAI sends none on this API).

    Args:
        chunks: The generation's internal chunks; read up to and including the first one
            with a finish reason.
        context: `response_context(...)` of the request.
        assembler: the stream's assembler when `waiting_frames(assembler)` may have sent
            its first events already (None: a new one).
    """
    async for event in _events(chunks, assembler or ResponseAssembler(context)):
        yield _sse(event)


def waiting_frames(assembler: ResponseAssembler) -> WaitingFrames:
    """A Responses stream before its first chunk (`exo.api.serving.early_stream`):
    `response.created` and `response.in_progress` with the early headers, SSE comments
    while waiting, and `response.failed` (the error's message) when the request fails."""
    return WaitingFrames(
        opening=lambda: [_sse(event) for event in assembler.start()],
        failure=lambda error: [
            _sse(event) for event in (*assembler.start(), *assembler.fail(error))
        ],
    )


async def collect_response(
    chunks: AsyncIterator[Chunk], context: ResponseContext
) -> ResponseObject:
    """Gather one generation into a non-streaming response object.

    Status "completed", "incomplete" (`incomplete_details.reason` "max_output_tokens") or
    "cancelled" (partial output kept).

    Raises:
        InvalidRequestError: an `ErrorChunk` with status 400 arrived.
        GenerationError: another `ErrorChunk` arrived, the generation failed, or the
            stream ended without a finish.
    """
    assembler = ResponseAssembler(context)
    last: StreamEvent | None = None
    async for event in _events(chunks, assembler):
        last = event
    if assembler.error is not None:
        raise assembler.error
    assert isinstance(last, ResponseLifecycleEvent)
    return last.response
