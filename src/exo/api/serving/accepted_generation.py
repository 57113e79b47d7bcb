"""`Generation`: a generation the cluster accepted (its command, its chunk stream, its
admission place), and sending it again under a new command when its instance becomes
unavailable: before the client received anything (`Generation.retry`) or mid-stream
(`Generation.fail_over`, `exo.api.serving.failover`).

A new request for a model whose every instance is being placed again after losing a node
(`replacement_wait.replacement_under_way`: re-placed and loading, or its node just lost)
waits for it as a
request waits for a model loading on request, instead of a 503 at once
(`Generation.submit`): bounded by `REPLACEMENT_WAIT_SECONDS`, ended by the client leaving.
A request sent again after losing its instance takes the same decision
(`exo.api.serving.replacement_wait`, shared with embeddings): it is answered 503 with
`Retry-After` when the instance cannot serve again soon: it waits for room no node set has
(`InstanceUnplaced`, answered at once), it was deleted, or the wait ran out.

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
from exo.api.serving.failover import (
    failover_deadline,
    healthy_instance_exists,
    instance_may_come,
)
from exo.api.serving.metrics import observed_chunks
from exo.api.serving.replacement_wait import (
    REPLACEMENT_WAIT_SECONDS,
    STATE_CHECK_SECONDS,
    WaitCancellation,
    submit_when_served,
    wait_for_state_change,
)
from exo.api.wire.errors import (
    ApiError,
    GenerationError,
    InvalidRequestError,
    ModelNotFoundError,
    NoCapacityError,
)
from exo.shared.constants import INSTANCE_HEADER
from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk, TokenChunk
from exo.shared.types.commands import CancelGeneration, GenerateText, KeepAlive
from exo.shared.types.common import CommandId, InstanceId
from exo.shared.types.text_generation import TextGenerationTaskParams

# A generation is sent again at most this many times after its instance became unavailable.
MAX_RETRIES = 5
# How long a retried generation waits for a lost model instance to serve again (placed
# anew and loaded) when no other instance of its model can take it: as long as a new
# request waits for it (`replacement_wait.REPLACEMENT_WAIT_SECONDS`).
RETRY_WAIT_SECONDS = REPLACEMENT_WAIT_SECONDS


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
        instances are unavailable), wait for one as a new request does
        (`replacement_wait.submit_when_served`), at most `RETRY_WAIT_SECONDS`.

        Raises:
            NoCapacityError: no instance served again in time, the instance waits for room
                no node set has or was deleted (503 with `Retry-After`, at once in those
                two cases), or the master refused.
            ModelNotFoundError: the model's instances were deleted meanwhile.
            GenerationError: the client disconnected while waiting.
        """
        self.retries += 1
        deadline = anyio.current_time() + RETRY_WAIT_SECONDS
        self.chunks = await self._resubmit(
            request, self.params, deadline, "before answering", RETRY_WAIT_SECONDS
        )

    async def fail_over(
        self,
        request: Request,
        forced_token_ids: tuple[int, ...],
        deadline: float,
        loading_deadline: float,
    ) -> AsyncIterator[Chunk]:
        """Send the streamed generation again, mid-stream, to continue after the
        `forced_token_ids` its client already got (`exo.api.serving.failover`); waits for
        an instance of the model at most until `deadline`, or `loading_deadline` while one
        is coming up (`failover.failover_deadline`; anyio clock seconds): a healthy one
        other than the lost one as it was (`failover.healthy_instance_exists`; the same
        instance placed again on other nodes is another).

        Returns:
            The new command's chunks.

        Raises:
            NoCapacityError: no healthy instance by the deadline in force, or as `retry`.
            ModelNotFoundError, GenerationError: as `retry`.
        """
        # The placement the stream ran on, as it was routed: by now the master may have
        # placed the instance again under its id (another placement, a good target).
        lost_instance = self.cluster.routed_placement(self.command_id)
        state, model = self.cluster.state, self.params.model
        while not healthy_instance_exists(state, model, lost_instance):
            # A node of it gone that the master has not marked yet (the stream saw the
            # loss first): the instance will be placed again, worth waiting for.
            node_lost = lost_instance is not None and self.cluster.placement_lost_a_node(
                lost_instance
            )
            in_force = failover_deadline(state, model, lost_instance, deadline, loading_deadline)
            if anyio.current_time() >= in_force or not instance_may_come(
                state, model, lost_instance, node_lost
            ):
                raise NoCapacityError(
                    f"no healthy instance of {self.params.model} to continue the stream on"
                )
            wait = min(STATE_CHECK_SECONDS, max(0.0, in_force - anyio.current_time()))
            if not await wait_for_state_change(self.cluster, request, wait):
                raise GenerationError("the client disconnected; generation cancelled")
            state = self.cluster.state
        params = self.params.model_copy(update={"forced_token_ids": forced_token_ids})
        in_force = failover_deadline(state, model, lost_instance, deadline, loading_deadline)
        return await self._resubmit(
            request, params, in_force, f"after {len(forced_token_ids)} streamed tokens"
        )

    async def submit(self, request: Request, command: GenerateText) -> None:
        """Submit this new generation's first `command` (its chunk stream is `chunks`).

        While every instance of the model is being placed again after a node loss
        (`replacement_wait.replacement_under_way`), first wait until one serves, at most
        `REPLACEMENT_WAIT_SECONDS` (a request pinned to an instance does not wait). The
        master refusing it because the re-placement is still under way (it saw the loss
        before this node) waits the same way, then sends it again under a new command
        (`chunks` replaced); the command the client knows stays its alias for a cancel
        (`replacement_wait.submit_when_served`).

        Raises:
            NoCapacityError: the instance did not serve again in time, waits for room no
                node set has, or was deleted meanwhile (503 with `Retry-After`); or the
                master refused for another reason (as `submit_generation`).
            GenerationError: the client disconnected while waiting.
            ApiError: as `submit_generation`.
        """

        async def send(attempt: int) -> None:
            nonlocal command
            if attempt > 0:
                refused = self.command_id
                command, self.chunks = self._new_command(self.params)
                logger.info(
                    f"api: {refused} was refused while {self.params.model} is placed again; "
                    f"goes as {command.command_id}"
                )
            await submit_generation(self.cluster, command)

        cancellation = self._cancellation()
        sent = await submit_when_served(
            self.cluster,
            request,
            self.params.model,
            send,
            deadline=anyio.current_time() + REPLACEMENT_WAIT_SECONDS,
            wait_seconds=REPLACEMENT_WAIT_SECONDS,
            pinned=self.instance_id,
            cancellation=cancellation,
        )
        if not sent:
            self.chunks = self._cancelled_end()
        elif cancellation.requested:  # cancelled while the master took it: cancel the task
            self.cancel()

    def _cancellation(self) -> WaitCancellation:
        """What `/v1/cancel` of the command this generation's client knows sets while the
        generation waits to be sent (`replacement_wait.WaitCancellation`)."""
        return WaitCancellation(self.cluster, self._known_command_id or self.command_id)

    async def _cancelled_end(self) -> AsyncIterator[Chunk]:
        """The chunks of a generation cancelled before it was sent: the final "cancelled"
        chunk a runner sends for a queued task it drops (`Runner._end_task`), so every
        dialect ends it as it ends any cancelled generation."""
        logger.info(f"api: {self.command_id} was cancelled while it waited to be sent")
        yield TokenChunk(
            command_id=self.command_id, model=self.params.model, text="", finish_reason="cancelled"
        )

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
        wait_seconds: float | None = None,
    ) -> AsyncIterator[Chunk]:
        """Send `params` under a new command (`_new_command`), taking a new request's
        decision while every instance of the model is being placed again
        (`replacement_wait.submit_when_served`: wait until `deadline`, or a 503 with
        `Retry-After` at once when the instance waits for room or was deleted)."""
        chunks: list[AsyncIterator[Chunk]] = []

        async def send(attempt: int) -> None:
            command, new_chunks = self._new_command(params)
            chunks[:] = [new_chunks]
            logger.info(
                f"api: {self._known_command_id} lost its instance {when}; sent again as "
                f"{command.command_id} (retry {self.retries}, attempt {attempt + 1})"
            )
            await submit_generation(self.cluster, command)

        cancellation = self._cancellation()
        sent = await submit_when_served(
            self.cluster,
            request,
            params.model,
            send,
            deadline=deadline,
            wait_seconds=wait_seconds,
            cancellation=cancellation,
        )
        if sent and cancellation.requested:  # cancelled while the master took it
            self.cancel()
        return chunks[0] if sent else self._cancelled_end()


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
