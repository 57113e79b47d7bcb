"""Request and response bodies of the embeddings and rerank routes, as the reference APIs
define them (OpenAI's embeddings, Ollama's embed and legacy embeddings, Jina's and Cohere's
rerank)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
)
from pydantic_core import PydanticCustomError

from exo.api.wire.request_model import WireRequestModel


class _WireResponseModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---------------------------------------------------------------- OpenAI


class EmbeddingRequest(WireRequestModel):
    """The body of `POST /v1/embeddings`. `input`: a string, a list of strings, an array
    of token ids or a list of them. `user` is accepted and unused."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_input_error(
        cls, value: object, handler: ValidatorFunctionWrapHandler
    ) -> str | list[str] | list[int] | list[list[int]]:
        """One error for an `input` of none of the four shapes, worded as OpenAI words
        it, instead of pydantic's error for each branch of the union (a `null`, a float
        or boolean token id, strings mixed with token arrays). Token ids are strict
        integers: `true` or `2.0` is not token 1 or 2."""
        try:
            parsed: str | list[str] | list[int] | list[list[int]] = handler(value)
        except ValidationError:
            raise PydanticCustomError(
                "invalid_input",
                "it must be a string, an array of strings, an array of token ids "
                "(integers) or an array of such arrays",
            ) from None
        return parsed


class EmbeddingObject(_WireResponseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(
        description="floats, or base64 of their little-endian float32 bytes"
    )


class EmbeddingUsage(_WireResponseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_WireResponseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------- Ollama


class OllamaEmbedRequest(WireRequestModel):
    """The body of `POST /api/embed`. `input` absent is an empty input (Ollama's: it only
    loads the model); `truncate` (default true, as Ollama) cuts inputs longer than the
    context; `options` are accepted and unused (no sampling happens)."""

    model: str = Field(min_length=1)
    input: str | list[str] = ""
    truncate: bool = True
    dimensions: int | None = Field(default=None, ge=1)
    keep_alive: str | float | int | None = None
    options: dict[str, Any] | None = None


class OllamaEmbedResponse(_WireResponseModel):
    model: str
    embeddings: list[list[float]]
    total_duration: int = Field(description="Nanoseconds.")
    load_duration: int = Field(description="Nanoseconds.")
    prompt_eval_count: int


class OllamaEmbeddingsRequest(WireRequestModel):
    """The body of the legacy `POST /api/embeddings` (one `prompt`, one vector)."""

    model: str = Field(min_length=1)
    prompt: str
    keep_alive: str | float | int | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsResponse(_WireResponseModel):
    embedding: list[float]


# ---------------------------------------------------------------- rerank


class RerankDocument(WireRequestModel):
    text: str


class RerankRequest(WireRequestModel):
    """The body of `POST /v1/rerank` (Jina's and Cohere's shape). `documents`: strings or
    `{"text": ...}` objects; `top_n`: how many results (all when absent);
    `return_documents`: echo each result's document (default true, as Jina)."""

    model: str = Field(min_length=1)
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class RerankResultDocument(_WireResponseModel):
    text: str


class RerankResult(_WireResponseModel):
    """One scored document; `document` is left out (not null) under `return_documents:
    false`, as Jina and Cohere answer."""

    index: int
    relevance_score: float
    document: RerankResultDocument | None = Field(default=None, exclude_if=lambda v: v is None)


class RerankUsage(_WireResponseModel):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(_WireResponseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
