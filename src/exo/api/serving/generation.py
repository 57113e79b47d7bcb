"""What every dialect's generation route does around its adapter: check the model, submit
the command, wait for the first chunk (streaming), render or collect the chunk stream, and
cancel the generation when the client goes away. The accepted generation and its resending
are `exo.api.serving.accepted_generation`; the streamed or collected answer
`exo.api.serving.generation_response`.

A dialect route then converts its body with `convert_request` (the model's short name
resolved, the internal params, the response id naming the command) and answers
`ConvertedRequest.serve(...)` with the adapter's renderer and collector.

A generation whose instance becomes unavailable (it lost a node or a rank) before the
client received anything — a stream before its first chunk, any non-streamed answer — is
sent again under a new command: the master routes it to another healthy instance, or,
when the model has none, it waits until the lost instance serves again (placed anew on
the remaining nodes) for at most `accepted_generation.RETRY_WAIT_SECONDS`. A stream that
loses its instance after it began continues on another one in the same response
(`exo.api.serving.failover`). A new request for a model whose every instance is being
placed again waits for it the same way before it is sent (`Generation.submit`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import Response

from exo.api.serving.accepted_generation import Generation
from exo.api.serving.admission import admission_of
from exo.api.serving.catch_up import catch_up_for
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.early_stream import ChunkRenderer, EarlyStreamingResponse, WaitingFrames
from exo.api.serving.embedding import refuse_non_chat_model
from exo.api.serving.failover import with_failover
from exo.api.serving.generation_response import cancel_on_disconnect, collect, streaming_response
from exo.api.serving.image_input import convert_with_images
from exo.api.serving.load_on_request import default_keep_alive, ensure_instance
from exo.api.serving.metrics import observed_chunks
from exo.api.serving.model_lookup import RequestBody, card_of, known_model_ids, with_resolved_model
from exo.api.serving.prompt_size import check_prompt_size
from exo.api.serving.request_checks import check_chat_template, check_logit_bias, check_serializable
from exo.api.serving.response_ids import response_id
from exo.api.serving.token_limit import note_capped_max_tokens
from exo.api.wire.errors import (
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
)
from exo.api.wire.images import ImageReader
from exo.shared.constants import INSTANCE_HEADER
from exo.shared.types.chunks import Chunk, ErrorChunk
from exo.shared.types.commands import GenerateText, KeepAlive
from exo.shared.types.common import CommandId, InstanceId
from exo.shared.types.text_generation import TextGenerationTaskParams

T = TypeVar("T")


async def start_generation(
    cluster: ClusterClient,
    request: Request,
    params: TextGenerationTaskParams,
    *,
    command_id: CommandId | None = None,
    wait_for_first_chunk: bool | None = None,
    keep_alive: KeepAlive | None = None,
) -> Generation:
    """Submit `params` as a `GenerateText` command.

    A model with no instance is first placed and loaded (`exo.api.serving.load_on_request`), and
    nothing is answered until it is ready; one whose every instance is being placed again
    after a node loss is waited for (`accepted_generation.Generation.submit`). While every
    instance of the model is running and queueing all it may for this node, the request
    waits for a place (`exo.api.serving.admission`).
    `keep_alive` (Ollama's; default this node's `--idle-unload`) becomes the instance's
    keep-alive. A request with the `INSTANCE_HEADER` header runs on that instance only: it
    places nothing and is not sent again elsewhere when the instance is lost.

    With `wait_for_first_chunk` (default: True) the first chunk is awaited before
    returning, so that a request the engine refuses (prompt longer than the context) is a
    plain HTTP error and not an error inside an already-started 200 stream, and a
    `max_tokens` over the room the prompt leaves is said in the answer's head
    (`exo.api.serving.token_limit`).

    Raises:
        ModelNotFoundError: the model is unknown, or it has no instance and cannot be
            placed on request (auto-placement off, files not downloaded) (404).
        InvalidRequestError: a conversation for a base model (no chat template) (400).
        NoCapacityError: the master rejected the command, the model could not be
            loaded on request (no room, preparation failed, too slow), or its instance
            being placed again did not serve within the wait (503).
        ModelNotFoundError: the `INSTANCE_HEADER` names no instance (404).
        InvalidRequestError: the `INSTANCE_HEADER` names an instance of another model (400).
        QueueFullError: every instance stayed full for the admission wait (503 with
            `Retry-After`).
        InvalidRequestError: the request holds text that is not valid Unicode, values
            nested too deeply or a `logit_bias` for a token outside the model's vocabulary,
            is too large for the model's context (`exo.api.serving.prompt_size`, checked before
            anything is placed or sent), or the engine refused it (400).
        GenerationError: the client disconnected before the first chunk (or while the
            model was loading or being placed again).
        NoCapacityError: the node began shutting down before the first chunk (503
            `node_shutting_down`, `exo.api.serving.node_stop`).
    """
    check_generation_request(cluster, params)
    return await _start_checked_generation(
        cluster,
        request,
        params,
        command_id=command_id,
        wait_for_first_chunk=wait_for_first_chunk,
        keep_alive=keep_alive,
    )


def check_generation_request(cluster: ClusterClient, params: TextGenerationTaskParams) -> None:
    """The checks of a generation request that need no model instance (`start_generation`'s
    400s and 404s before anything is placed or sent)."""
    check_serializable(params)
    if params.model not in known_model_ids(cluster):
        raise ModelNotFoundError(f"The model '{params.model}' does not exist")
    refuse_non_chat_model(card_of(cluster, params.model), params.model)
    check_chat_template(params, card_of(cluster, params.model))
    check_logit_bias(params, card_of(cluster, params.model))
    check_prompt_size(params, card_of(cluster, params.model))


async def _start_checked_generation(
    cluster: ClusterClient,
    request: Request,
    params: TextGenerationTaskParams,
    *,
    command_id: CommandId | None,
    wait_for_first_chunk: bool | None,
    keep_alive: KeepAlive | None,
) -> Generation:
    """`start_generation` after `check_generation_request`: place and load the model when
    needed, wait for a place, submit, and (by default) read the first chunk; all of it
    ended by the node stopping (`NodeStop.unless_stopping`: 503 `node_shutting_down`)."""

    async def start() -> Generation:
        return await _start_now(
            cluster, request, params, command_id, wait_for_first_chunk, keep_alive
        )

    return await cluster.stop.unless_stopping(start)


async def _start_now(
    cluster: ClusterClient,
    request: Request,
    params: TextGenerationTaskParams,
    command_id: CommandId | None,
    wait_for_first_chunk: bool | None,
    keep_alive: KeepAlive | None,
) -> Generation:
    keep_alive = default_keep_alive(cluster, keep_alive)
    pinned = _pinned_instance(cluster, request, params.model)
    if pinned is None:
        await ensure_instance(cluster, request, params.model, keep_alive)
    release_place = await admission_of(request).admit(lambda: cluster.state, request, params.model)
    command = GenerateText(
        command_id=command_id or CommandId.new(),
        params=params,
        keep_alive=keep_alive,
        instance_id=pinned,
    )
    resources = ExitStack()
    # Registered before submitting, so no chunk can arrive unheard.
    chunks = observed_chunks(resources.enter_context(cluster.chunk_stream(command.command_id)))
    generation = Generation(cluster, command.command_id, params, chunks, resources, keep_alive)
    generation.release_place = release_place
    generation.instance_id = command.instance_id
    try:
        await generation.submit(request, command)
        if wait_for_first_chunk if wait_for_first_chunk is not None else True:
            first = await _first_chunk(request, generation.chunks)
            while generation.can_retry(first):
                await generation.retry(request)
                first = await _first_chunk(request, generation.chunks)
            if isinstance(first, ErrorChunk) and first.status_code == 400:
                raise InvalidRequestError(
                    first.error_message,
                    param=conversation_param(request, params),
                    code=first.error_code,
                )
            note_capped_max_tokens(cluster, request, params, first)
            generation.chunks = _prepend(first, generation.chunks)
            if params.stream and generation.instance_id is None:
                generation.chunks = _continued_on_loss(generation, request)
    except BaseException:
        generation.cancel()
        generation.close()
        raise
    return generation


def conversation_param(request: Request, params: TextGenerationTaskParams) -> str:
    """The request field that holds the conversation, which an error about the prompt
    (over the context) names: `prompt` (legacy completions, Ollama's generate), `input`
    (Responses), else `messages`."""
    if params.prompt is not None:
        return "prompt"
    return "input" if request.url.path.rstrip("/").endswith("/responses") else "messages"


def _pinned_instance(cluster: ClusterClient, request: Request, model: str) -> InstanceId | None:
    """The instance the `INSTANCE_HEADER` names (None without the header), checked against
    this node's view of the state before anything waits on the model (the master checks
    again when it decides).

    Raises:
        InvalidRequestError: the header is empty or not an ASCII id, or names an instance
            of another model (400).
        ModelNotFoundError: no such instance (404).
    """
    value = request.headers.get(INSTANCE_HEADER)
    if value is None:
        return None
    value = value.strip()
    if not value or not value.isascii() or not value.isprintable():
        raise InvalidRequestError(
            f"the {INSTANCE_HEADER} header must be an instance id (see GET /state)",
            param=INSTANCE_HEADER,
        )
    instance_id = InstanceId(value)
    instance = cluster.state.instances.get(instance_id)
    if instance is None:
        raise ModelNotFoundError(
            f"no instance '{value}'", param=INSTANCE_HEADER, code="no_instance"
        )
    if instance.model_id != model:
        raise InvalidRequestError(
            f"instance '{value}' serves {instance.model_id}, not {model}", param=INSTANCE_HEADER
        )
    return instance_id


async def serve_generation(
    cluster: ClusterClient,
    request: Request,
    params: TextGenerationTaskParams,
    *,
    render: ChunkRenderer,
    collector: Callable[[AsyncIterator[Chunk]], Awaitable[T]],
    command_id: CommandId | None = None,
    keep_alive: KeepAlive | None = None,
    media_type: str = "text/event-stream",
    waiting: WaitingFrames | None = None,
) -> T | Response:
    """What a dialect's generation route answers: `start_generation`, then the stream
    `render(chunks)` when the request asked to stream (`params.stream`), else `await
    collector(chunks)` (see `streaming_response` and `collect`).

    A stream with `waiting` frames sends its headers at its first chunk or after
    `early_stream.HEADERS_AFTER_SECONDS`, then those frames until the first chunk
    (`exo.api.serving.early_stream`); its request's checks still answer plain HTTP errors.
    A model or pinned instance this node does not know yet is first waited for
    (`exo.api.serving.catch_up`)."""
    await catch_up_for(cluster, params.model, request.headers.get(INSTANCE_HEADER))
    if params.stream and waiting is not None:
        check_generation_request(cluster, params)

        async def start() -> Generation:
            return await _start_checked_generation(
                cluster,
                request,
                params,
                command_id=command_id,
                wait_for_first_chunk=True,
                keep_alive=keep_alive,
            )

        return EarlyStreamingResponse(start, render, waiting, media_type)
    generation = await start_generation(
        cluster, request, params, command_id=command_id, keep_alive=keep_alive
    )
    if params.stream:
        return streaming_response(generation, render, media_type)
    return await collect(generation, request, collector)


@dataclass(frozen=True, slots=True)
class ConvertedRequest(Generic[RequestBody]):
    """A dialect's generation request, ready to serve (`convert_request`): its body (the
    model's short name resolved), the internal params, the command that will carry them
    and the response id that names that command."""

    cluster: ClusterClient
    body: RequestBody
    params: TextGenerationTaskParams
    command_id: CommandId
    response_id: str

    async def serve(
        self,
        request: Request,
        *,
        render: ChunkRenderer,
        collector: Callable[[AsyncIterator[Chunk]], Awaitable[T]],
        waiting: WaitingFrames | None = None,
    ) -> T | Response:
        """`serve_generation` of the params under this request's command."""
        return await serve_generation(
            self.cluster,
            request,
            self.params,
            render=render,
            collector=collector,
            command_id=self.command_id,
            waiting=waiting,
        )


async def convert_request(
    cluster: ClusterClient,
    body: RequestBody,
    to_task_params: Callable[[RequestBody, ImageReader], TextGenerationTaskParams],
    id_prefix: str,
) -> ConvertedRequest[RequestBody]:
    """What the generation routes of Chat Completions, legacy Completions, Responses and
    Claude Messages do first: resolve the body's short model name (`qwen3:0.6b`) to the
    catalog id (answers name that id, as OpenAI and Anthropic name the model an alias
    points to), convert the body with `to_task_params` and the model's image reader (in a
    worker thread when the body holds images: `exo.api.serving.image_input`), and give
    the answer the id `id_prefix` + the new command's id (`response_id`), which any
    dialect's cancel takes.

    Raises:
        InvalidRequestError: `to_task_params` refused the body.
    """
    name = getattr(body, "model", None)
    if isinstance(name, str):
        await catch_up_for(cluster, name)  # a model this node has not heard of yet
    body = with_resolved_model(cluster, body)
    model = getattr(body, "model", "")
    params = await convert_with_images(cluster, body, str(model), to_task_params)
    command_id = CommandId.new()
    return ConvertedRequest(cluster, body, params, command_id, response_id(id_prefix, command_id))


async def _first_chunk(request: Request, chunks: AsyncIterator[Chunk]) -> Chunk | None:
    """The first chunk, or None if the stream ended; GenerationError when the client leaves
    before it comes."""
    result: list[Chunk | None] = []
    async with anyio.create_task_group() as task_group:

        async def first() -> None:
            result.append(await anext(chunks, None))
            task_group.cancel_scope.cancel()

        task_group.start_soon(first)
        task_group.start_soon(cancel_on_disconnect, request, task_group.cancel_scope)
    if not result:
        raise GenerationError("the client disconnected; generation cancelled")
    return result[0]


async def _prepend(first: Chunk | None, rest: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    if first is None:
        return
    yield first
    if first.finish_reason is None:
        async for chunk in rest:
            yield chunk


def _continued_on_loss(generation: Generation, request: Request) -> AsyncIterator[Chunk]:
    """`generation`'s chunks, continued on another instance when its instance is lost
    mid-stream (`exo.api.serving.failover`)."""

    async def resubmit(
        forced_token_ids: tuple[int, ...], deadline: float, loading_deadline: float
    ) -> AsyncIterator[Chunk]:
        return await generation.fail_over(request, forced_token_ids, deadline, loading_deadline)

    async def state_changed() -> None:
        await generation.cluster.state_changed.wait()

    return with_failover(
        generation.chunks, resubmit, state_changed=state_changed, cancel=generation.cancel
    )
