"""OpenAI Responses output: one generation's chunks as Responses SSE events or one
`ResponseObject` (see `openai_responses` for the request side and the choices made).

Both go through one `ResponseAssembler` (`openai_responses_assembler`), so the streamed
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
from exo.api.wire.common import (
    ended_without_finish,
    error_chunk_error,
    logprob_token,
)
from exo.api.wire.errors import ApiError
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
)


def _logprob_entries(logprobs: tuple[TokenLogprob, ...]) -> list[LogprobEntry]:
    return [
        LogprobEntry(
            token=logprob_token(entry.token, entry.bytes),
            logprob=entry.logprob,
            bytes=list(entry.bytes),
            top_logprobs=[
                TopLogprobEntry(
                    token=logprob_token(top.token, top.bytes),
                    logprob=top.logprob,
                    bytes=list(top.bytes),
                )
                for top in entry.top_logprobs
            ],
        )
        for entry in logprobs
    ]


def _error_chunk_error(chunk: ErrorChunk) -> ApiError:
    return error_chunk_error(chunk, param="input")


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
    async for chunk in chunks:
        match chunk:
            case TokenChunk():
                assembler.counted_output_tokens += len(chunk.token_ids)
                if chunk.reasoning_text:
                    held_logprobs.clear()
                    for event in assembler.add_reasoning(chunk.reasoning_text):
                        yield event
                if chunk.text:
                    logprobs = held_logprobs + _logprob_entries(chunk.logprobs)
                    held_logprobs = []
                    for event in assembler.add_text(chunk.text, logprobs):
                        yield event
                elif not chunk.reasoning_text:
                    held_logprobs.extend(_logprob_entries(chunk.logprobs))
            case ToolCallChunk():
                assembler.counted_output_tokens += len(chunk.token_ids)
                held_logprobs.clear()
                for call in chunk.tool_calls:
                    for event in assembler.add_tool_call(call):
                        yield event
            case ErrorChunk():
                for event in assembler.fail(_error_chunk_error(chunk)):
                    yield event
                return
            case _:
                assert_never(chunk)
        if chunk.finish_reason is not None:
            if held_logprobs:
                for event in assembler.add_text("", held_logprobs):
                    yield event
            for event in assembler.finish(chunk.finish_reason, chunk.usage):
                yield event
            return
    for event in assembler.fail(ended_without_finish()):
        yield event


def _sse(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


async def stream_response(
    chunks: AsyncIterator[Chunk], context: ResponseContext
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
    """
    async for event in _events(chunks, ResponseAssembler(context)):
        yield _sse(event)


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
