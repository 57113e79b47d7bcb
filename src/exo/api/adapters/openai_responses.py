"""OpenAI Responses <-> internal types. The only module that knows this dialect.

Pure conversions: a wire request becomes `TextGenerationTaskParams`; the internal chunk
stream of one generation becomes either the Responses SSE events or one `ResponseObject`.
Both go through one `_ResponseAssembler`, so the streamed events and the final object
always agree (ids, output indexes, texts).

Choices where the API leaves room:
- Thinking text (`TokenChunk.reasoning_text`) is reported as a `reasoning` output item whose
  `summary` holds the text as it was generated (exo does not summarise).
- `reasoning.effort`: "none" and "minimal" turn thinking off (`enable_thinking=False`;
  "minimal" is still passed on as `reasoning_effort` for templates that know it); "low",
  "medium", "high" turn it on with that effort; "xhigh" and "max" become "high". No effort:
  the chat template's default.
- Logprobs are returned when `include` lists `message.output_text.logprobs` or
  `top_logprobs` > 0; they belong to the answer text only (a thinking token's are dropped).
- A generation cancelled (`POST /v1/cancel/resp_…`) ends as status `cancelled`; a
  streamed one emits `response.incomplete` (the Responses stream has no cancelled event).
- Failure after the HTTP status was sent is a `response.failed` event whose response has
  `error: {code, message}` (`invalid_prompt` when the request was at fault, else
  `server_error`); the stream then ends.

A chunk stream ends with the first chunk whose `finish_reason` is set; nothing after it is
read. The caller owns the chunk iterator and closes it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Literal, assert_never

from exo.api.errors import ApiError, GenerationError, InvalidRequestError
from exo.api.generation import build_task_params
from exo.api.types.openai_responses import (
    ContentPart,
    ContentPartEvent,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    FunctionToolChoiceEcho,
    FunctionToolEcho,
    FunctionToolSpec,
    IncompleteDetails,
    InputImagePart,
    InputItem,
    InputTextPart,
    ItemStatus,
    LogprobEntry,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    OutputTextInputPart,
    OutputTokensDetails,
    ReasoningEcho,
    ReasoningItem,
    ReasoningSummaryPartEvent,
    ReasoningSummaryTextDeltaEvent,
    ReasoningSummaryTextDoneEvent,
    RefusalInputPart,
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
    UnsupportedItem,
    UnsupportedPart,
    UnsupportedTool,
    UnsupportedToolChoice,
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
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    ReasoningEffort,
    TextGenerationTaskParams,
    ToolChoice,
    ToolDefinition,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Parts of one message are joined with a newline, as the Chat Completions adapter does.
_TEXT_PART_SEPARATOR = "\n"
_NOT_SUPPORTED = "is not supported"

# Internal field -> this dialect's name, for errors raised by `build_task_params`.
_PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "top_logprobs": "top_logprobs",
}


# ---------------------------------------------------------------- request


def to_task_params(request: ResponsesRequest) -> TextGenerationTaskParams:
    """Convert a Responses request into the internal generation request.

    `instructions` becomes a leading system message; input items become chat turns
    (function calls join the assistant turn before them, reasoning items become the
    `reasoning_content` of the assistant turn after them).

    Args:
        request: A schema-valid request.

    Returns:
        The internal params; sampling fields the client left out stay None (model card
        defaults apply).

    Raises:
        InvalidRequestError: the request asks for something exo does not do (stored
            responses or conversations, background mode, hosted tools, image or file input,
            `json_schema` output) or is inconsistent (a function call output without its
            call, a tool choice naming an unknown tool, an empty input).
    """
    _refuse_unsupported_features(request)
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(ChatMessage(role="user", content=request.input))
    else:
        messages.extend(_to_chat_messages(request.input))
    if not any(message.role != "system" for message in messages):
        raise InvalidRequestError(
            "input must contain at least one user, assistant or tool turn", "input"
        )
    enable_thinking, reasoning_effort = _thinking(request)
    include = request.include or []
    top_logprobs = request.top_logprobs or 0
    try:
        return build_task_params(
            model=ModelId(request.model),
            messages=tuple(messages),
            max_tokens=request.max_output_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stream=request.stream,
            tools=tuple(_to_tool_definition(tool) for tool in _function_tools(request)),
            tool_choice=_tool_choice(request),
            parallel_tool_calls=(
                True if request.parallel_tool_calls is None else request.parallel_tool_calls
            ),
            response_format=_response_format(request),
            logprobs=LOGPROBS_INCLUDE in include or top_logprobs > 0,
            top_logprobs=top_logprobs,
            enable_thinking=enable_thinking,
            reasoning_effort=reasoning_effort,
        )
    except InvalidRequestError as error:
        param = _PARAM_NAMES.get(error.param or "", error.param)
        message = error.message
        for internal, external in _PARAM_NAMES.items():
            message = message.replace(f"{internal}:", f"{external}:")
        raise InvalidRequestError(message, param, error.code) from None


def _refuse_unsupported_features(request: ResponsesRequest) -> None:
    if request.previous_response_id is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: exo does not store responses. Send the "
            "whole conversation in `input` instead (earlier output items can be passed back "
            "as input items)",
            "previous_response_id",
        )
    if request.conversation is not None:
        raise InvalidRequestError(
            "conversation is not supported: exo does not store conversations; send the "
            "whole conversation in `input`",
            "conversation",
        )
    if request.prompt is not None:
        raise InvalidRequestError(
            "prompt templates are not supported: exo stores no prompts; send `instructions` "
            "and `input`",
            "prompt",
        )
    if request.background:
        raise InvalidRequestError(
            "background mode is not supported: exo does not store responses; use stream=true "
            "for long generations",
            "background",
        )
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type == "json_schema":
        raise InvalidRequestError(
            "text.format of type 'json_schema' is not supported yet; use 'json_object' "
            "(any JSON object) or 'text'",
            "text.format",
        )
    for index, tool in enumerate(request.tools or []):
        if isinstance(tool, UnsupportedTool):
            raise InvalidRequestError(
                f"tools of type {tool.type!r} {_NOT_SUPPORTED}: exo runs no hosted tools; "
                "only 'function' tools are",
                f"tools[{index}]",
            )
    if isinstance(request.tool_choice, UnsupportedToolChoice):
        raise InvalidRequestError(
            f"tool_choice of type {request.tool_choice.type!r} {_NOT_SUPPORTED}; use 'auto', "
            "'none', 'required' or {'type': 'function', 'name': ...}",
            "tool_choice",
        )


def _function_tools(request: ResponsesRequest) -> list[FunctionToolSpec]:
    return [tool for tool in request.tools or [] if isinstance(tool, FunctionToolSpec)]


def _to_tool_definition(tool: FunctionToolSpec) -> ToolDefinition:
    return ToolDefinition(
        name=tool.name, description=tool.description, parameters=tool.parameters or {}
    )


def _tool_choice(request: ResponsesRequest) -> ToolChoice:
    """The internal tool choice, checked against the tools and `text.format` here (rather
    than by the internal model's validator) so that the error names this dialect's field."""
    choice = request.tool_choice
    names = [tool.name for tool in _function_tools(request)]
    converted: ToolChoice
    match choice:
        case None:
            converted = "auto"
        case FunctionToolChoice():
            if choice.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.name!r}, which is not among the function tools "
                    f"({', '.join(names) or 'none given'})",
                    "tool_choice",
                )
            converted = NamedToolChoice(name=choice.name)
        case UnsupportedToolChoice():  # refused earlier
            raise AssertionError("unsupported tool_choice reached conversion")
        case "required" if not names:
            raise InvalidRequestError(
                "tool_choice 'required' needs at least one tool in `tools`", "tool_choice"
            )
        case _:
            converted = choice
    forced = converted == "required" or isinstance(converted, NamedToolChoice)
    if forced and _response_format(request) == "json_object":
        raise InvalidRequestError(
            "text.format 'json_object' cannot be combined with a forced function call "
            "(tool_choice 'required' or a named function)",
            "text.format",
        )
    return converted


def _response_format(request: ResponsesRequest) -> Literal["text", "json_object"]:
    if request.text is None or request.text.format is None:
        return "text"
    kind = request.text.format.type
    return "json_object" if kind == "json_object" else "text"


def _thinking(request: ResponsesRequest) -> tuple[bool | None, ReasoningEffort | None]:
    """(enable_thinking, reasoning_effort) for the request's `reasoning.effort`."""
    effort = request.reasoning.effort if request.reasoning else None
    match effort:
        case None:
            return None, None
        case "none":
            return False, None
        case "minimal":
            return False, "minimal"
        case "low" | "medium" | "high":
            return True, effort
        case "xhigh" | "max":
            return True, "high"
        case _:
            assert_never(effort)


def _to_chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    pending_reasoning: list[str] = []
    call_ids: set[str] = set()
    # Function calls join the assistant turn they directly follow (its text, or earlier
    # calls of the same turn); anything else in between starts a new turn.
    previous_was_assistant = False
    for index, item in enumerate(items):
        param = f"input[{index}]"
        match item:
            case MessageItem():
                role = "system" if item.role == "developer" else item.role
                content = _message_text(item, param)
                reasoning = None
                if role == "assistant" and pending_reasoning:
                    reasoning = _TEXT_PART_SEPARATOR.join(pending_reasoning)
                    pending_reasoning.clear()
                messages.append(
                    ChatMessage(role=role, content=content, reasoning_content=reasoning)
                )
                previous_was_assistant = role == "assistant"
            case FunctionCallItem():
                call = ToolCall(id=item.call_id, name=item.name, arguments=item.arguments)
                call_ids.add(item.call_id)
                if previous_was_assistant and not pending_reasoning:
                    last = messages[-1]
                    messages[-1] = last.model_copy(update={"tool_calls": (*last.tool_calls, call)})
                else:
                    messages.append(
                        ChatMessage(
                            role="assistant",
                            tool_calls=(call,),
                            reasoning_content=(
                                _TEXT_PART_SEPARATOR.join(pending_reasoning)
                                if pending_reasoning
                                else None
                            ),
                        )
                    )
                    pending_reasoning.clear()
                previous_was_assistant = True
            case FunctionCallOutputItem():
                if item.call_id not in call_ids:
                    raise InvalidRequestError(
                        f"no function_call with call_id {item.call_id!r} precedes this "
                        "function_call_output; exo stores no responses, so the call must be "
                        "in `input` too",
                        f"{param}.call_id",
                    )
                messages.append(
                    ChatMessage(
                        role="tool",
                        content=_parts_text(item.output, f"{param}.output"),
                        tool_call_id=item.call_id,
                    )
                )
                previous_was_assistant = False
            case ReasoningItem():
                # A reasoning item with no assistant turn after it has nowhere to go and is
                # dropped.
                texts = [part.text for part in item.summary] or [
                    part.text for part in item.content or []
                ]
                text = _TEXT_PART_SEPARATOR.join(texts)
                if text:
                    pending_reasoning.append(text)
                previous_was_assistant = False
            case UnsupportedItem():
                raise InvalidRequestError(_unsupported_item_message(item.type), f"{param}.type")
            case _:
                assert_never(item)
    return messages


def _unsupported_item_message(kind: str) -> str:
    if kind == "item_reference":
        return (
            "input items of type 'item_reference' are not supported: exo does not store "
            "responses; send the item itself"
        )
    return (
        f"input items of type {kind!r} {_NOT_SUPPORTED}; exo accepts 'message', "
        "'function_call', 'function_call_output' and 'reasoning' items"
    )


def _message_text(item: MessageItem, param: str) -> str:
    return _parts_text(item.content, f"{param}.content")


def _parts_text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for index, part in enumerate(content):
        match part:
            case InputTextPart() | OutputTextInputPart():
                texts.append(part.text)
            case RefusalInputPart():
                # A replayed refusal is what the assistant said.
                texts.append(part.refusal)
            case InputImagePart():
                raise InvalidRequestError(
                    "image input is not supported: the model has no vision; send "
                    "input_text parts only",
                    f"{param}[{index}]",
                )
            case UnsupportedPart():
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} {_NOT_SUPPORTED}; send input_text parts",
                    f"{param}[{index}]",
                )
            case _:
                assert_never(part)
    return _TEXT_PART_SEPARATOR.join(texts)


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
            format=TextFormatEcho(type=params.response_format),
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
            for tool in _function_tools(request)
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
                yield from self.fail(GenerationError("generation failed", code="generation_failed"))
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
            token=entry.token,
            logprob=entry.logprob,
            bytes=list(entry.bytes),
            top_logprobs=[
                TopLogprobEntry(token=top.token, logprob=top.logprob, bytes=list(top.bytes))
                for top in entry.top_logprobs
            ],
        )
        for entry in logprobs
    ]


def _error_chunk_error(chunk: ErrorChunk) -> ApiError:
    if chunk.status_code == 400:
        return InvalidRequestError(chunk.error_message, param="input", code=chunk.error_code)
    return GenerationError(chunk.error_message, code=chunk.error_code or "generation_failed")


def _ended_without_finish() -> GenerationError:
    return GenerationError("generation stream ended without a finish", code="generation_failed")


async def _events(
    chunks: AsyncIterator[Chunk], assembler: _ResponseAssembler
) -> AsyncIterator[StreamEvent]:
    """Every event of one generation, `response.created` to the terminal event."""
    for event in assembler.start():
        yield event
    async for chunk in chunks:
        match chunk:
            case TokenChunk():
                assembler.counted_output_tokens += len(chunk.token_ids)
                if chunk.reasoning_text:
                    for event in assembler.add_reasoning(chunk.reasoning_text):
                        yield event
                if chunk.text:
                    logprobs = _logprob_entries(chunk.logprobs)
                    for event in assembler.add_text(chunk.text, logprobs):
                        yield event
            case ToolCallChunk():
                assembler.counted_output_tokens += len(chunk.token_ids)
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
            for event in assembler.finish(chunk.finish_reason, chunk.usage):
                yield event
            return
    for event in assembler.fail(_ended_without_finish()):
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
