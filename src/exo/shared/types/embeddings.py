"""The internal request type of embeddings and rerank, which every dialect's route
(`/v1/embeddings`, Ollama's `/api/embed` and `/api/embeddings`, `/v1/rerank`) converts into.

One request is answered in one chunk (`EmbeddingChunk`), never streamed. The runner
tokenizes text inputs with the model's own special tokens (Qwen3-Embedding's appended
`<|endoftext|>`); token-id inputs go to the model as they are.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exo.shared.types.common import FrozenModel, ModelId

EmbeddingInput = str | tuple[int, ...]
"""One input: text, or token ids (OpenAI's token-array input)."""


class EmbeddingTaskParams(FrozenModel):
    """An embedding or rerank request, dialect-independent.

    `kind="embed"`: one vector per entry of `inputs` (text or token ids), L2-normalized,
    cut to `dimensions` first where the model is Matryoshka-trained. `kind="rerank"`:
    `inputs` are the documents (text), scored against `query` (the model's relevance,
    0..1 for Qwen3-Reranker's yes/no softmax, under its default instruction).

    `truncate`: inputs longer than the model's context are cut to it (keeping the start);
    False: such an input fails the request with a 400 naming it.

    Raises:
        pydantic.ValidationError: no inputs, an empty token array, a rerank without a
            query or with token-id documents.
    """

    kind: Literal["embed", "rerank"] = "embed"
    model: ModelId
    inputs: tuple[EmbeddingInput, ...] = Field(min_length=1)
    truncate: bool = False
    dimensions: int | None = Field(default=None, gt=0)
    query: str | None = None

    @model_validator(mode="after")
    def _check(self) -> EmbeddingTaskParams:
        if any(isinstance(item, tuple) and not item for item in self.inputs):
            raise ValueError("a token-id input must hold at least one token")
        if self.kind == "rerank":
            if self.query is None:
                raise ValueError("a rerank request needs a query")
            if not all(isinstance(item, str) for item in self.inputs):
                raise ValueError("rerank documents are text")
        return self
