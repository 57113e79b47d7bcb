"""Response wire models of the OpenAI Responses API (`POST /v1/responses`): the response
object (the non-streaming body) and the stream events; the request models are in
`openai_responses`.

Response models are what we emit and stay exact. They follow the `openai` SDK's `Response`
and `Response*Event` models (checked in openai 3.57), so that `client.responses.create(...)`
and its streaming helpers parse them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from exo.api.openai_responses.request_types import ReasoningSummary, RequestReasoningEffort


class _WireResponseModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


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
    namespace: str | None = Field(default=None, exclude_if=lambda value: value is None)
    """The `namespace` tool of the function called (left out for a plain function tool)."""


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
    """Every stream event: its place in the stream and its `type` (each event narrows it
    to its own literal, in this position of the JSON)."""

    sequence_number: int = Field(ge=0)
    type: str


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


class _ItemEvent(_Event):
    """An event inside one output item, which it names by id and output index."""

    item_id: str
    output_index: int = Field(ge=0)


class _ContentEvent(_ItemEvent):
    """An event of a message's content part (`content_index`)."""

    content_index: int = Field(ge=0)


class _SummaryEvent(_ItemEvent):
    """An event of a reasoning item's summary part (`summary_index`)."""

    summary_index: int = Field(ge=0)


class ContentPartEvent(_ContentEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: OutputText


class OutputTextDeltaEvent(_ContentEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    delta: str
    logprobs: list[LogprobEntry] = Field(default_factory=list)


class OutputTextDoneEvent(_ContentEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    text: str
    logprobs: list[LogprobEntry] = Field(default_factory=list)


class ReasoningSummaryPartEvent(_SummaryEvent):
    type: Literal["response.reasoning_summary_part.added", "response.reasoning_summary_part.done"]
    part: SummaryText


class ReasoningSummaryTextDeltaEvent(_SummaryEvent):
    type: Literal["response.reasoning_summary_text.delta"] = "response.reasoning_summary_text.delta"
    delta: str


class ReasoningSummaryTextDoneEvent(_SummaryEvent):
    type: Literal["response.reasoning_summary_text.done"] = "response.reasoning_summary_text.done"
    text: str


class FunctionCallArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    delta: str


class FunctionCallArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
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
