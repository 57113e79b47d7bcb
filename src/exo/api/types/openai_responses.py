"""Wire models of the OpenAI Responses API (`POST /v1/responses`).

Request models validate types and ranges only (a failure there is a schema error, 400);
what the request *means* — hosted tools, image input, stored state — is checked by
`exo.api.adapters.openai_responses.to_task_params`, which answers with a 400.

Item and content-part unions fall back to an `Unsupported…` member for any `type` we do
not handle (hosted tool calls, `input_file`, `web_search` tools, ...), so that the adapter
can refuse them with a 400 that names the type instead of a schema error. Unknown request
fields are ignored, as in the Chat Completions models; the declared fields that change
nothing (`store`, `metadata`, `truncation`, `user`, `prompt_cache_key`, `service_tier`,
`text.verbosity`, ...) are the README's compatibility no-ops: the official SDK and Codex
CLI send them on every request.

Request models are lax (they face arbitrary HTTP clients); response models are what we
emit and stay exact. The response models follow the `openai` SDK's `Response` and
`Response*Event` models (checked in openai 3.57), so that `client.responses.create(...)`
and its streaming helpers parse them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

from exo.api.types.wire import VllmTopK, WireRequestModel

# OpenAI caps top_logprobs at 20.
MAX_TOP_LOGPROBS = 20


class _WireRequestModel(WireRequestModel):
    """Unknown fields are ignored and logged at debug level (`exo.api.types.wire`)."""


class _WireResponseModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _type_or(fallback: str, known: frozenset[str], default: str | None = None) -> Any:
    """A pydantic discriminator: the object's `type` when it is one of `known`, `default`
    when it has no `type`, else `fallback` (the union's catch-all member, whose schema
    then reports a `type` that is not a string). Any JSON value may arrive here, lists
    and objects included, so `type` is only looked up when it is a string."""

    def discriminate(value: Any) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if kind is None and default is not None:
            return default
        return kind if isinstance(kind, str) and kind in known else fallback

    return Discriminator(discriminate)


# ---------------------------------------------------------------- request: content parts


class InputTextPart(_WireRequestModel):
    type: Literal["input_text"]
    text: str


class OutputTextInputPart(_WireRequestModel):
    """An earlier assistant answer replayed in the input (`annotations`/`logprobs` ignored)."""

    type: Literal["output_text"]
    text: str


class RefusalInputPart(_WireRequestModel):
    type: Literal["refusal"]
    refusal: str


class InputImagePart(_WireRequestModel):
    """Accepted by the schema so the adapter can refuse it with a clear 400."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class UnsupportedPart(_WireRequestModel):
    """Any other content part (`input_file`, `input_audio`, ...); refused by the adapter."""

    model_config = ConfigDict(frozen=True, extra="allow")
    type: str


_PART_TYPES = frozenset({"input_text", "output_text", "refusal", "input_image"})
ContentPart = Annotated[
    Annotated[InputTextPart, Tag("input_text")]
    | Annotated[OutputTextInputPart, Tag("output_text")]
    | Annotated[RefusalInputPart, Tag("refusal")]
    | Annotated[InputImagePart, Tag("input_image")]
    | Annotated[UnsupportedPart, Tag("unsupported")],
    _type_or("unsupported", _PART_TYPES),
]


# ---------------------------------------------------------------- request: input items


class MessageItem(_WireRequestModel):
    """A conversation turn; `type: "message"` may be left out (OpenAI's "easy" input
    message). `developer` is OpenAI's newer name for `system`."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_WireRequestModel):
    """An assistant's earlier function call, replayed in the input."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_WireRequestModel):
    """The result of a function call, sent back by the client."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None


class SummaryTextPart(_WireRequestModel):
    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(_WireRequestModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_WireRequestModel):
    """An assistant's earlier reasoning, replayed in the input; becomes the
    `reasoning_content` of the assistant turn that follows it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryTextPart] = Field(default_factory=list)
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None


class UnsupportedItem(_WireRequestModel):
    """Any other input item (`item_reference`, hosted tool calls, ...); refused by the
    adapter."""

    model_config = ConfigDict(frozen=True, extra="allow")
    type: str


_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[UnsupportedItem, Tag("unsupported")],
    _type_or("unsupported", _ITEM_TYPES, default="message"),
]


# ---------------------------------------------------------------- request: tools


class FunctionToolSpec(_WireRequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class UnsupportedTool(_WireRequestModel):
    """A hosted tool (`web_search`, `file_search`, `mcp`, ...); refused by the adapter."""

    model_config = ConfigDict(frozen=True, extra="allow")
    type: str


ToolSpec = Annotated[
    Annotated[FunctionToolSpec, Tag("function")] | Annotated[UnsupportedTool, Tag("unsupported")],
    _type_or("unsupported", frozenset({"function"})),
]


class FunctionToolChoice(_WireRequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1)


class UnsupportedToolChoice(_WireRequestModel):
    """`allowed_tools`, hosted tool types, ...; refused by the adapter."""

    model_config = ConfigDict(frozen=True, extra="allow")
    type: str


ToolChoiceSpec = (
    Literal["auto", "none", "required"]
    | Annotated[
        Annotated[FunctionToolChoice, Tag("function")]
        | Annotated[UnsupportedToolChoice, Tag("unsupported")],
        _type_or("unsupported", frozenset({"function"})),
    ]
)


# ---------------------------------------------------------------- request: options


RequestReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ReasoningSummary = Literal["auto", "concise", "detailed"]


class ReasoningConfig(_WireRequestModel):
    effort: RequestReasoningEffort | None = None
    summary: ReasoningSummary | None = None
    generate_summary: ReasoningSummary | None = None


class TextFormatSpec(_WireRequestModel):
    """`text.format`. A `json_schema` format carries `name`, the `schema` the answer must
    follow (absent: any JSON object), a `description` and `strict` (accepted and echoed;
    decoding always follows the schema as far as exo's JSON-schema constraint goes)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_WireRequestModel):
    format: TextFormatSpec | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_WireRequestModel):
    """The body of `POST /v1/responses`. Fields marked "ignored" are accepted for
    compatibility and have no effect; those marked "refused" make the adapter answer 400
    when they ask for something (stored state, background mode)."""

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None

    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Not an OpenAI parameter: vLLM's extension, as on Chat Completions.
    top_k: VllmTopK | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoiceSpec | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    # Refused when set: exo keeps no responses or conversations.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None

    # Ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    max_tool_calls: int | None = None
    stream_options: dict[str, Any] | None = None


# ---------------------------------------------------------------- response: output items


class TopLogprobEntry(_WireResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(_WireResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class OutputText(_WireResponseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[LogprobEntry] = Field(default_factory=list)


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_WireResponseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class SummaryText(_WireResponseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class OutputReasoning(_WireResponseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[SummaryText]
    status: ItemStatus


class OutputFunctionCall(_WireResponseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = Annotated[
    OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")
]


# ---------------------------------------------------------------- response: object


class InputTokensDetails(_WireResponseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(_WireResponseModel):
    reasoning_tokens: int = Field(ge=0)


class ResponseUsage(_WireResponseModel):
    input_tokens: int = Field(ge=0)
    input_tokens_details: InputTokensDetails = InputTokensDetails()
    output_tokens: int = Field(ge=0)
    output_tokens_details: OutputTokensDetails
    total_tokens: int = Field(ge=0)


class ResponseErrorDetail(_WireResponseModel):
    """`code` is one of OpenAI's Responses error codes (`server_error`, `invalid_prompt`)."""

    code: str
    message: str


class IncompleteDetails(_WireResponseModel):
    reason: Literal["max_output_tokens"]


class FunctionToolEcho(_WireResponseModel):
    type: Literal["function"] = "function"
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class FunctionToolChoiceEcho(_WireResponseModel):
    type: Literal["function"] = "function"
    name: str


class TextFormatEcho(_WireResponseModel):
    """The echoed `text.format`: `name`, `schema`, `description` and `strict` only for a
    `json_schema` format (left out of the JSON otherwise, as OpenAI does)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", serialize_by_alias=True, validate_by_name=True
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.type != "json_schema":
            return {"type": data["type"]}
        return {key: value for key, value in data.items() if value is not None}


class TextConfigEcho(_WireResponseModel):
    format: TextFormatEcho
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningEcho(_WireResponseModel):
    effort: RequestReasoningEffort | None = None
    summary: ReasoningSummary | None = None


ResponseStatus = Literal["completed", "failed", "in_progress", "cancelled", "incomplete"]


class ResponseObject(_WireResponseModel):
    """A response: the non-streaming body, and the `response` of the lifecycle events.

    `store` is always false (exo keeps no responses); the sampling fields echo the request
    (None when the client left them to the model card's defaults).
    """

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(description="Unix time, seconds.")
    completed_at: int | None = None
    status: ResponseStatus
    error: ResponseErrorDetail | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: ReasoningEcho
    store: Literal[False] = False
    temperature: float | None = None
    text: TextConfigEcho
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoiceEcho
    tools: list[FunctionToolEcho]
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


# ---------------------------------------------------------------- response: stream events


class _Event(_WireResponseModel):
    sequence_number: int = Field(ge=0)


class ResponseLifecycleEvent(_Event):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int = Field(ge=0)
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int = Field(ge=0)
    content_index: int = Field(ge=0)
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int = Field(ge=0)
    content_index: int = Field(ge=0)
    delta: str
    logprobs: list[LogprobEntry] = Field(default_factory=list)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int = Field(ge=0)
    content_index: int = Field(ge=0)
    text: str
    logprobs: list[LogprobEntry] = Field(default_factory=list)


class ReasoningSummaryPartEvent(_Event):
    type: Literal["response.reasoning_summary_part.added", "response.reasoning_summary_part.done"]
    item_id: str
    output_index: int = Field(ge=0)
    summary_index: int = Field(ge=0)
    part: SummaryText


class ReasoningSummaryTextDeltaEvent(_Event):
    type: Literal["response.reasoning_summary_text.delta"] = "response.reasoning_summary_text.delta"
    item_id: str
    output_index: int = Field(ge=0)
    summary_index: int = Field(ge=0)
    delta: str


class ReasoningSummaryTextDoneEvent(_Event):
    type: Literal["response.reasoning_summary_text.done"] = "response.reasoning_summary_text.done"
    item_id: str
    output_index: int = Field(ge=0)
    summary_index: int = Field(ge=0)
    text: str


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int = Field(ge=0)
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int = Field(ge=0)
    name: str
    arguments: str


StreamEvent = (
    ResponseLifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | ReasoningSummaryPartEvent
    | ReasoningSummaryTextDeltaEvent
    | ReasoningSummaryTextDoneEvent
    | FunctionCallArgumentsDeltaEvent
    | FunctionCallArgumentsDoneEvent
)
