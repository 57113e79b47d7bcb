"""Wire models of the Claude (Anthropic) Messages API: `POST /v1/messages` and
`POST /v1/messages/count_tokens`.

Request models check shapes and ranges only (a failure is a 400 `invalid_request_error`, as
Anthropic answers schema errors); what a request *means* — image input, server tools —
is judged by `exo.api.claude_messages.request`. Unknown fields are ignored: the official
SDK and Claude Code send fields that change nothing for a local model (`metadata`,
`cache_control` on blocks and tools, `service_tier`, `container`, `mcp_servers`,
`context_management`, `speed`, ...). Content blocks of a type we do not model are accepted
by the schema as `OtherBlockParam` so the adapter can refuse them by name.

Response and stream-event models are what we emit and stay exact (`extra="forbid"`).
Field names and event order follow Anthropic's API reference (checked against the
`anthropic` 2.14 SDK's types).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from exo.api.wire.request_model import Speculative, WireRequestModel


class _WireRequestModel(WireRequestModel):
    """Unknown fields are ignored and logged at debug level (`exo.api.wire.request_model`)."""


class _WireResponseModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------- request: content blocks


class TextBlockParam(_WireRequestModel):
    type: Literal["text"]
    text: str


class ImageBlockParam(_WireRequestModel):
    """An image (`source`: `base64` or `url`), read for a model with vision; refused with a
    clear 400 for any other model. The source is checked by the adapter, which names the
    field at fault."""

    type: Literal["image"]
    source: dict[str, Any]


class DocumentBlockParam(_WireRequestModel):
    type: Literal["document"]
    source: dict[str, Any]


class ThinkingBlockParam(_WireRequestModel):
    """An earlier assistant turn's thinking. Anthropic requires the `signature` it issued;
    ours are empty, so a missing one is accepted."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class RedactedThinkingBlockParam(_WireRequestModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlockParam(_WireRequestModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


class OtherBlockParam(_WireRequestModel):
    """Any block type not modelled above (`server_tool_use`, `search_result`,
    `web_search_tool_result`, `container_upload`, ...)."""

    type: str


_MODELLED_BLOCK_TYPES = frozenset(
    {"text", "image", "document", "thinking", "redacted_thinking", "tool_use", "tool_result"}
)


def _block_tag(value: Any) -> str:
    # Any JSON value may arrive here (a list is unhashable): only a string is looked up.
    block_type = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if isinstance(block_type, str) and block_type in _MODELLED_BLOCK_TYPES:
        return block_type
    return "other"


def _text_or_blocks(value: Any) -> str:
    return "text" if isinstance(value, str) else "blocks"


ToolResultContentBlock = Annotated[
    Annotated[TextBlockParam, Tag("text")]
    | Annotated[ImageBlockParam, Tag("image")]
    | Annotated[DocumentBlockParam, Tag("document")]
    | Annotated[OtherBlockParam, Tag("other")],
    Discriminator(_block_tag),
]


class ToolResultBlockParam(_WireRequestModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Annotated[
        Annotated[str, Tag("text")] | Annotated[list[ToolResultContentBlock], Tag("blocks")],
        Discriminator(_text_or_blocks),
    ] = ""
    is_error: bool = False


ContentBlockParam = Annotated[
    Annotated[TextBlockParam, Tag("text")]
    | Annotated[ImageBlockParam, Tag("image")]
    | Annotated[DocumentBlockParam, Tag("document")]
    | Annotated[ThinkingBlockParam, Tag("thinking")]
    | Annotated[RedactedThinkingBlockParam, Tag("redacted_thinking")]
    | Annotated[ToolUseBlockParam, Tag("tool_use")]
    | Annotated[ToolResultBlockParam, Tag("tool_result")]
    | Annotated[OtherBlockParam, Tag("other")],
    Discriminator(_block_tag),
]

# Tagged so that a schema error names `messages[0].content.blocks[1]...`, not the union.
MessageContent = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentBlockParam], Tag("blocks")],
    Discriminator(_text_or_blocks),
]


class InputMessage(_WireRequestModel):
    # "system": Claude Code's `mid-conversation-system-2026-04-07` beta. Any other role is
    # refused by the adapter with Anthropic's wording ("Unexpected role ..."), which Claude
    # Code parses.
    role: str = Field(json_schema_extra={"enum": ["user", "assistant", "system"]})
    content: MessageContent


# ---------------------------------------------------------------- request: tools, thinking


class ToolParam(_WireRequestModel):
    """A tool. Custom (client) tools have no `type` or `type: "custom"` and an
    `input_schema`; server tools (`web_search_20250305`, `bash_20250124`, ...) have a
    versioned `type` and are refused by the adapter."""

    name: str = Field(min_length=1, max_length=128)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoiceAuto(_WireRequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_WireRequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_WireRequestModel):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_WireRequestModel):
    type: Literal["none"]


ToolChoiceParam = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


class ThinkingEnabled(_WireRequestModel):
    """`budget_tokens` is accepted and not enforced: the engine has no thinking budget."""

    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingDisabled(_WireRequestModel):
    type: Literal["disabled"]


class ThinkingAdaptive(_WireRequestModel):
    type: Literal["adaptive"]


class ThinkingBetweenTools(_WireRequestModel):
    type: Literal["between_tools"]


ThinkingParam = Annotated[
    ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive | ThinkingBetweenTools,
    Field(discriminator="type"),
]

Effort = Literal["low", "medium", "high", "xhigh", "max"]


class JsonOutputFormat(_WireRequestModel):
    """`output_config.format` (structured outputs): the answer is one JSON value that
    follows `schema`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_WireRequestModel):
    """anthropic 2.x's replacement for the sampling arguments: `effort` reaches the chat
    template as a reasoning effort, `format` constrains the answer to a JSON schema."""

    effort: Effort | None = None
    format: JsonOutputFormat | None = None


# ---------------------------------------------------------------- requests


class CountTokensRequest(_WireRequestModel):
    """The body of `POST /v1/messages/count_tokens`: the prompt part of a Messages request."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: (
        Annotated[
            Annotated[str, Tag("text")] | Annotated[list[TextBlockParam], Tag("blocks")],
            Discriminator(_text_or_blocks),
        ]
        | None
    ) = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    """The body of `POST /v1/messages`. Ranges are Anthropic's (temperature 0..1)."""

    max_tokens: int = Field(ge=1, strict=True)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    # exo's extension: speculative decoding on (true), off (false) or as measured ("auto").
    speculative: Speculative | None = None


# ---------------------------------------------------------------- response

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextBlock(_WireResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(_WireResponseModel):
    """`signature` is always "": exo does not sign thinking (Anthropic uses it to verify
    replayed thinking; we accept any value back)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseBlock(_WireResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


class OutputTokensDetails(_WireResponseModel):
    thinking_tokens: int = Field(ge=0)


class MessageUsage(_WireResponseModel):
    """Token counts, split as Anthropic splits them: `input_tokens` are the prompt tokens
    prefilled for this request, `cache_read_input_tokens` those whose KV the runner reused
    from its prefix cache (the prompt is their sum). exo's prefix cache fills itself (there
    is no `cache_control` to pay for), so `cache_creation_input_tokens` is always 0."""

    input_tokens: int = Field(ge=0)
    output_tokens: int = Field(ge=0)
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails = OutputTokensDetails(thinking_tokens=0)


class Message(_WireResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage


class CountTokensResponse(_WireResponseModel):
    input_tokens: int = Field(ge=0)


# ---------------------------------------------------------------- stream events


class TextDelta(_WireResponseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(_WireResponseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(_WireResponseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


ContentDelta = Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class MessageStartEvent(_WireResponseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(_WireResponseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int = Field(ge=0)
    content_block: ContentBlock


class ContentBlockDeltaEvent(_WireResponseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int = Field(ge=0)
    delta: ContentDelta


class ContentBlockStopEvent(_WireResponseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int = Field(ge=0)


class MessageDelta(_WireResponseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class MessageDeltaEvent(_WireResponseModel):
    """`usage` holds cumulative totals; the SDK overwrites its snapshot with them, so the
    input token count (already in `message_start`) is repeated here."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageUsage


class MessageStopEvent(_WireResponseModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorDetail(_WireResponseModel):
    type: str
    message: str


class ErrorResponse(_WireResponseModel):
    """Anthropic's error body, both as an HTTP body and as the data of an `error` event."""

    type: Literal["error"] = "error"
    error: ErrorDetail


StreamEvent = Annotated[
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | ErrorResponse,
    Field(discriminator="type"),
]
