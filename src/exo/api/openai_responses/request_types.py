"""Request wire models of the OpenAI Responses API (`POST /v1/responses`); the response
object and stream events are in `response_types`.

Request models validate types and ranges only (a failure there is a schema error, 400);
what the request *means* — hosted tools, image input, stored state — is checked by
`exo.api.openai_responses.request.to_task_params`, which answers with a 400.

Item and content-part unions fall back to an `Unsupported…` member for any `type` we do
not handle (hosted tool calls, `input_file`, `web_search` tools, ...), so that the adapter
can refuse them with a 400 that names the type instead of a schema error. Unknown request
fields are ignored, as in the Chat Completions models; the declared fields that change
nothing (`store`, `metadata`, `truncation`, `user`, `prompt_cache_key`, `service_tier`,
`text.verbosity`, ...) are the README's compatibility no-ops: the official SDK and Codex
CLI send them on every request. Request models are lax: they face arbitrary HTTP clients.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from exo.api.wire.request_model import Speculative, VllmTopK, WireRequestModel

# OpenAI caps top_logprobs at 20.
MAX_TOP_LOGPROBS = 20


class _WireRequestModel(WireRequestModel):
    """Unknown fields are ignored and logged at debug level (`exo.api.wire.request_model`)."""


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
    """An image (`image_url`: a data: or http(s) URL), read for a model with vision; a
    `file_id` and any image for a model without vision are refused with a clear 400."""

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
    namespace: str | None = None
    """The `namespace` tool the function belongs to (Codex groups MCP tools so)."""


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


class NamespaceToolSpec(_WireRequestModel):
    """Function tools grouped under a name (Codex's MCP servers): client-run functions like
    any other, offered to the model under unique names (`namespaced_tool_name`)."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    tools: list[FunctionToolSpec]


class UnsupportedTool(_WireRequestModel):
    """A hosted tool (`web_search`, `file_search`, `mcp`, ...): the node runs none, so it is
    not offered to the model (listed in the `X-Exo-Tools-Not-Offered` response header)."""

    model_config = ConfigDict(frozen=True, extra="allow")
    type: str


ToolSpec = Annotated[
    Annotated[FunctionToolSpec, Tag("function")]
    | Annotated[NamespaceToolSpec, Tag("namespace")]
    | Annotated[UnsupportedTool, Tag("unsupported")],
    _type_or("unsupported", frozenset({"function", "namespace"})),
]


class FunctionToolChoice(_WireRequestModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    namespace: str | None = None


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

    # OpenAI's minimum: below 16 is a 400 "integer below minimum value".
    max_output_tokens: int | None = Field(default=None, ge=16, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # Not an OpenAI parameter: vLLM's extension, as on Chat Completions.
    top_k: VllmTopK | None = None
    # exo's extension: speculative decoding on (true), off (false) or as measured ("auto").
    speculative: Speculative | None = None
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
