"""Sending a request whose model's every instance is being placed again after a node loss:
the one decision every request that has sent its client nothing yet takes — a new
generation (`accepted_generation.Generation.submit`), a generation that lost its instance
before its first chunk (`Generation.retry`), a stream's re-submission
(`Generation.fail_over`), and every embeddings / rerank request, new or lost
(`exo.api.serving.embedding`).

`submit_when_served`: while no instance of the model can take a request but one is being
placed again (`replacement_under_way`: re-placed with its runners loading, or its node just
lost), the request waits for it to serve, as Ollama holds a request while its model loads,
then is sent; a master that saw the loss before this node refuses it (503), and it waits
the same way and is sent again under a new command. The wait is bounded by a deadline, and
the client leaving ends it. When the instance cannot serve again soon — it waits for room
no node set has (`InstanceUnplaced`: that may last for hours), it was deleted, or the wait
ran out — the request is answered 503 with `Retry-After: UNAVAILABLE_RETRY_AFTER_SECONDS`
in its dialect's shape, at once in the first two cases.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from fastapi import Request
from loguru import logger

from exo.api.serving.cluster_client import ClusterClient
from exo.api.wire.errors import GenerationError, NoCapacityError
from exo.master.recovery import unavailable_message
from exo.shared.types.common import CommandId, InstanceId, ModelId
from exo.shared.types.state import State

# How long a request that has sent its client nothing yet waits for its model's instance
# being placed again after a node loss (placed anew on the remaining nodes and loaded): a
# new request as long as one that lost its instance before its first chunk, since both wait
# for the same re-placed instance to load. Streams send heartbeats meanwhile
# (`exo.api.serving.early_stream`).
REPLACEMENT_WAIT_SECONDS = 120.0
# The `Retry-After` of a 503 for a model whose instances are all unavailable: a re-placed
# instance of a small model loads in about this long, and a node that left and restarts
# rejoins within it; a client asking sooner would only be refused again.
UNAVAILABLE_RETRY_AFTER_SECONDS = 10
# A waiting request looks at the cluster state and its client's connection at least this
# often (besides waking at every state change).
STATE_CHECK_SECONDS = 0.5


class WaitCancellation:
    """How `/v1/cancel` reaches a request while it waits to be sent (not yet a task, so
    the master knows nothing of it): once the request starts waiting, its event is listed
    under the command its client knows (`ClusterClient.waiting_generations`), until the
    wait ends (`submit_when_served`)."""

    __slots__ = ("_cluster", "_command_id", "_listening", "event")

    def __init__(self, cluster: ClusterClient, command_id: CommandId) -> None:
        self._cluster = cluster
        self._command_id = command_id
        self._listening = False
        self.event = anyio.Event()

    def listen(self) -> None:
        self._cluster.waiting_generations[self._command_id] = self.event
        self._listening = True

    def forget(self) -> None:
        if (
            self._listening
            and self._cluster.waiting_generations.get(self._command_id) is self.event
        ):
            del self._cluster.waiting_generations[self._command_id]
        self._listening = False

    @property
    def requested(self) -> bool:
        return self.event.is_set()


Send = Callable[[int], Awaitable[None]]
"""Submits the request's command: attempt 0 its first; a later attempt (after the master
refused the one before) a new command, since the master has answered the old id. Raises
NoCapacityError for the master's 503, another ApiError for its other refusals."""


def replacement_under_way(state: State, model: ModelId) -> bool:
    """Whether no instance of `model` can take a request now but one is being placed again
    after losing a node (re-placed with its runners loading, or its node just lost and the
    master's decision not yet applied): a request waits for it. False when an instance
    can take requests, when the model has no instance, and when every instance waits for
    room no node set has (`InstanceUnplaced`: that may last for hours)."""
    instances = state.instances_of_model(model)
    unavailable = [state.unavailable_instances.get(i.instance_id) for i in instances]
    return (
        bool(instances)
        and all(entry is not None for entry in unavailable)
        and any(entry is not None and not entry.waiting_for_room for entry in unavailable)
    )


def model_serving(state: State, model: ModelId) -> bool:
    """Whether an instance of `model` is not unavailable (it may take requests)."""
    return any(
        instance.instance_id not in state.unavailable_instances
        for instance in state.instances_of_model(model)
    )


def all_unavailable(state: State, model: ModelId, pinned: InstanceId | None = None) -> bool:
    """Whether the `pinned` instance (else every instance of `model`, at least one) is
    unavailable in `state`, so that a 503 for it may name a time to retry."""
    if pinned is not None:
        return pinned in state.unavailable_instances
    instances = state.instances_of_model(model)
    return bool(instances) and all(i.instance_id in state.unavailable_instances for i in instances)


async def wait_for_state_change(cluster: ClusterClient, request: Request, timeout: float) -> bool:
    """Wait until the cluster state changes or `timeout` seconds pass; False when the
    client disconnected meanwhile."""
    if await request.is_disconnected():
        return False
    with anyio.move_on_after(timeout):
        await cluster.state_changed.wait()
    return True


async def wait_for_replacement(
    cluster: ClusterClient,
    request: Request,
    model: ModelId,
    deadline: float,
    wait_seconds: float | None = None,
    cancellation: WaitCancellation | None = None,
) -> None:
    """Return at once unless every instance of `model` is being placed again
    (`replacement_under_way`); else once one serves again, or once `cancellation` is
    requested (`/v1/cancel`, seen within `STATE_CHECK_SECONDS`).

    Args:
        deadline: anyio clock seconds after which the request stops waiting.
        wait_seconds: the bound `deadline` stands for, which a 503 names (None: "in time").
        cancellation: listened to while this request waits.

    Raises:
        NoCapacityError: `deadline` passed, or the instance can no longer come back soon (it
            waits for room, or was deleted) (503 with `Retry-After`).
        GenerationError: the client disconnected.
    """
    if not replacement_under_way(cluster.state, model):
        return
    logger.info(f"api: a request for {model} waits for its instance, being placed again")
    if cancellation is not None:
        cancellation.listen()
    while True:
        state = cluster.state
        if model_serving(state, model) or (cancellation is not None and cancellation.requested):
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
            bound = "in time" if wait_seconds is None else f"within {wait_seconds:g} s"
            raise NoCapacityError(
                f"{unavailable_message(state, state.instances_of_model(model)[0])}; it did "
                f"not serve again {bound}",
                retry_after_seconds=UNAVAILABLE_RETRY_AFTER_SECONDS,
            )
        if not await wait_for_state_change(cluster, request, min(STATE_CHECK_SECONDS, remaining)):
            raise GenerationError("the client disconnected while its model was placed again")


async def submit_when_served(
    cluster: ClusterClient,
    request: Request,
    model: ModelId,
    send: Send,
    *,
    deadline: float,
    wait_seconds: float | None = None,
    pinned: InstanceId | None = None,
    cancellation: WaitCancellation | None = None,
) -> bool:
    """Send a request for `model` (`send`), first waiting while its every instance is being
    placed again (`wait_for_replacement`), and waiting again after a refusal the master
    gave because the re-placement is under way (it saw the loss before this node): then
    `send` is called with the next attempt's number. A request `pinned` to an instance
    neither waits nor is sent again.

    Args:
        deadline: anyio clock seconds after which the request stops waiting.
        wait_seconds: the bound `deadline` stands for, which a 503 names.
        cancellation: the client's `/v1/cancel` while the request waits: it is then not
            sent.

    Returns:
        True once sent; False when cancelled while it waited.

    Raises:
        NoCapacityError: the instance did not serve again by `deadline`, waits for room no
            node set has, or was deleted (503 with `Retry-After`); or the master refused
            for another reason (as `send` raised it; with `Retry-After` when every
            instance of the model, or the pinned one, is unavailable).
        GenerationError: the client disconnected while waiting.
        ApiError: as `send`.
    """
    attempt = 0
    try:
        while True:
            if pinned is None:
                await wait_for_replacement(
                    cluster, request, model, deadline, wait_seconds, cancellation
                )
            if cancellation is not None and cancellation.requested:
                return False
            try:
                await send(attempt)
                return True
            except NoCapacityError as error:
                state = cluster.state
                if pinned is not None or not replacement_under_way(state, model):
                    if error.retry_after_seconds is None and all_unavailable(state, model, pinned):
                        error.retry_after_seconds = UNAVAILABLE_RETRY_AFTER_SECONDS
                    raise
            attempt += 1
            logger.info(f"api: a request for {model} was refused while it is placed again; waits")
    finally:
        if cancellation is not None:
            cancellation.forget()
