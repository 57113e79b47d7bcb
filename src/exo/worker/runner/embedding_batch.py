"""Answer the embedding and rerank tasks that reached a runner together, as one batch.

Every "embed" task's inputs (tokenized through the backend; token-id inputs as they are)
go to `EmbeddingBackend.embed` in one call, so concurrent requests share forward passes;
each vector is then cut to its request's `dimensions` (Matryoshka) and L2-normalized.
"rerank" tasks are scored with `score_pairs`. A task at fault (an input over the context
without `truncate`, a `dimensions` the model cannot cut to, rerank on a model that is no
reranker) fails alone with a 400 naming the field; a failed forward fails the batch (500).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from loguru import logger

from exo.shared.types.chunks import Chunk, EmbeddingChunk, ErrorChunk
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.tasks import Embedding
from exo.worker.engines.torch.embedding.backend import EmbeddingBackend

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The error code of an input over the context (`exo.api.wire.errors`: each dialect words it
as its reference API does)."""


class EmbeddingRequestError(ValueError):
    """The request itself is at fault (a 400 naming `field`; `code` overrides the chunk's
    `invalid_<field>` error code)."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code or f"invalid_{field}"


def answer_embeddings(backend: EmbeddingBackend, tasks: Sequence[Embedding]) -> list[Chunk]:
    """One final chunk per task, in order: an `EmbeddingChunk`, or an `ErrorChunk` (400
    with `error_code` naming the field at fault, or 500 when the forward pass failed)."""
    answers: list[Chunk | None] = [None] * len(tasks)
    batch: list[list[int]] = []
    spans: dict[int, tuple[int, int]] = {}  # task index -> its rows of `batch`
    for index, task in enumerate(tasks):
        try:
            if task.params.kind == "rerank":
                answers[index] = _rerank(backend, task)
                continue
            rows = _embedding_rows(backend, task.params)
        except EmbeddingRequestError as error:
            answers[index] = _error(task, str(error), 400, error.code)
            continue
        except Exception as error:
            logger.opt(exception=error).warning("rerank failed")
            answers[index] = _error(task, f"rerank failed: {error}", 500)
            continue
        spans[index] = (len(batch), len(batch) + len(rows))
        batch.extend(rows)
    if spans:
        try:
            vectors = backend.embed(batch) if batch else torch.empty(0, backend.dimensions)
        except Exception as error:
            logger.opt(exception=error).warning("embedding forward failed")
            for index in spans:
                answers[index] = _error(tasks[index], f"embedding failed: {error}", 500)
        else:
            for index, (start, end) in spans.items():
                params = tasks[index].params
                pooled = vectors[start:end, : params.dimensions or backend.dimensions]
                normalized = torch.nn.functional.normalize(pooled.float(), dim=-1)
                answers[index] = EmbeddingChunk(
                    command_id=tasks[index].command_id,
                    model=params.model,
                    vectors=tuple(tuple(row) for row in normalized.tolist()),
                    prompt_tokens=sum(len(row) for row in batch[start:end]),
                )
    assert all(answer is not None for answer in answers)
    return [answer for answer in answers if answer is not None]


def check_dimensions(backend: EmbeddingBackend, dimensions: int | None) -> None:
    """Raises EmbeddingRequestError unless `dimensions` is None, the full width, or (for a
    Matryoshka model) between its smallest trained width and the full one."""
    if dimensions is None or dimensions == backend.dimensions:
        return
    allowed = backend.matryoshka_dimensions
    if not allowed:
        raise EmbeddingRequestError(
            f"this model does not support dimensions other than {backend.dimensions}",
            "dimensions",
        )
    if not min(allowed) <= dimensions <= backend.dimensions:
        raise EmbeddingRequestError(
            f"dimensions must be between {min(allowed)} and {backend.dimensions}", "dimensions"
        )


def _embedding_rows(backend: EmbeddingBackend, params: EmbeddingTaskParams) -> list[list[int]]:
    """The token ids of each input, cut to the context when `truncate`."""
    check_dimensions(backend, params.dimensions)
    texts = [item for item in params.inputs if isinstance(item, str)]
    tokenized = iter(backend.tokenize(texts) if texts else [])
    rows: list[list[int]] = []
    limit = backend.max_input_tokens
    for position, item in enumerate(params.inputs):
        ids = next(tokenized) if isinstance(item, str) else list(item)
        if not ids:
            raise EmbeddingRequestError(f"input[{position}] has no tokens", "input")
        if len(ids) > limit:
            if not params.truncate:
                raise EmbeddingRequestError(
                    f"input[{position}]: the prompt is {len(ids)} tokens; the model's context "
                    f"is {limit} tokens (ask for truncation to cut it)",
                    "input",
                    CONTEXT_LENGTH_EXCEEDED,
                )
            ids = ids[:limit]
        rows.append(ids)
    return rows


def _rerank(backend: EmbeddingBackend, task: Embedding) -> Chunk:
    params = task.params
    query = params.query or ""
    documents = [item for item in params.inputs if isinstance(item, str)]
    scores = backend.score_pairs([(query, document) for document in documents])
    if scores is None:
        raise EmbeddingRequestError(f"{params.model} is not a reranker", "model")
    counted = backend.tokenize([query, *documents])
    tokens = sum(len(row) for row in counted[1:]) + len(counted[0]) * len(documents)
    return EmbeddingChunk(
        command_id=task.command_id,
        model=params.model,
        scores=tuple(float(score) for score in scores.tolist()),
        prompt_tokens=tokens,
    )


def _error(task: Embedding, message: str, status_code: int, code: str | None = None) -> Chunk:
    return ErrorChunk(
        command_id=task.command_id,
        model=task.params.model,
        error_message=message,
        status_code=status_code,
        error_code=code,
    )
