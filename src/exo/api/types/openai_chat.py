"""Wire models of the OpenAI Chat Completions API (`POST /v1/chat/completions`, `GET
/v1/models`).

Request models validate types and ranges only (a failure there is a schema error); what
the request *means* — unsupported features, conflicting fields — is checked by
`exo.api.adapters.chat_completions.to_task_params`, which answers with a 400.

Unknown request fields are ignored rather than refused. OpenAI's own server answers 400
for an unknown parameter, but clients written for other OpenAI-compatible servers send
extras (`repetition_penalty`, `chat_template_kwargs`, ...) and breaking them over a knob we
would not honour anyway helps nobody. Known fields whose *value* we cannot honour (`tools`,
`logprobs: true`, JSON response formats, `n > 1`) are refused, never silently dropped.

Request models are lax (JSON `1` is a valid temperature) because they face arbitrary HTTP
clients; response models are what we emit and stay exact.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

# The OpenAI API allows at most 4 stop sequences; llama.cpp and vLLM accept more, and so
# do we, up to a bound that keeps stop-string matching cheap.
MAX_STOP_SEQUENCES = 16


class _WireRequestModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


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
    """Accepted by the schema so the adapter can refuse it with a clear 400 instead of a
    generic schema error."""

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


class SystemMessage(_WireRequestModel):
    role: Literal["system"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class DeveloperMessage(_WireRequestModel):
    """OpenAI's newer name for a system message (o1 and later models)."""

    role: Literal["developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class UserMessage(_WireRequestModel):
    role: Literal["user"]
    content: str | list[UserContentPart] | None = None
    name: str | None = None


class AssistantMessage(_WireRequestModel):
    role: Literal["assistant"]
    content: str | list[AssistantContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    # Replayed tool calls only make sense together with `tools`, which is not supported
    # yet; kept in the schema so the adapter can say so.
    tool_calls: list[dict[str, Any]] | None = None


class ToolMessage(_WireRequestModel):
    role: Literal["tool"]
    content: str | list[TextContentPart] | None = None
    tool_call_id: str


RequestMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage,
    Field(discriminator="role"),
]


# ---------------------------------------------------------------- request


class StreamOptions(_WireRequestModel):
    include_usage: bool | None = None


class ResponseFormat(_WireRequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_WireRequestModel):
    """The body of `POST /v1/chat/completions`.

    `top_k` and `min_p` are not OpenAI parameters; vLLM and llama.cpp accept them and so do
    we (`top_k = -1` is vLLM's "disabled" and is accepted as such). Fields marked "ignored"
    are accepted for compatibility and have no effect.
    """

    model: str = Field(min_length=1)
    messages: list[RequestMessage] = Field(min_length=1)

    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # torch generators take seeds in [-2**63, 2**64).
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = None

    # Refused by the adapter when they ask for something (not supported yet).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    response_format: ResponseFormat | None = None

    # Ignored.
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None


# ---------------------------------------------------------------- responses


ChatFinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class CompletionUsage(_WireResponseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)


class ResponseMessage(_WireResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None


class Choice(_WireResponseModel):
    index: int = Field(ge=0)
    message: ResponseMessage
    finish_reason: ChatFinishReason
    logprobs: None = None


class ChatCompletionResponse(_WireResponseModel):
    """The non-streaming answer."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(description="Unix time, seconds.")
    model: str
    choices: list[Choice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class ChunkDelta(_WireResponseModel):
    """What a streamed chunk adds to the message. Unset fields are left out of the JSON
    (OpenAI sends `{"content": "Hi"}`, and `{}` with the finish), not sent as null."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(_WireResponseModel):
    index: int = Field(ge=0)
    delta: ChunkDelta
    finish_reason: ChatFinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(_WireResponseModel):
    """One SSE event of a streamed answer. With `stream_options.include_usage`, every chunk
    carries `usage: null` except one last chunk with no choices and the usage set; without
    it the `usage` key is left out (serialisation is up to the adapter)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(description="Unix time, seconds.")
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    system_fingerprint: str | None = None


class ModelObject(_WireResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(description="Unix time, seconds.")
    owned_by: str


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
