"""The OpenAI Responses event state machine: `ResponseAssembler` turns one generation's
pieces (answer text, thinking text, tool calls, the finish) into Responses stream events
and keeps the `ResponseObject` they add up to, so the streamed events and the final object
always agree (ids, output indexes, texts). `response` drives it with chunks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, TypedDict, assert_never

from exo.api.openai_responses.context import ResponseContext
from exo.api.openai_responses.response_types import (
    ContentPartEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
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
    ReasoningSummaryPartEvent,
    ReasoningSummaryTextDeltaEvent,
    ReasoningSummaryTextDoneEvent,
    ResponseErrorDetail,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    StreamEvent,
    SummaryText,
)
from exo.api.wire.errors import ApiError
from exo.api.wire.stream import unfinished_generation_error
from exo.chat_protocol.cut_tool_call import is_cut
from exo.shared.types.chunks import FinishReason, ToolCall, Usage

_STATUS_BY_FINISH_REASON: dict[FinishReason, ResponseStatus] = {
    "stop": "completed",
    "tool_calls": "completed",
    "length": "incomplete",
    "cancelled": "cancelled",
    "error": "failed",
}


@dataclass(slots=True)
class _ItemPlace:
    """Where an output item stands: its index in `output` and its id."""

    output_index: int
    item_id: str


@dataclass(slots=True)
class _OpenMessage(_ItemPlace):
    texts: list[str] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)


@dataclass(slots=True)
class _OpenReasoning(_ItemPlace):
    texts: list[str] = field(default_factory=list)


class _InItem(TypedDict):
    """The fields an event inside an output item starts with (`_ItemEvent`'s)."""

    sequence_number: int
    item_id: str
    output_index: int


class ResponseAssembler:
    """Turns chunks into stream events and keeps the response they add up to.

    Items open when their first piece arrives and close when a piece of another kind
    (answer text, thinking text, tool call) or the finish arrives, so output indexes follow
    the order in which the model produced things.
    """

    def __init__(self, context: ResponseContext) -> None:
        self._context = context
        self._sequence_number = 0
        self._started = False
        self._output: list[OutputItem] = []
        self._open: _OpenMessage | _OpenReasoning | None = None
        self.error: ApiError | None = None
        """Set by `fail`: what ended the generation."""

    # -- events

    def _next_sequence_number(self) -> int:
        number = self._sequence_number
        self._sequence_number += 1
        return number

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}{self._context.id_hex}_{len(self._output)}"

    def _in_item(self, place: _ItemPlace) -> _InItem:
        """The next sequence number and the item's id and output index, for an event
        inside the item at `place`."""
        return _InItem(
            sequence_number=self._next_sequence_number(),
            item_id=place.item_id,
            output_index=place.output_index,
        )

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
            output=list(self._output),
            usage=usage,
            **context.echoed_fields(),
        )

    def start(self) -> Iterator[StreamEvent]:
        """`response.created` and `response.in_progress`, once (a stream whose headers went
        out before its first chunk sends them early: `exo.api.serving.early_stream`)."""
        if self._started:
            return
        self._started = True
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
            **self._in_item(self._open), content_index=0, delta=text, logprobs=logprobs
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
                **self._in_item(self._open),
                summary_index=0,
                part=SummaryText(text=""),
            )
        assert isinstance(self._open, _OpenReasoning)
        self._open.texts.append(text)
        yield ReasoningSummaryTextDeltaEvent(
            **self._in_item(self._open), summary_index=0, delta=text
        )

    def add_tool_call(self, call: ToolCall) -> Iterator[StreamEvent]:
        yield from self._close("completed")
        place = _ItemPlace(output_index=len(self._output), item_id=self._item_id("fc_"))
        namespace, name = self._context.client_tool_name(call.name)
        yield self._item_event(
            "response.output_item.added",
            OutputFunctionCall(
                id=place.item_id,
                call_id=call.id,
                name=name,
                namespace=namespace,
                arguments="",
                status="in_progress",
            ),
        )
        yield FunctionCallArgumentsDeltaEvent(**self._in_item(place), delta=call.arguments)
        yield FunctionCallArgumentsDoneEvent(
            **self._in_item(place), name=name, arguments=call.arguments
        )
        item = OutputFunctionCall(
            id=place.item_id,
            call_id=call.id,
            name=name,
            namespace=namespace,
            arguments=call.arguments,
            # Cut short by `max_output_tokens`: its arguments stop where the tokens ran out.
            status="incomplete" if is_cut(call) else "completed",
        )
        self._output.append(item)
        yield self._item_event("response.output_item.done", item, place.output_index)

    def finish(self, reason: FinishReason, usage: Usage) -> Iterator[StreamEvent]:
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

    def final(self, reason: FinishReason, usage: Usage) -> ResponseObject:
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

    def _usage(self, usage: Usage) -> ResponseUsage:
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
            **self._in_item(self._open),
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
                    **self._in_item(open_item),
                    content_index=0,
                    text=text,
                    logprobs=open_item.logprobs,
                )
                yield ContentPartEvent(
                    type="response.content_part.done",
                    **self._in_item(open_item),
                    content_index=0,
                    part=part,
                )
                message = OutputMessage(id=open_item.item_id, status=status, content=[part])
                self._output.append(message)
                yield self._item_event("response.output_item.done", message, open_item.output_index)
            case _OpenReasoning():
                text = "".join(open_item.texts)
                yield ReasoningSummaryTextDoneEvent(
                    **self._in_item(open_item), summary_index=0, text=text
                )
                yield ReasoningSummaryPartEvent(
                    type="response.reasoning_summary_part.done",
                    **self._in_item(open_item),
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
