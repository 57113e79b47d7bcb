"""Wire models of the OpenAI Chat Completions API (`POST /v1/chat/completions`, `GET
/v1/models`).

Request models validate types and ranges only (a failure there is a schema error); what
the request *means* — unsupported features, conflicting fields — is checked by
`exo.api.openai_chat.request.to_task_params`, which answers with a 400.

Unknown request fields are ignored rather than refused. OpenAI's own server answers 400
for an unknown parameter, but clients written for other OpenAI-compatible servers send
extras (`repetition_penalty`, `chat_template_kwargs`, ...) and breaking them over a knob we
would not honour anyway helps nobody. Known fields whose *value* we cannot honour (`n > 1`,
image input to a model without vision) are refused, never silently dropped; the few
accepted and ignored ones are listed in the README ("Accepted and ignored").
Extensions other OpenAI-compatible servers define and we honour: `top_k`, `min_p`,
`repetition_penalty` and `chat_template_kwargs.enable_thinking` (vLLM); exo's own:
`speculative` (true / false / "auto": speculative decoding, as in every dialect).

Request models are lax (JSON `1` is a valid temperature) because they face arbitrary HTTP
clients; response models are what we emit and stay exact.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from exo.api.wire.request_model import Speculative, VllmTopK, WireRequestModel

# The OpenAI API allows at most 4 stop sequences; llama.cpp and vLLM accept more, and so
# do we, up to a bound that keeps stop-string matching cheap.
MAX_STOP_SEQUENCES = 16
# OpenAI's most choices per request (`n`); a larger `n` gets OpenAI's own schema 400.
MAX_CHOICES = 128


class _WireRequestModel(WireRequestModel):
    """Unknown fields are ignored and logged at debug level (`exo.api.wire.request_model`)."""


class _WireResponseModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------- request: content parts


class TextContentPart(_WireRequestModel):
    type: Literal["text"]
    text: str


class ImageUrl(_WireRequestModel):
    url: str
    detail: str | None = None


class ImageContentPart(_WireRequestModel):
    """An image (`image_url.url`: a data: or http(s) URL), read for a model with vision
    (`exo.api.wire.images`); refused with a clear 400 for any other model."""

    type: Literal["image_url"]
    image_url: ImageUrl


class AudioContentPart(_WireRequestModel):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class FileContentPart(_WireRequestModel):
    type: Literal["file"]
    file: dict[str, Any]


class RefusalContentPart(_WireRequestModel):
    """An earlier assistant refusal replayed in the conversation history."""

    type: Literal["refusal"]
    refusal: str


UserContentPart = Annotated[
    TextContentPart | ImageContentPart | AudioContentPart | FileContentPart,
    Field(discriminator="type"),
]
AssistantContentPart = Annotated[TextContentPart | RefusalContentPart, Field(discriminator="type")]


# ---------------------------------------------------------------- request: messages
# `content` is required (and not null) in every message but the assistant's, which may
# carry only `tool_calls` (or the deprecated `function_call`), as OpenAI defines them:
# OpenAI answers a message without it with 400 "Missing required parameter".


class SystemMessage(_WireRequestModel):
    role: Literal["system"]
    content: str | list[TextContentPart]
    name: str | None = None


class DeveloperMessage(_WireRequestModel):
    """OpenAI's newer name for a system message (o1 and later models)."""

    role: Literal["developer"]
    content: str | list[TextContentPart]
    name: str | None = None


class UserMessage(_WireRequestModel):
    role: Literal["user"]
    content: str | list[UserContentPart]
    name: str | None = None


class FunctionCallParam(_WireRequestModel):
    name: str = Field(min_length=1)
    # JSON text, as the model produced it.
    arguments: str = "{}"


class ToolCallParam(_WireRequestModel):
    """A call an assistant turn made, replayed in the history."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallParam


class AssistantMessage(_WireRequestModel):
    role: Literal["assistant"]
    content: str | list[AssistantContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    # Deprecated single-call form of `tool_calls`.
    function_call: FunctionCallParam | None = None
    # The turn's thinking, as vLLM and DeepSeek return it (passed to templates that use it).
    reasoning_content: str | None = None


class ToolMessage(_WireRequestModel):
    role: Literal["tool"]
    content: str | list[TextContentPart]
    tool_call_id: str


class FunctionMessage(_WireRequestModel):
    """Deprecated: a function's result, tied to its call by name."""

    role: Literal["function"]
    content: str | None = None
    name: str = Field(min_length=1)


RequestMessage = Annotated[
    SystemMessage
    | DeveloperMessage
    | UserMessage
    | AssistantMessage
    | ToolMessage
    | FunctionMessage,
    Field(discriminator="role"),
]


# ---------------------------------------------------------------- request


class FunctionDefinition(_WireRequestModel):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_WireRequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_WireRequestModel):
    name: str = Field(min_length=1)


class NamedToolChoiceParam(_WireRequestModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_WireRequestModel):
    include_usage: bool | None = None


class JsonSchemaSpec(_WireRequestModel):
    """`response_format.json_schema`. `schema` absent means any JSON object. `strict` is
    accepted and changes nothing: decoding always follows the schema as far as exo's
    JSON-schema constraint goes (README, "Sampling")."""

    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_WireRequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class OpenAIGenerationRequest(_WireRequestModel):
    """The fields the two OpenAI generation requests (Chat Completions and legacy
    Completions) share, with the same names, ranges and meaning: the model, the sampling
    settings (`exo.api.wire.sampling.openai_sampling_fields` maps them), streaming, the
    number of choices (only 1 is served) and `user` (accepted, no effect). The
    subclasses' docstrings are their OpenAPI descriptions; this one is not published.
    """

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: VllmTopK | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # torch generators take seeds in [-2**63, 2**64): wider than OpenAI's signed 64 bits.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's range; only 1 is served, and 2..128 is refused saying so (`to_task_params`).
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's CTRL repetition penalty.
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    # Token id (as a JSON object key) -> bias in [-100, 100], added to the token's logit.
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # exo's extension: speculative decoding on (true), off (false) or as measured ("auto").
    speculative: Speculative | None = None


class ChatCompletionRequest(OpenAIGenerationRequest):
    """The body of `POST /v1/chat/completions`.

    `top_k` and `min_p` are not OpenAI parameters; vLLM and llama.cpp accept them and so do
    we (`top_k = -1` is vLLM's "disabled" and is accepted as such). Fields marked
    "compatibility no-ops" are accepted and have no effect (README, "Accepted and ignored").
    """

    # The fields it shares with legacy Completions are `OpenAIGenerationRequest`'s.
    messages: list[RequestMessage] = Field(min_length=1)

    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)

    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    # Deprecated forms of `tools` and `tool_choice`.
    functions: list[FunctionDefinition] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # vLLM's extension: keyword arguments for the template.
    chat_template_kwargs: dict[str, Any] | None = None
    # "none" turns thinking off; the others are passed to the template.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    # Compatibility no-ops (README, "Accepted and ignored").
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


# ---------------------------------------------------------------- responses


ChatFinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class CompletionTokensDetails(_WireResponseModel):
    reasoning_tokens: int = Field(default=0, ge=0)


class PromptTokensDetails(_WireResponseModel):
    """`cached_tokens`: prompt tokens whose KV the runner reused from its prefix cache
    instead of prefilling them (part of `prompt_tokens`)."""

    cached_tokens: int = Field(default=0, ge=0)


class CompletionUsage(_WireResponseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprobEntry(_WireResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobEntry(_WireResponseModel):
    """One sampled token with its log probability and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(_WireResponseModel):
    content: list[LogprobEntry] | None = None
    refusal: list[LogprobEntry] | None = None


class ResponseFunctionCall(_WireResponseModel):
    name: str
    arguments: str


class ResponseToolCall(_WireResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(_WireResponseModel):
    """The answer. `tool_calls` and `reasoning_content` (vLLM's name for the thinking) are
    left out of the JSON when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("tool_calls", "reasoning_content"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class Choice(_WireResponseModel):
    index: int = Field(ge=0)
    message: ResponseMessage
    finish_reason: ChatFinishReason
    logprobs: ChoiceLogprobs | None = None


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class CompletionObject(_WireResponseModel, Generic[ChoiceT]):
    """What OpenAI's completion objects share, answers and streamed chunks of Chat
    Completions and of legacy Completions alike: the id, the `object` kind (each subclass
    narrows it to its literal), the creation time, the model, the choices and the usage."""

    id: str
    object: str
    created: int = Field(description="Unix time, seconds.")
    model: str
    choices: list[ChoiceT]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class ChatCompletionResponse(CompletionObject[Choice]):
    """The non-streaming answer."""

    object: Literal["chat.completion"] = "chat.completion"


class DeltaFunctionCall(_WireResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WireResponseModel):
    """A streamed tool call: `index` says which call it extends. exo sends each call whole,
    in one delta with its id, type, name and full arguments."""

    index: int = Field(ge=0)
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChunkDelta(_WireResponseModel):
    """What a streamed chunk adds to the message. Unset fields are left out of the JSON
    (OpenAI sends `{"content": "Hi"}`, and `{}` with the finish), not sent as null."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(_WireResponseModel):
    index: int = Field(ge=0)
    delta: ChunkDelta
    finish_reason: ChatFinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(CompletionObject[ChunkChoice]):
    """One SSE event of a streamed answer. With `stream_options.include_usage`, every chunk
    carries `usage: null` except one last chunk with no choices and the usage set; without
    it the `usage` key is left out (serialisation is up to the adapter)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class ModelObject(_WireResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time, seconds.")
    owned_by: str
    capabilities: list[str] | None = Field(
        default=None,
        description='exo\'s extension: what the model does ("text", "embedding", "rerank", ...)',
    )


class ModelList(_WireResponseModel):
    """The body of `GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelObject]


class ErrorDetail(_WireResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_WireResponseModel):
    """OpenAI's error body, for HTTP errors and for the in-stream error event."""

    error: ErrorDetail
