"""OpenAI Responses output: one generation's chunks as Responses SSE events or one
`ResponseObject` (see `openai_responses` for the request side and the choices made).

Both go through one `_ResponseAssembler`, so the streamed events and the final object
always agree (ids, output indexes, texts). A chunk stream ends with the first chunk whose
`finish_reason` is set; nothing after it is read. The caller owns the chunk iterator.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Literal, assert_never

from exo.api.adapters.common import (
    ended_without_finish,
    error_chunk_error,
    logprob_token,
    unfinished_generation_error,
)
from exo.api.adapters.openai_responses import function_tools
from exo.api.errors import ApiError
from exo.api.types.openai_responses import (
    ContentPartEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionToolChoiceEcho,
    FunctionToolEcho,
    IncompleteDetails,
    InputTokensDetails,
    ItemStatus,
    LogprobEntry,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTokensDetails,
    ReasoningEcho,
    ReasoningSummaryPartEvent,
    ReasoningSummaryTextDeltaEvent,
    ReasoningSummaryTextDoneEvent,
    ResponseErrorDetail,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    StreamEvent,
    SummaryText,
    TextConfigEcho,
    TextFormatEcho,
    TopLogprobEntry,
)
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.text_generation import (
    NamedToolChoice,
    TextGenerationTaskParams,
)

# ---------------------------------------------------------------- response context


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What every response object of one request carries besides its output: its id,
    creation time and the request fields OpenAI echoes back."""

    response_id: str
    created_at: int
    model: str
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    reasoning: ReasoningEcho
    temperature: float | None
    text: TextConfigEcho
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoiceEcho
    tools: tuple[FunctionToolEcho, ...]
    top_logprobs: int | None
    top_p: float | None
    user: str | None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def id_hex(self) -> str:
        return self.response_id.split("_", 1)[-1]


def _format_echo(request: ResponsesRequest, params: TextGenerationTaskParams) -> TextFormatEcho:
    text_format = request.text.format if request.text else None
    if params.response_format != "json_schema" or text_format is None:
        return TextFormatEcho(type=params.response_format)
    return TextFormatEcho(
        type="json_schema",
        name=text_format.name,
        schema_=params.json_schema,
        description=text_format.description,
        strict=text_format.strict,
    )


def response_context(
    request: ResponsesRequest, params: TextGenerationTaskParams, response_id: str, created_at: int
) -> ResponseContext:
    """The echo fields of `request` (converted to `params`).

    Args:
        response_id: `response_id("resp_", command_id)`.
        created_at: Unix time, seconds.
    """
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoiceEcho
    if isinstance(params.tool_choice, NamedToolChoice):
        tool_choice = FunctionToolChoiceEcho(name=params.tool_choice.name)
    else:
        tool_choice = params.tool_choice
    reasoning = request.reasoning
    return ResponseContext(
        response_id=response_id,
        created_at=created_at,
        model=request.model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=params.parallel_tool_calls,
        reasoning=ReasoningEcho(
            effort=reasoning.effort if reasoning else None,
            summary=(reasoning.summary or reasoning.generate_summary) if reasoning else None,
        ),
        temperature=request.temperature,
        text=TextConfigEcho(
            format=_format_echo(request, params),
            verbosity=request.text.verbosity if request.text else None,
        ),
        tool_choice=tool_choice,
        tools=tuple(
            FunctionToolEcho(
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            )
            for tool in function_tools(request)
        ),
        top_logprobs=request.top_logprobs,
        top_p=request.top_p,
        user=request.user,
        metadata=dict(request.metadata or {}),
    )


def new_response_id() -> str:
    """A fresh id in OpenAI's format (`resp_` + 32 hex digits), for callers without a
    command id."""
    return f"resp_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- response assembly

_STATUS_BY_FINISH_REASON: dict[FinishReason, ResponseStatus] = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "cancelled": "cancelled",
    "error": "failed",
}


@dataclass(slots=True)
class _OpenMessage:
    output_index: int
    item_id: str
    texts: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)


@dataclass(slots=True)
class _OpenReasoning:
    output_index: int
    item_id: str
    texts: list[str] = field(default_factory=list)


class _ResponseAssembler:
    """Turns chunks into stream events and keeps the response they add up to.

    Items open when their first piece arrives and close when a piece of another kind
    (answer text, thinking text, tool call) or the finish arrives, so output indexes follow
    the order in which the model produced things.
    """

    def __init__(self, context: ResponseContext) -> None:
        self._context = context
        self._sequence_number = 0
        self._output: list[OutputItem] = []
        self._open: _OpenMessage | _OpenReasoning | None = None
        self.counted_output_tokens = 0
        self.error: ApiError | None = None
        """Set by `fail`: what ended the generation."""

    # -- events

    def _next_sequence_number(self) -> int:
        number = self._sequence_number
        self._sequence_number += 1
        return number

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}{self._context.id_hex}_{len(self._output)}"

    def response(
        self,
        status: ResponseStatus,
        usage: ResponseUsage | None = None,
        error: ResponseErrorDetail | None = None,
        incomplete: bool = False,
        completed_at: int | None = None,
    ) -> ResponseObject:
        context = self._context
        return ResponseObject(
            id=context.response_id,
            created_at=context.created_at,
            completed_at=completed_at,
            status=status,
            error=error,
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            model=context.model,
            output=list(self._output),
            instructions=context.instructions,
            max_output_tokens=context.max_output_tokens,
            parallel_tool_calls=context.parallel_tool_calls,
            reasoning=context.reasoning,
            temperature=context.temperature,
            text=context.text,
            tool_choice=context.tool_choice,
            tools=list(context.tools),
            top_logprobs=context.top_logprobs,
            top_p=context.top_p,
            usage=usage,
            user=context.user,
            metadata=dict(context.metadata),
        )

    def start(self) -> Iterator[StreamEvent]:
        for kind in ("response.created", "response.in_progress"):
            yield ResponseLifecycleEvent(
                type=kind,
                sequence_number=self._next_sequence_number(),
                response=self.response("in_progress"),
            )

    def add_text(self, text: str, logprobs: list[LogprobEntry]) -> Iterator[StreamEvent]:
        if not isinstance(self._open, _OpenMessage):
            yield from self._close("completed")
            yield from self._open_message()
        assert isinstance(self._open, _OpenMessage)
        self._open.texts.append(text)
        self._open.logprobs.extend(logprobs)
        yield OutputTextDeltaEvent(
            sequence_number=self._next_sequence_number(),
            item_id=self._open.item_id,
            output_index=self._open.output_index,
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def add_reasoning(self, text: str) -> Iterator[StreamEvent]:
        if not isinstance(self._open, _OpenReasoning):
            yield from self._close("completed")
            item_id = self._item_id("rs_")
            self._open = _OpenReasoning(output_index=len(self._output), item_id=item_id)
            yield self._item_event(
                "response.output_item.added",
                OutputReasoning(id=item_id, summary=[], status="in_progress"),
            )
            yield ReasoningSummaryPartEvent(
                type="response.reasoning_summary_part.added",
                sequence_number=self._next_sequence_number(),
                item_id=item_id,
                output_index=self._open.output_index,
                summary_index=0,
                part=SummaryText(text=""),
            )
        assert isinstance(self._open, _OpenReasoning)
        self._open.texts.append(text)
        yield ReasoningSummaryTextDeltaEvent(
            sequence_number=self._next_sequence_number(),
            item_id=self._open.item_id,
            output_index=self._open.output_index,
            summary_index=0,
            delta=text,
        )

    def add_tool_call(self, call: ToolCall) -> Iterator[StreamEvent]:
        yield from self._close("completed")
        item_id, output_index = self._item_id("fc_"), len(self._output)
        yield self._item_event(
            "response.output_item.added",
            OutputFunctionCall(
                id=item_id, call_id=call.id, name=call.name, arguments="", status="in_progress"
            ),
        )
        yield FunctionCallArgumentsDeltaEvent(
            sequence_number=self._next_sequence_number(),
            item_id=item_id,
            output_index=output_index,
            delta=call.arguments,
        )
        yield FunctionCallArgumentsDoneEvent(
            sequence_number=self._next_sequence_number(),
            item_id=item_id,
            output_index=output_index,
            name=call.name,
            arguments=call.arguments,
        )
        item = OutputFunctionCall(
            id=item_id,
            call_id=call.id,
            name=call.name,
            arguments=call.arguments,
            status="completed",
        )
        self._output.append(item)
        yield self._item_event("response.output_item.done", item, output_index)

    def finish(self, reason: FinishReason, usage: Usage | None) -> Iterator[StreamEvent]:
        """Close the open item and end with `response.completed` / `.incomplete` (length,
        cancelled) / `.failed` (reason "error")."""
        match reason:
            case "stop" | "tool_calls":
                if not any(
                    isinstance(item, OutputMessage | OutputFunctionCall) for item in self._output
                ) and not isinstance(self._open, _OpenMessage):
                    # An empty answer is still an (empty) assistant message.
                    yield from self._close("completed")
                    yield from self._open_message()
                yield from self._close("completed")
                yield self._terminal("response.completed", self.final(reason, usage))
            case "length" | "cancelled":
                yield from self._close("incomplete")
                yield self._terminal("response.incomplete", self.final(reason, usage))
            case "error":
                yield from self.fail(unfinished_generation_error("error"))
            case _:
                assert_never(reason)

    def final(self, reason: FinishReason, usage: Usage | None) -> ResponseObject:
        """The response after `finish(reason, usage)` (all items closed)."""
        status = _STATUS_BY_FINISH_REASON[reason]
        return self.response(
            status,
            usage=self._usage(usage),
            incomplete=reason == "length",
            completed_at=int(time.time()) if status == "completed" else None,
        )

    def fail(self, error: ApiError) -> Iterator[StreamEvent]:
        """Close the open item as incomplete and end with `response.failed`."""
        self.error = error
        yield from self._close("incomplete")
        code = "invalid_prompt" if error.status_code == 400 else "server_error"
        yield self._terminal(
            "response.failed",
            self.response("failed", error=ResponseErrorDetail(code=code, message=error.message)),
        )

    # -- helpers

    def _usage(self, usage: Usage | None) -> ResponseUsage:
        # The last chunk carries usage by contract; should a producer omit it, report what
        # the stream itself shows (input tokens then unknown, so 0).
        if usage is None:
            usage = Usage(prompt_tokens=0, completion_tokens=self.counted_output_tokens)
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens),
            total_tokens=usage.total_tokens,
        )

    def _terminal(
        self,
        kind: Literal["response.completed", "response.incomplete", "response.failed"],
        response: ResponseObject,
    ) -> ResponseLifecycleEvent:
        return ResponseLifecycleEvent(
            type=kind, sequence_number=self._next_sequence_number(), response=response
        )

    def _item_event(
        self,
        kind: Literal["response.output_item.added", "response.output_item.done"],
        item: OutputItem,
        output_index: int | None = None,
    ) -> OutputItemEvent:
        return OutputItemEvent(
            type=kind,
            sequence_number=self._next_sequence_number(),
            output_index=len(self._output) if output_index is None else output_index,
            item=item,
        )

    def _open_message(self) -> Iterator[StreamEvent]:
        item_id = self._item_id("msg_")
        self._open = _OpenMessage(output_index=len(self._output), item_id=item_id)
        yield self._item_event(
            "response.output_item.added",
            OutputMessage(id=item_id, status="in_progress", content=[]),
        )
        yield ContentPartEvent(
            type="response.content_part.added",
            sequence_number=self._next_sequence_number(),
            item_id=item_id,
            output_index=self._open.output_index,
            content_index=0,
            part=OutputText(text=""),
        )

    def _close(self, status: ItemStatus) -> Iterator[StreamEvent]:
        open_item, self._open = self._open, None
        match open_item:
            case None:
                return
            case _OpenMessage():
                text = "".join(open_item.texts)
                part = OutputText(text=text, logprobs=open_item.logprobs)
                yield OutputTextDoneEvent(
                    sequence_number=self._next_sequence_number(),
                    item_id=open_item.item_id,
                    output_index=open_item.output_index,
                    content_index=0,
                    text=text,
                    logprobs=open_item.logprobs,
                )
                yield ContentPartEvent(
                    type="response.content_part.done",
                    sequence_number=self._next_sequence_number(),
                    item_id=open_item.item_id,
                    output_index=open_item.output_index,
                    content_index=0,
                    part=part,
                )
                message = OutputMessage(id=open_item.item_id, status=status, content=[part])
                self._output.append(message)
                yield self._item_event("response.output_item.done", message, open_item.output_index)
            case _OpenReasoning():
                text = "".join(open_item.texts)
                yield ReasoningSummaryTextDoneEvent(
                    sequence_number=self._next_sequence_number(),
                    item_id=open_item.item_id,
                    output_index=open_item.output_index,
                    summary_index=0,
                    text=text,
                )
                yield ReasoningSummaryPartEvent(
                    type="response.reasoning_summary_part.done",
                    sequence_number=self._next_sequence_number(),
                    item_id=open_item.item_id,
                    output_index=open_item.output_index,
                    summary_index=0,
                    part=SummaryText(text=text),
                )
                reasoning = OutputReasoning(
                    id=open_item.item_id, summary=[SummaryText(text=text)], status=status
                )
                self._output.append(reasoning)
                yield self._item_event(
                    "response.output_item.done", reasoning, open_item.output_index
                )
            case _:
                assert_never(open_item)


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
    chunks: AsyncIterator[Chunk], assembler: _ResponseAssembler
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
    async for event in _events(chunks, _ResponseAssembler(context)):
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
    assembler = _ResponseAssembler(context)
    last: StreamEvent | None = None
    async for event in _events(chunks, assembler):
        last = event
    if assembler.error is not None:
        raise assembler.error
    assert isinstance(last, ResponseLifecycleEvent)
    return last.response
