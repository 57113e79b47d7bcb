"""`Generation`: a generation the cluster accepted (its command, its chunk stream, its
admission place), and sending it again under a new command when its instance becomes
unavailable: before the client received anything (`Generation.retry`) or mid-stream
(`Generation.fail_over`, `exo.api.serving.failover`).

A new request for a model whose every instance is being placed again after losing a node
(`replacement_under_way`: re-placed and loading, or its node just lost) waits for it as a
request waits for a model loading on request, instead of a 503 at once
(`Generation.submit`): bounded by `REPLACEMENT_WAIT_SECONDS`, ended by the client leaving.
It is answered 503 with `Retry-After` when the instance cannot serve again soon: it waits
for room no node set has (`InstanceUnplaced`), it was deleted, or the wait ran out.

Apart from `generation` (starting and serving a request) because it is the object the
response side (`generation_response`, `early_stream`) holds and ends, and its resending
waits on the cluster state on its own, whichever route started it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from loguru import logger

from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.failover import healthy_instance_exists, instance_may_come
from exo.api.serving.metrics import observed_chunks
from exo.api.wire.errors import (
    ApiError,
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
    NoCapacityError,
)
from exo.master.recovery import unavailable_message
from exo.shared.constants import INSTANCE_HEADER
from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk
from exo.shared.types.commands import CancelGeneration, GenerateText, KeepAlive
from exo.shared.types.common import CommandId, InstanceId, ModelId
from exo.shared.types.state import State
from exo.shared.types.text_generation import TextGenerationTaskParams

# A generation is sent again at most this many times after its instance became unavailable.
MAX_RETRIES = 5
# How long a retried generation waits for a lost model instance to serve again (placed
# anew and loaded) when no other instance of its model can take it.
RETRY_WAIT_SECONDS = 120.0
RETRY_STATE_CHECK_SECONDS = 0.5
# How long a new request waits for its model's instance being placed again after a node
# loss: as long as a request that lost its instance before its first chunk, since both
# have sent the client nothing yet and wait for the same re-placed instance to load.
# Streams send heartbeats meanwhile (`exo.api.serving.early_stream`).
REPLACEMENT_WAIT_SECONDS = RETRY_WAIT_SECONDS
# The `Retry-After` of a 503 for a model whose instances are all unavailable: a re-placed
# instance of a small model loads in about this long, and a node that left and restarts
# rejoins within it; a client asking sooner would only be refused again.
UNAVAILABLE_RETRY_AFTER_SECONDS = 10


@dataclass(slots=True)
class Generation:
    """An accepted generation: its command, and its chunks (the first one already read for
    streaming requests). Release with `close()` unless handed to `streaming_response` or
    `collect`, which release it themselves."""

    cluster: ClusterClient
    command_id: CommandId
    params: TextGenerationTaskParams
    chunks: AsyncIterator[Chunk]
    _resources: ExitStack = field(default_factory=ExitStack)
    keep_alive: KeepAlive | None = None
    retries: int = 0
    """How often it was sent again after its instance became unavailable."""
    _known_command_id: CommandId | None = None
    """The first command, which the client's response id names, once sent again."""
    release_place: Callable[[], None] | None = None
    """Gives back its place among this node's requests in flight (`exo.api.serving.admission`)."""
    instance_id: InstanceId | None = None
    """The instance it was pinned to (`INSTANCE_HEADER`): never sent to another."""

    def cancel(self) -> None:
        """Ask the cluster to stop this generation on every rank (idempotent)."""
        self.cluster.send_and_forget(
            CancelGeneration(command_id=CommandId.new(), target_command_id=self.command_id)
        )

    def close(self) -> None:
        self._resources.close()
        if self.release_place is not None:
            self.release_place()
        if self._known_command_id is not None:
            self.cluster.generation_aliases.pop(self._known_command_id, None)

    def can_retry(self, error: ApiError | Chunk | None) -> bool:
        """Whether `error` (an error chunk, or the ApiError a collector made of one) says
        the instance became unavailable, and retries are left."""
        code = error.error_code if isinstance(error, ErrorChunk) else None
        if isinstance(error, ApiError):
            code = error.code
        pinned = self.instance_id is not None
        return code == INSTANCE_UNAVAILABLE and self.retries < MAX_RETRIES and not pinned

    async def retry(self, request: Request) -> None:
        """Send the generation again under a new command (its chunks replace the old
        ones). When the master has no instance that can serve it (503: its model's
        instances are unavailable), wait for one, at most `RETRY_WAIT_SECONDS`.

        Raises:
            NoCapacityError: no instance served again in time, or the master refused.
            ModelNotFoundError: the model's instances were deleted meanwhile.
            GenerationError: the client disconnected while waiting.
        """
        self.retries += 1
        deadline = anyio.current_time() + RETRY_WAIT_SECONDS
        self.chunks = await self._resubmit(request, self.params, deadline, "before answering")

    async def fail_over(
        self, request: Request, forced_token_ids: tuple[int, ...], deadline: float
    ) -> AsyncIterator[Chunk]:
        """Send the streamed generation again, mid-stream, to continue after the
        `forced_token_ids` its client already got (`exo.api.serving.failover`); waits for
        an instance of the model at most until `deadline` (anyio clock seconds): a healthy
        one other than the lost one as it was (`failover.healthy_instance_exists`; the same
        instance placed again on other nodes is another).

        Returns:
            The new command's chunks.

        Raises:
            NoCapacityError: no healthy instance by `deadline`, or as `retry`.
            ModelNotFoundError, GenerationError: as `retry`.
        """
        lost = self.cluster.routed_instance(self.command_id)
        lost_instance = self.cluster.state.instances.get(lost) if lost is not None else None
        state, model = self.cluster.state, self.params.model
        while not healthy_instance_exists(state, model, lost_instance):
            if anyio.current_time() >= deadline or not instance_may_come(
                state, model, lost_instance
            ):
                raise NoCapacityError(
                    f"no healthy instance of {self.params.model} to continue the stream on"
                )
            wait = min(RETRY_STATE_CHECK_SECONDS, max(0.0, deadline - anyio.current_time()))
            if not await _wait_for_state_change(self.cluster, request, wait):
                raise GenerationError("the client disconnected; generation cancelled")
            state = self.cluster.state
        params = self.params.model_copy(update={"forced_token_ids": forced_token_ids})
        return await self._resubmit(
            request, params, deadline, f"after {len(forced_token_ids)} streamed tokens"
        )

    async def submit(self, request: Request, command: GenerateText) -> None:
        """Submit this new generation's first `command` (its chunk stream is `chunks`).

        While every instance of the model is being placed again after a node loss
        (`replacement_under_way`), first wait until one serves, at most
        `REPLACEMENT_WAIT_SECONDS` (a request pinned to an instance does not wait). The
        master refusing it because the re-placement is still under way (it saw the loss
        before this node) waits the same way, then sends it again under a new command
        (`chunks` replaced); the command the client knows stays its alias for a cancel.

        Raises:
            NoCapacityError: the instance did not serve again in time, waits for room no
                node set has, or was deleted meanwhile (503 with `Retry-After`); or the
                master refused for another reason (as `submit_generation`).
            GenerationError: the client disconnected while waiting.
            ApiError: as `submit_generation`.
        """
        deadline = anyio.current_time() + REPLACEMENT_WAIT_SECONDS
        pinned = self.instance_id is not None
        while True:
            if not pinned:
                await self._wait_for_replacement(request, deadline)
            try:
                await submit_generation(self.cluster, command)
                return
            except NoCapacityError as error:
                state = self.cluster.state
                if pinned or not replacement_under_way(state, self.params.model):
                    if error.retry_after_seconds is None and _unavailable(state, self, pinned):
                        error.retry_after_seconds = UNAVAILABLE_RETRY_AFTER_SECONDS
                    raise
            command, self.chunks = self._new_command(self.params)
            logger.info(
                f"api: {self._known_command_id} was refused while {self.params.model} is "
                f"placed again; waits, then goes as {command.command_id}"
            )

    async def _wait_for_replacement(self, request: Request, deadline: float) -> None:
        """Return at once unless every instance of the model is being placed again
        (`replacement_under_way`); else once one serves again.

        Raises:
            NoCapacityError: `deadline` (anyio clock seconds) passed, or the instance can
                no longer come back soon (it waits for room, or was deleted) (503 with
                `Retry-After`).
            GenerationError: the client disconnected.
        """
        model = self.params.model
        if not replacement_under_way(self.cluster.state, model):
            return
        logger.info(f"api: {self.command_id} waits for {model}, being placed again")
        while True:
            state = self.cluster.state
            if self._model_serving():
                return
            if not replacement_under_way(state, model):
                instances = state.instances_of_model(model)
                reason = (
                    unavailable_message(state, instances[0])
                    if instances
                    else f"the instance of {model} was deleted while the request waited for it"
                )
                raise NoCapacityError(reason, retry_after_seconds=UNAVAILABLE_RETRY_AFTER_SECONDS)
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                instance = state.instances_of_model(model)[0]
                raise NoCapacityError(
                    f"{unavailable_message(state, instance)}; it did not serve again within "
                    f"{REPLACEMENT_WAIT_SECONDS:g} s",
                    retry_after_seconds=UNAVAILABLE_RETRY_AFTER_SECONDS,
                )
            wait = min(RETRY_STATE_CHECK_SECONDS, remaining)
            if not await _wait_for_state_change(self.cluster, request, wait):
                raise GenerationError("the client disconnected while its model was placed again")

    def _new_command(
        self, params: TextGenerationTaskParams
    ) -> tuple[GenerateText, AsyncIterator[Chunk]]:
        """A new command carrying `params`, and its chunk stream, which replaces the old
        command's (closed). The new command is this generation's from before it is sent,
        so a cancel reaches it; the command the client knows names it (an alias)."""
        self._resources.close()  # the old command's chunk stream
        known = self._known_command_id = self._known_command_id or self.command_id
        self._resources = ExitStack()
        command = GenerateText(
            command_id=CommandId.new(), params=params, keep_alive=self.keep_alive
        )
        chunks = observed_chunks(
            self._resources.enter_context(self.cluster.chunk_stream(command.command_id))
        )
        self.command_id = command.command_id
        self.cluster.generation_aliases[known] = command.command_id
        return command, chunks

    async def _resubmit(
        self,
        request: Request,
        params: TextGenerationTaskParams,
        deadline: float,
        when: str,
    ) -> AsyncIterator[Chunk]:
        """Send `params` under a new command (`_new_command`); when the master has no
        instance that can serve it (503: its model's instances are unavailable), wait for
        one until `deadline`."""
        while True:
            command, chunks = self._new_command(params)
            logger.info(
                f"api: {self._known_command_id} lost its instance {when}; sent again as "
                f"{command.command_id} (retry {self.retries})"
            )
            try:
                await submit_generation(self.cluster, command)
                return chunks
            except NoCapacityError:
                if not self._model_recovering():
                    raise
            # Every instance of the model is recovering: wait until one serves again.
            while self._model_recovering() and not self._model_serving():
                if anyio.current_time() >= deadline:
                    raise NoCapacityError(
                        f"no instance of {self.params.model} served again in time "
                        "after its instance was lost"
                    )
                if not await _wait_for_state_change(
                    self.cluster, request, RETRY_STATE_CHECK_SECONDS
                ):
                    raise GenerationError("the client disconnected; generation cancelled")

    def _model_serving(self) -> bool:
        """Whether an instance of the model is not unavailable (it may take requests)."""
        state = self.cluster.state
        return any(
            instance.instance_id not in state.unavailable_instances
            for instance in state.instances_of_model(self.params.model)
        )

    def _model_recovering(self) -> bool:
        """Whether an instance of the model is unavailable now and may serve again."""
        state = self.cluster.state
        return any(
            instance.instance_id in state.unavailable_instances
            for instance in state.instances_of_model(self.params.model)
        )


def replacement_under_way(state: State, model: ModelId) -> bool:
    """Whether no instance of `model` can take a request now but one is being placed again
    after losing a node (re-placed with its runners loading, or its node just lost and the
    master's decision not yet applied): a new request waits for it. False when an instance
    can take requests, when the model has no instance, and when every instance waits for
    room no node set has (`InstanceUnplaced`: that may last for hours)."""
    instances = state.instances_of_model(model)
    unavailable = [state.unavailable_instances.get(i.instance_id) for i in instances]
    return (
        bool(instances)
        and all(entry is not None for entry in unavailable)
        and any(entry is not None and not entry.waiting_for_room for entry in unavailable)
    )


def _unavailable(state: State, generation: Generation, pinned: bool) -> bool:
    """Whether `generation`'s pinned instance (else every instance of its model) is
    unavailable in `state`, so that a 503 for it may name a time to retry."""
    if pinned:
        return generation.instance_id in state.unavailable_instances
    instances = state.instances_of_model(generation.params.model)
    return bool(instances) and all(i.instance_id in state.unavailable_instances for i in instances)


async def _wait_for_state_change(cluster: ClusterClient, request: Request, timeout: float) -> bool:
    """Wait until the cluster state changes or `timeout` seconds pass; False when the
    client disconnected meanwhile."""
    if await request.is_disconnected():
        return False
    with anyio.move_on_after(timeout):
        await cluster.state_changed.wait()
    return True


async def submit_generation(cluster: ClusterClient, command: GenerateText) -> None:
    """Submit `command`; the master's refusal becomes the ApiError its status names (404
    no instance, 413 over the context, 400 pinned to another model's instance, 500 the
    model failed to prepare, else 503)."""
    try:
        await cluster.submit(command)
    except CommandRejectedError as error:
        if error.status_code == 404:
            raise ModelNotFoundError(error.reason, code="no_instance") from None
        if error.status_code == 413:
            raise InvalidRequestError(error.reason, code="context_length_exceeded") from None
        if error.status_code == 400:  # pinned to an instance of another model
            raise InvalidRequestError(error.reason, param=INSTANCE_HEADER) from None
        if error.status_code == 500:  # its model failed to prepare for good
            raise GenerationError(error.reason) from None
        raise NoCapacityError(error.reason) from None
