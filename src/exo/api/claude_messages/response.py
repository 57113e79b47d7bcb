"""Claude Messages output: one generation's chunks as Anthropic's SSE events or one
`Message` (see `request` for the request side and the choices made).

`collect_message` builds the non-streaming answer from the same events the stream sends,
so the two cannot disagree. A chunk stream ends with the first chunk whose `finish_reason`
is set; nothing after it is read.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, assert_never

from exo.api.claude_messages.request import error_type_for_status
from exo.api.claude_messages.wire_types import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    ErrorDetail,
    ErrorResponse,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    OutputTokensDetails,
    StopReason,
    StreamEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
)
from exo.api.serving.early_stream import WaitingFrames
from exo.api.wire import stream
from exo.api.wire.errors import ApiError, GenerationError
from exo.api.wire.stream import CompletedReason
from exo.chat_protocol.cut_tool_call import complete_members, is_cut
from exo.chat_protocol.tool_call_parsing import TOOL_CALL_ID_PREFIX
from exo.shared.types.chunks import Chunk, PrefillProgressChunk, TokenChunk, Usage
from exo.shared.types.text_generation import ToolCall

# ---------------------------------------------------------------- response


def _stop_reason(reason: CompletedReason, called_tools: bool) -> StopReason:
    """Map an internal finish reason onto Anthropic's."""
    match reason:
        case "stop":
            return "tool_use" if called_tools else "end_turn"
        case "tool_calls":
            return "tool_use"
        case "length":
            return "max_tokens"
        case _:
            assert_never(reason)


def _message_usage(usage: Usage) -> MessageUsage:
    return MessageUsage(
        input_tokens=usage.prompt_tokens - usage.cached_tokens,
        cache_read_input_tokens=usage.cached_tokens,
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(thinking_tokens=usage.reasoning_tokens),
    )


def tool_use_id(call_id: str) -> str:
    """Anthropic's spelling of a tool call's id (`toolu_…`; the engine names calls `call_…`)."""
    return "toolu_" + call_id.removeprefix(TOOL_CALL_ID_PREFIX)


def _tool_input(call: ToolCall) -> dict[str, Any]:
    """The `tool_use` block's input; for a call cut short by `max_tokens` the members
    written whole, as Anthropic returns one with `stop_reason: "max_tokens"`."""
    if is_cut(call):
        return complete_members(call.arguments)
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise GenerationError(
            f"the model's call of {call.name!r} has arguments that are not a JSON object",
            code="invalid_tool_call",
        )
    return arguments


async def message_events(chunks: AsyncIterator[Chunk]) -> AsyncIterator[StreamEvent]:
    """The content events of one generation, then its `message_delta`.

    Blocks are opened as their content arrives (a thinking block for `reasoning_text`, a
    text block for `text`, switching whenever the kind changes) and each tool call is one
    complete `tool_use` block whose input arrives as a single `input_json_delta`.

    Raises:
        ApiError: an `ErrorChunk`, a failed or cancelled finish, a tool call whose
            arguments are not a JSON object, or a stream that ended without a finish.
    """
    index = -1
    open_kind: str | None = None  # "text" or "thinking": the block still open
    called_tools = False

    def switch_to(kind: str, block: ContentBlock) -> list[StreamEvent]:
        nonlocal index, open_kind
        if open_kind == kind:
            return []
        events: list[StreamEvent] = []
        if open_kind is not None:
            events.append(ContentBlockStopEvent(index=index))
        index += 1
        open_kind = kind
        events.append(ContentBlockStartEvent(index=index, content_block=block))
        return events

    async for piece in stream.generation_events(chunks, conversation_param="messages"):
        match piece:
            case stream.Text():
                if piece.reasoning:
                    for event in switch_to("thinking", ThinkingBlock(thinking="")):
                        yield event
                    yield ContentBlockDeltaEvent(
                        index=index, delta=ThinkingDelta(thinking=piece.reasoning)
                    )
                if piece.text:
                    for event in switch_to("text", TextBlock(text="")):
                        yield event
                    yield ContentBlockDeltaEvent(index=index, delta=TextDelta(text=piece.text))
            case stream.ToolCalls():
                for call in piece.calls:
                    arguments = _tool_input(call)
                    if open_kind is not None:
                        yield ContentBlockStopEvent(index=index)
                        open_kind = None
                    index += 1
                    called_tools = True
                    yield ContentBlockStartEvent(
                        index=index,
                        content_block=ToolUseBlock(
                            id=tool_use_id(call.id), name=call.name, input={}
                        ),
                    )
                    yield ContentBlockDeltaEvent(
                        index=index, delta=InputJsonDelta(partial_json=json.dumps(arguments))
                    )
                    yield ContentBlockStopEvent(index=index)
            case stream.Finished():
                stop_reason = _stop_reason(piece.completed_reason, called_tools)
                stop_sequence = piece.stop_sequence
                if stop_sequence is not None and stop_reason == "end_turn":
                    stop_reason = "stop_sequence"
                else:
                    stop_sequence = None
                if open_kind is not None:
                    yield ContentBlockStopEvent(index=index)
                yield MessageDeltaEvent(
                    delta=MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                    usage=_message_usage(piece.final_usage),
                )
            case stream.Failed():
                raise piece.error
            case _:
                assert_never(piece)


def _sse(event: StreamEvent) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


PING_EVENT = 'event: ping\ndata: {"type": "ping"}\n\n'
"""Anthropic's keep-alive event (its SDKs skip it), sent while the first chunk is awaited."""


def error_event(error: ApiError) -> str:
    """An `event: error` SSE event in Anthropic's error shape (the SDK raises on it)."""
    body = ErrorResponse(
        error=ErrorDetail(type=error_type_for_status(error.status_code), message=error.message)
    )
    return _sse(body)


WAITING_FRAMES = WaitingFrames(failure=lambda error: (error_event(error),), heartbeat=PING_EVENT)
"""A Claude stream before its first chunk (`exo.api.serving.early_stream`): `ping` events
while waiting, one `error` event (the SDK raises it) when the request fails."""


async def stream_message(
    chunks: AsyncIterator[Chunk], *, message_id: str, model: str
) -> AsyncIterator[str]:
    """Render one generation as Anthropic's SSE stream.

    Yields, each as `event: <type>\\ndata: <json>\\n\\n`: `message_start` (empty content;
    `input_tokens` and `cache_read_input_tokens` from the first chunk's `prompt_tokens` and
    `cached_tokens`, which is read first — the engine's admission of the request
    (`PrefillProgressChunk`) or the first token; 0 if it has none), the content events of
    `message_events`, `message_delta` (stop reason and final usage), `message_stop`. On
    failure the rest is replaced by one `error` event and the stream ends.

    Args:
        chunks: The generation's internal chunks.
        message_id: `msg_` + the command id (`generation.response_id`).
        model: The model name to report.
    """
    first = await anext(chunks, None)
    prompt_tokens, cached_tokens = 0, 0
    if isinstance(first, TokenChunk | PrefillProgressChunk):
        prompt_tokens = first.prompt_tokens or 0
        cached_tokens = min(first.cached_tokens or 0, prompt_tokens)
    start = Message(
        id=message_id,
        model=model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=MessageUsage(
            input_tokens=prompt_tokens - cached_tokens,
            cache_read_input_tokens=cached_tokens,
            output_tokens=0,
        ),
    )
    yield _sse(MessageStartEvent(message=start))
    try:
        async for event in message_events(_prepend(first, chunks)):
            yield _sse(event)
    except ApiError as error:
        yield error_event(error)
        return
    yield _sse(MessageStopEvent())


async def _prepend(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


async def collect_message(chunks: AsyncIterator[Chunk], *, message_id: str, model: str) -> Message:
    """Gather one generation into a non-streaming `Message`: the accumulation of exactly
    the events `stream_message` would send.

    Raises:
        ApiError: as `message_events`.
    """
    blocks: list[ContentBlock] = []
    pieces: list[list[str]] = []
    async for event in message_events(chunks):
        match event:
            case ContentBlockStartEvent():
                blocks.append(event.content_block)
                pieces.append([])
            case ContentBlockDeltaEvent():
                match event.delta:
                    case TextDelta():
                        pieces[event.index].append(event.delta.text)
                    case ThinkingDelta():
                        pieces[event.index].append(event.delta.thinking)
                    case InputJsonDelta():
                        pieces[event.index].append(event.delta.partial_json)
                    case _:
                        assert_never(event.delta)
            case ContentBlockStopEvent():
                blocks[event.index] = _completed_block(
                    blocks[event.index], "".join(pieces[event.index])
                )
            case MessageDeltaEvent():
                return Message(
                    id=message_id,
                    model=model,
                    content=blocks,
                    stop_reason=event.delta.stop_reason,
                    stop_sequence=event.delta.stop_sequence,
                    usage=event.usage,
                )
            case MessageStartEvent() | MessageStopEvent() | ErrorResponse():
                raise AssertionError(f"message_events yielded {event.type}")
            case _:
                assert_never(event)
    raise AssertionError("message_events ended without a message_delta")


def _completed_block(block: ContentBlock, content: str) -> ContentBlock:
    match block:
        case TextBlock():
            return TextBlock(text=content)
        case ThinkingBlock():
            return ThinkingBlock(thinking=content, signature=block.signature)
        case ToolUseBlock():
            return ToolUseBlock(id=block.id, name=block.name, input=json.loads(content))
        case _:
            assert_never(block)
