"""Embeddings and rerank routes: OpenAI `POST /v1/embeddings` (also `/ollama/v1/embeddings`),
Ollama `POST /api/embed` and the legacy `POST /api/embeddings` (under `/ollama` and the
root, like every Ollama route), and `POST /v1/rerank`, `/rerank`, `/v2/rerank` (Jina's and
Cohere's shape).

Each converts its body into one `EmbeddingTaskParams` and answers from its one chunk
(`exo.api.serving.embedding`). Errors take the path's dialect: OpenAI's envelope with
`param` on `/v1/...` and the rerank paths, `{"error": ...}` under `/ollama/api`.
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import APIRouter, Request

from exo.api.embeddings.wire_types import (
    EmbeddingObject,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankResultDocument,
    RerankUsage,
)
from exo.api.ollama.request import parse_keep_alive
from exo.api.ollama.routes import PREFIX as OLLAMA_PREFIX
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.embedding import check_embedding_request, compute_embeddings
from exo.api.serving.load_on_request import default_keep_alive, ensure_instance
from exo.api.serving.model_lookup import Cluster, resolve_model_id
from exo.api.wire.errors import InvalidRequestError, ModelNotFoundError, context_overflow
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.embeddings import EmbeddingInput, EmbeddingTaskParams

router = APIRouter()

MAX_OPENAI_INPUTS = 2048
"""The most inputs one OpenAI embeddings request may list (OpenAI's limit: "any array must
be 2048 dimensions or less"; it refuses more with a 400 on `input`)."""


def _model_id(cluster: ClusterClient, name: str) -> ModelId:
    """The model `name` means; a 404 in OpenAI's words when unknown."""
    model_id = resolve_model_id(cluster, name)
    if model_id is None:
        raise ModelNotFoundError(f"The model '{name}' does not exist", param="model")
    return model_id


def _ollama_model_id(cluster: ClusterClient, name: str) -> ModelId:
    """The model `name` means; a 404 in Ollama's words when unknown (as `/api/chat`)."""
    model_id = resolve_model_id(cluster, name)
    if model_id is None:
        raise ModelNotFoundError(f"model '{name}' not found")
    return model_id


def _openai_inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[EmbeddingInput]:
    """OpenAI's `input` as a list of inputs.

    Raises:
        InvalidRequestError: empty (no input, an empty string or token array), or more than
            `MAX_OPENAI_INPUTS` inputs (400, `input`).
    """
    inputs: list[EmbeddingInput]
    if isinstance(value, str):
        inputs = [value]
    elif value and all(isinstance(item, int) for item in value):
        inputs = [tuple(item for item in value if isinstance(item, int))]
    else:
        inputs = [
            item if isinstance(item, str) else tuple(item)
            for item in value
            if not isinstance(item, int)
        ]
    if not inputs or any(len(item) == 0 for item in inputs):
        raise InvalidRequestError(
            "'$.input' is invalid: it must be a non-empty string, array of strings or array "
            "of token ids, with no empty entry",
            param="input",
        )
    if len(inputs) > MAX_OPENAI_INPUTS:
        raise InvalidRequestError(
            f"'$.input' is invalid: array length must be {MAX_OPENAI_INPUTS} or less, got "
            f"{len(inputs)}; send the rest in further requests",
            param="input",
        )
    return inputs


def _in_openai_embedding_terms(error: InvalidRequestError) -> InvalidRequestError:
    """An input over the model's context in OpenAI's embeddings sentence ("Invalid 'input':
    maximum context length is 8192 tokens."), followed by which input and its tokens; not
    the chat sentence ("your messages resulted in ...") the OpenAI envelope gives a
    generation's overflow. Other errors pass unchanged."""
    overflow = context_overflow(error.message, error.code)
    if overflow is None:
        return error
    tokens, limit = overflow.prompt_tokens, overflow.limit
    where = error.message.split(":", 1)[0] if error.message.startswith("input[") else "input"
    return InvalidRequestError(
        f"Invalid 'input': maximum context length is {limit} tokens. {where} is {tokens} tokens.",
        error.param,
        error.code,
    )


def _base64_floats(vector: tuple[float, ...]) -> str:
    """OpenAI's base64 encoding: the vector's little-endian float32 bytes."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


@router.post("/v1/embeddings")
@router.post(f"{OLLAMA_PREFIX}/v1/embeddings", include_in_schema=False)
async def create_embeddings(
    body: EmbeddingRequest, request: Request, cluster: Cluster
) -> EmbeddingResponse:
    """OpenAI's embeddings: one L2-normalized vector per input, in order; inputs over the
    model's context are a 400 (OpenAI does not truncate)."""
    model_id = _model_id(cluster, body.model)
    params = EmbeddingTaskParams(
        model=model_id, inputs=tuple(_openai_inputs(body.input)), dimensions=body.dimensions
    )
    try:
        chunk = await compute_embeddings(cluster, request, params)
    except InvalidRequestError as error:
        raise _in_openai_embedding_terms(error) from None
    encode = _base64_floats if body.encoding_format == "base64" else list
    return EmbeddingResponse(
        data=[
            EmbeddingObject(index=index, embedding=encode(vector))
            for index, vector in enumerate(chunk.vectors)
        ],
        model=body.model,
        usage=EmbeddingUsage(prompt_tokens=chunk.prompt_tokens, total_tokens=chunk.prompt_tokens),
    )


@router.post(f"{OLLAMA_PREFIX}/api/embed")
async def ollama_embed(
    body: OllamaEmbedRequest, request: Request, cluster: Cluster
) -> OllamaEmbedResponse:
    """Ollama's embed: `truncate` defaults to true (inputs cut to the context). No input
    (`""`, `[]` or none) only loads the model and answers no embeddings, as Ollama does; a
    list answers one embedding per entry, in order, empty strings included (Ollama embeds
    them too: clients index the answer by input), each embedded as its special tokens
    alone (a model whose tokenizer adds none answers 400 naming the input)."""
    started = time.monotonic_ns()
    model_id = _ollama_model_id(cluster, body.model)
    keep_alive = parse_keep_alive(body.keep_alive)
    inputs = ([body.input] if body.input else []) if isinstance(body.input, str) else body.input
    if not inputs:
        check_embedding_request(cluster, EmbeddingTaskParams(model=model_id, inputs=("x",)))
        await ensure_instance(cluster, request, model_id, default_keep_alive(cluster, keep_alive))
        return OllamaEmbedResponse(
            model=body.model, embeddings=[], total_duration=time.monotonic_ns() - started,
            load_duration=0, prompt_eval_count=0,
        )  # fmt: skip
    params = EmbeddingTaskParams(
        model=model_id, inputs=tuple(inputs), truncate=body.truncate, dimensions=body.dimensions
    )
    chunk = await compute_embeddings(cluster, request, params, keep_alive)
    return OllamaEmbedResponse(
        model=body.model,
        embeddings=[list(vector) for vector in chunk.vectors],
        total_duration=time.monotonic_ns() - started,
        load_duration=0,
        prompt_eval_count=chunk.prompt_tokens,
    )


@router.post(f"{OLLAMA_PREFIX}/api/embeddings")
async def ollama_embeddings(
    body: OllamaEmbeddingsRequest, request: Request, cluster: Cluster
) -> OllamaEmbeddingsResponse:
    """Ollama's legacy embeddings: one `prompt`, one vector (an empty prompt: an empty
    vector, as Ollama answers); inputs over the context are cut, as Ollama does."""
    model_id = _ollama_model_id(cluster, body.model)
    if not body.prompt:
        return OllamaEmbeddingsResponse(embedding=[])
    params = EmbeddingTaskParams(model=model_id, inputs=(body.prompt,), truncate=True)
    chunk = await compute_embeddings(cluster, request, params, parse_keep_alive(body.keep_alive))
    return OllamaEmbeddingsResponse(embedding=list(chunk.vectors[0]))


@router.post("/v1/rerank")
@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def rerank(body: RerankRequest, request: Request, cluster: Cluster) -> RerankResponse:
    """Score each document against the query (a reranker model only); results sorted by
    `relevance_score`, highest first, each with its document's `index`, cut to `top_n`.
    A document too long for the context is cut (Cohere truncates long documents too)."""
    model_id = _model_id(cluster, body.model)
    texts = [item.text if isinstance(item, RerankDocument) else item for item in body.documents]
    if not texts:
        raise InvalidRequestError("documents must hold at least one document", param="documents")
    params = EmbeddingTaskParams(
        kind="rerank", model=model_id, inputs=tuple(texts), query=body.query, truncate=True
    )
    chunk = await compute_embeddings(cluster, request, params)
    order = sorted(range(len(texts)), key=lambda index: -chunk.scores[index])
    results = [
        RerankResult(
            index=index,
            relevance_score=chunk.scores[index],
            document=RerankResultDocument(text=texts[index]) if body.return_documents else None,
        )
        for index in order[: body.top_n]
    ]
    return RerankResponse(
        id=f"rerank-{CommandId.new()}",
        model=body.model,
        results=results,
        usage=RerankUsage(total_tokens=chunk.prompt_tokens, prompt_tokens=chunk.prompt_tokens),
    )
