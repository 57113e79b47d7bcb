"""What every embeddings and rerank route does around its adapter: check the model and
its capability, place it on request, wait for a place, submit a `ComputeEmbeddings`
command and wait for its one chunk.

Which model may answer which request (`check_embedding_request`): embeddings from a card
with the "embedding" capability (its own pooling) or "text" (a chat model, mean-pooled);
rerank only from a card with "rerank". Chat and completions refuse a card without "text"
(`refuse_non_chat_model`). Each is a 400 naming the capability.

A request whose model's every instance is being placed again after a node loss waits for
it as a generation does (`exo.api.serving.replacement_wait`: bounded by
`REPLACEMENT_WAIT_SECONDS`, ended by the client leaving; 503 with `Retry-After` when the
instance waits for room, was deleted or did not serve in time). One whose instance is lost
before it answers (an `INSTANCE_UNAVAILABLE` error chunk: its node left, its runner died)
is sent again under a new command, at most `MAX_RETRIES` times, as a generation lost
before its first chunk is: an embedding changes nothing, so computing it twice is safe.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import ExitStack

import anyio
from fastapi import Request
from loguru import logger

from exo.api.serving.accepted_generation import MAX_RETRIES, RETRY_WAIT_SECONDS
from exo.api.serving.admission import admission_of
from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.failover import is_instance_loss
from exo.api.serving.load_on_request import default_keep_alive, ensure_instance
from exo.api.serving.model_lookup import card_of, known_model_ids
from exo.api.serving.replacement_wait import REPLACEMENT_WAIT_SECONDS, submit_when_served
from exo.api.serving.request_checks import check_serializable
from exo.api.wire.errors import (
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
    NoCapacityError,
)
from exo.shared.types.chunks import Chunk, EmbeddingChunk, ErrorChunk
from exo.shared.types.commands import CancelGeneration, ComputeEmbeddings, KeepAlive
from exo.shared.types.common import CommandId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.models import ModelCard

DISCONNECT_POLL_SECONDS = 0.25


def check_embedding_request(cluster: ClusterClient, params: EmbeddingTaskParams) -> ModelCard:
    """The checks that need no instance: a known model with the capability asked for, a
    `dimensions` it can cut to.

    Raises:
        ModelNotFoundError: an unknown model (404).
        InvalidRequestError: no such capability (param `model`), a `dimensions` other than
            the full width for a model that is not Matryoshka-trained or outside its range
            (param `dimensions`), a token id outside the model's vocabulary (param
            `input`), text that is not valid Unicode (400).
    """
    check_serializable(params)
    card = card_of(cluster, params.model) if params.model in known_model_ids(cluster) else None
    if card is None:
        raise ModelNotFoundError(f"The model '{params.model}' does not exist", param="model")
    if params.kind == "rerank" and "rerank" not in card.capabilities:
        raise InvalidRequestError(
            f'"{params.model}" does not support rerank (it lacks the "rerank" capability)',
            param="model",
        )
    if params.kind == "embed" and not {"embedding", "text"} & set(card.capabilities):
        raise InvalidRequestError(
            f'"{params.model}" does not support embeddings (it lacks the "embedding" capability)',
            param="model",
        )
    for index, item in enumerate(params.inputs):
        if isinstance(item, tuple) and not all(0 <= token < card.vocab_size for token in item):
            raise InvalidRequestError(
                f"input[{index}] holds a token id outside the vocabulary of {params.model} "
                f"(ids 0 to {card.vocab_size - 1})",
                param="input",
            )
    if params.dimensions is not None and params.dimensions != card.hidden_size:
        allowed = card.matryoshka_dimensions
        if not allowed:
            raise InvalidRequestError(
                f"{params.model} does not support dimensions other than {card.hidden_size}",
                param="dimensions",
            )
        if not min(allowed) <= params.dimensions <= card.hidden_size:
            raise InvalidRequestError(
                f"dimensions must be between {min(allowed)} and {card.hidden_size} "
                f"for {params.model}",
                param="dimensions",
            )
    return card


def refuse_non_chat_model(card: ModelCard | None, model: str) -> None:
    """A generation request for a model that only embeds or reranks is a 400.

    Raises:
        InvalidRequestError: the card lacks the "text" capability (param `model`).
    """
    if card is not None and "text" not in card.capabilities:
        offered = ", ".join(card.capabilities)
        raise InvalidRequestError(
            f'"{model}" does not support chat or completions (it lacks the "text" '
            f"capability; it has: {offered})",
            param="model",
        )


async def compute_embeddings(
    cluster: ClusterClient,
    request: Request,
    params: EmbeddingTaskParams,
    keep_alive: KeepAlive | None = None,
) -> EmbeddingChunk:
    """Run `params` on an instance of its model (placed and loaded on request first) and
    return its answer; while every instance of the model is being placed again, wait for
    one (`REPLACEMENT_WAIT_SECONDS`), and send it again when its instance is lost before
    it answers (at most `MAX_RETRIES` times, each waiting at most `RETRY_WAIT_SECONDS`).

    Raises:
        ModelNotFoundError, InvalidRequestError: as `check_embedding_request`; a 400 from
            the runner names its field as `param` (`input` / rerank's `documents`,
            `dimensions`, `model`; an input over the context, code
            `context_length_exceeded`, or a request over the runner's cap on its tokens
            summed, code `max_tokens_per_request`).
        NoCapacityError: the model cannot be placed, or the runner failed (503 / 500); its
            instance waits for room, was deleted or did not serve again in time (503 with
            `Retry-After`).
        GenerationError: the client disconnected first, or the runner failed.
        NoCapacityError: the node began shutting down (`NodeStop.unless_stopping`, 503
            `node_shutting_down`).
    """
    check_embedding_request(cluster, params)
    return await cluster.stop.unless_stopping(
        lambda: _computed(cluster, request, params, keep_alive)
    )


async def _computed(
    cluster: ClusterClient,
    request: Request,
    params: EmbeddingTaskParams,
    keep_alive: KeepAlive | None,
) -> EmbeddingChunk:
    keep_alive = default_keep_alive(cluster, keep_alive)
    await ensure_instance(cluster, request, params.model, keep_alive)
    release = await admission_of(request).admit(lambda: cluster.state, request, params.model)
    try:
        chunk = await _answer(cluster, request, params, keep_alive, REPLACEMENT_WAIT_SECONDS)
        retries = 0
        while chunk is not None and is_instance_loss(chunk) and retries < MAX_RETRIES:
            retries += 1
            logger.info(
                f"api: an embedding request for {params.model} lost its instance before its "
                f"answer; sent again (retry {retries})"
            )
            chunk = await _answer(cluster, request, params, keep_alive, RETRY_WAIT_SECONDS)
    finally:
        release()
    match chunk:
        case EmbeddingChunk():
            return chunk
        case ErrorChunk(status_code=400):
            code = chunk.error_code or ""
            if code.startswith("invalid_"):
                raise InvalidRequestError(chunk.error_message, param=code.removeprefix("invalid_"))
            # An input over the context, a request over the runner's token cap: the inputs.
            inputs = "documents" if params.kind == "rerank" else "input"
            raise InvalidRequestError(chunk.error_message, param=inputs, code=code or None)
        case ErrorChunk(status_code=503):
            raise NoCapacityError(chunk.error_message)  # also a loss after every retry
        case ErrorChunk():
            raise GenerationError(chunk.error_message)
        case _:
            raise GenerationError(f"the embedding of {params.model} ended without an answer")


async def _answer(
    cluster: ClusterClient,
    request: Request,
    params: EmbeddingTaskParams,
    keep_alive: KeepAlive | None,
    wait_seconds: float,
) -> Chunk | None:
    """Send `params` as a `ComputeEmbeddings` command and return its one chunk (None: its
    stream ended without one). While every instance of the model is being placed again, it
    waits for one first, at most `wait_seconds`, and a refusal the master gave for that
    reason is waited out and sent again under a new command
    (`replacement_wait.submit_when_served`). A command that was sent but not answered (the
    client left, the wait failed) is cancelled.

    Raises:
        ModelNotFoundError, InvalidRequestError, NoCapacityError, GenerationError: the
            master's refusal (404 no instance, 413 an input too large, 500 its model failed
            to prepare, else 503: with `Retry-After` when every instance of the model is
            unavailable), the wait's end (`submit_when_served`), or the client leaving.
    """
    sent: list[ComputeEmbeddings] = []
    chunks: list[AsyncIterator[Chunk]] = []
    with ExitStack() as streams:

        async def send(attempt: int) -> None:
            streams.close()  # a refused command's stream
            command = ComputeEmbeddings(
                command_id=CommandId.new(), params=params, keep_alive=keep_alive
            )
            chunks[:] = [streams.enter_context(cluster.chunk_stream(command.command_id))]
            sent[:] = [command]
            await _submit(cluster, command)

        answered = False
        try:
            await submit_when_served(
                cluster,
                request,
                params.model,
                send,
                deadline=anyio.current_time() + wait_seconds,
                wait_seconds=wait_seconds,
            )
            chunk = await _first_chunk(request, chunks[0])
            answered = True
        finally:
            if not answered and sent:
                cluster.send_and_forget(
                    CancelGeneration(
                        command_id=CommandId.new(), target_command_id=sent[0].command_id
                    )
                )
    return chunk


async def _submit(cluster: ClusterClient, command: ComputeEmbeddings) -> None:
    """Submit `command`; the master's refusal becomes the ApiError its status names."""
    try:
        await cluster.submit(command)
    except CommandRejectedError as error:
        if error.status_code == 404:
            raise ModelNotFoundError(error.reason, code="no_instance") from None
        if error.status_code == 413:
            raise InvalidRequestError(error.reason, param="input") from None
        if error.status_code == 500:  # its model failed to prepare for good
            raise GenerationError(error.reason) from None
        raise NoCapacityError(error.reason) from None


async def _first_chunk(request: Request, chunks: AsyncIterator[Chunk]) -> Chunk | None:
    """The command's first chunk; GenerationError when the client leaves before it."""
    result: list[Chunk | None] = []
    async with anyio.create_task_group() as task_group:

        async def first() -> None:
            result.append(await anext(chunks, None))
            task_group.cancel_scope.cancel()

        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_SECONDS)
            task_group.cancel_scope.cancel()

        task_group.start_soon(first)
        task_group.start_soon(watch)
    if not result:
        raise GenerationError("the client disconnected; embedding cancelled")
    return result[0]
