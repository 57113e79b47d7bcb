"""Load on request, as Ollama users expect: a request naming a model that has no instance
places one and waits until it is ready, before anything is sent to the client.

- Only a model whose files are ready somewhere is placed: downloaded on some node (or in
  this node's models directory), or built in from PyPI (SmolLM2, Gemma 3 270M: any node
  fetches their wheels). Another model answers 404 with a hint to pull it first.
- Concurrent requests for the same model on this node share one placement; across API
  nodes the master refuses a second on-request placement of a model that already has an
  instance (409), and the losers wait for the winner's instance.
- The wait is bounded (`LoadOnRequest.ready_timeout_seconds`, default 600 s: a big model
  loads for minutes on a CPU). A client that leaves while waiting stops only its own wait:
  the placement goes on, so the next request finds the model loaded.
- A model that cannot load is a final error, not a 503 that clients retry into the same
  failure: when the master deleted its instance after its runners failed to load or warm
  it up for a reason of the model's own (`InstanceDeleted.load_failure`: a tensor of the
  wrong shape, a config the engine refuses), the request gets a 500 `model_load_failed`
  naming the reason. For `LoadOnRequest.load_failure_seconds` after (default 300 s) its
  requests get that answer at once rather than placing it again (each placement tries to
  load it three times). The failure is forgotten sooner (`State.load_failures`) when the
  model is added again (`POST /models/add`), a node completes a download of it, or an
  instance of it placed by hand (`POST /place_instance`) becomes ready; after the window
  a request places it once more (the node's software or files may have changed). A
  failure that may pass (out of memory, a node lost while loading) stays a 503.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import anyio
from fastapi import Request
from loguru import logger

from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError, CommandTimeoutError
from exo.api.serving.model_lookup import card_of, is_downloaded
from exo.api.wire.errors import GenerationError, ModelNotFoundError, NoCapacityError
from exo.master.decisions import no_instance_message
from exo.master.keep_alive import instance_ready
from exo.shared.constants import models_dir
from exo.shared.types.commands import DeleteInstance, KeepAlive, PlaceInstance
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.events import InstanceCreated
from exo.shared.types.models import ModelCard, PypiGgufPartsSource, PypiGgufSource
from exo.shared.types.nodes import DownloadFailed, DownloadStatus
from exo.shared.types.runners import RunnerFailed
from exo.shared.types.state import LoadFailure, State

STATE_CHECK_SECONDS = 0.5
LOAD_FAILED = "model_load_failed"
DISCONNECT_POLL_SECONDS = 0.25


def default_keep_alive(cluster: ClusterClient, requested: KeepAlive | None) -> KeepAlive | None:
    """The keep-alive a request gives the instance it uses: its own, else this node's
    `--idle-unload`, else None (leave the instance's as it is)."""
    if requested is not None:
        return requested
    seconds = cluster.load_on_request.idle_unload_seconds
    return KeepAlive(seconds=seconds) if seconds is not None else None


def not_downloaded_message(model_id: str, offline: bool = False) -> str:
    """Why `model_id` is not loaded on request and what to do: download it first, or, on a
    node that runs `--offline` (which downloads nothing, so neither route would help), put
    its files on the node."""
    if offline:
        return (
            f"model '{model_id}' is not on any node of the cluster, and this node runs "
            "--offline: it downloads nothing. Put the model's files on a node (a models "
            "directory's <org>--<name>, EXO_MODELS_DIRS, or the Hugging Face cache) or add a "
            'local directory or .gguf file with POST /models/add {"model_id": "/path"}, '
            "then ask again: it is loaded on request."
        )
    return (
        f"model '{model_id}' is not downloaded on any node of the cluster. Download it "
        f'first with POST /download/start {{"model": "{model_id}"}} or Ollama\'s '
        f'POST /ollama/api/pull {{"model": "{model_id}"}}, then ask again: it is loaded on '
        "request."
    )


def load_failed_error(
    model_id: ModelId, failure: LoadFailure, remembered_seconds: float | None = None
) -> GenerationError:
    """The final error (500 `model_load_failed`) of a request for a model that failed to
    load for good: just now, or (`remembered_seconds`: `load_failure_seconds`) earlier,
    and the request placed nothing."""
    fix = "fix or replace its files, then add it again (POST /models/add) or download it again"
    if remembered_seconds is None:
        message = (
            f"{model_id} cannot be loaded: its runners failed to load it repeatedly and it "
            f"was unloaded: {failure.reason}. Loading it again would fail the same way: "
            f"{fix}, and ask again"
        )
    else:
        message = (
            f"{model_id} cannot be loaded: its runners failed to load it at "
            f"{_utc(failure.failed_at)}: {failure.reason}. It is not loaded on request again "
            f"within {remembered_seconds:.0f} s of that failure unless it is added or "
            f"downloaded again: {fix}"
        )
    return GenerationError(message, code=LOAD_FAILED)


def recent_load_failure(
    cluster: ClusterClient, model_id: ModelId, now: float
) -> GenerationError | None:
    """The final error for a request for `model_id` when the model failed to load for good
    less than `load_failure_seconds` before `now` (Unix seconds, compared with the
    master's clock: nodes' clocks are assumed close), else None (place it)."""
    failure = cluster.state.load_failures.get(model_id)
    window = cluster.load_on_request.load_failure_seconds
    if failure is None or now - failure.failed_at >= window:
        return None
    return load_failed_error(model_id, failure, window)


def _utc(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def is_available(cluster: ClusterClient, card: ModelCard) -> bool:
    """Whether a node can prepare `card` without a download someone must ask for: its
    files are ready on some node, or it is built in from PyPI."""
    if isinstance(card.source, PypiGgufSource | PypiGgufPartsSource):
        return True
    return is_downloaded(cluster, card, models_dir())


async def ensure_instance(
    cluster: ClusterClient,
    request: Request,
    model_id: ModelId,
    keep_alive: KeepAlive | None = None,
) -> None:
    """Return once `model_id` has an instance: at once when it has one (ready or not),
    else after placing one (or joining a placement under way) and waiting until it is
    ready.

    Args:
        keep_alive: the keep-alive of an instance placed here. A keep-alive of 0 is not
            given to it (it would be unloaded as soon as it is ready, before the
            generation reaches it): the generation's own command sets it.

    Raises:
        ModelNotFoundError: auto-placement is off (`--no-auto-place`), or the model's
            files are nowhere (404, with a hint).
        NoCapacityError: no room for the model (the message says how much memory is
            missing), it could not be prepared or loaded, or it did not load in time (503).
        GenerationError: the client disconnected while waiting, or the model cannot load:
            it failed for good now or within `load_failure_seconds` (500).
    """
    if cluster.state.instances_of_model(model_id):
        return
    if not cluster.load_on_request.auto_place:
        raise ModelNotFoundError(no_instance_message(model_id), code="no_instance")
    remembered = recent_load_failure(cluster, model_id, time.time())
    if remembered is not None:
        raise remembered
    card = card_of(cluster, model_id)
    if card is None or not is_available(cluster, card):
        message = not_downloaded_message(model_id, cluster.load_on_request.offline)
        raise ModelNotFoundError(message, code="model_not_downloaded")
    if keep_alive is not None and keep_alive.seconds == 0:
        keep_alive = None  # the generation's own command sets it once it runs
    timeout = cluster.load_on_request.ready_timeout_seconds
    outcome: list[BaseException | None] = []
    async with anyio.create_task_group() as task_group:

        async def load() -> None:
            # Taken before placing: a node can report its failure to prepare the model
            # before this task runs again after the placement (it was then ignored).
            earlier_failures = _preparation_statuses(cluster.state, model_id)
            earlier_load_failure = cluster.state.load_failures.get(model_id)
            try:
                with anyio.fail_after(timeout):
                    placed = await _placed_instance(cluster, card, keep_alive)
                    await _wait_until_ready(
                        cluster, model_id, placed, earlier_failures, earlier_load_failure
                    )
                outcome.append(None)
            except TimeoutError:
                outcome.append(
                    NoCapacityError(
                        f"{model_id} did not finish loading within {timeout:.0f} s; it is "
                        "still loading: ask again later"
                    )
                )
            except (ModelNotFoundError, NoCapacityError, GenerationError) as error:
                outcome.append(error)
            task_group.cancel_scope.cancel()

        task_group.start_soon(load)
        task_group.start_soon(_cancel_on_disconnect, request, task_group.cancel_scope)
    if not outcome:
        raise GenerationError("the client disconnected while the model was loading")
    if outcome[0] is not None:
        raise outcome[0]


async def _placed_instance(
    cluster: ClusterClient, card: ModelCard, keep_alive: KeepAlive | None
) -> InstanceId | None:
    """Place `card` on request, or wait for the placement another request of this node
    has under way. Returns the id of the instance this call placed (None when the model
    was placed by someone else)."""
    model_id = card.model_id
    while not cluster.state.instances_of_model(model_id):
        under_way = cluster.placing.get(model_id)
        if under_way is not None:
            await under_way.wait()
            continue
        done = anyio.Event()
        cluster.placing[model_id] = done
        try:
            # Shielded: a client leaving must not abandon a command the master may be
            # carrying out; the other waiters rely on its outcome.
            with anyio.CancelScope(shield=True):
                placed = await _place(cluster, card, keep_alive)
        finally:
            del cluster.placing[model_id]
            done.set()
        if placed is not None:
            return placed
        # Placed by another API node first: our replica learns of it shortly.
        with anyio.move_on_after(STATE_CHECK_SECONDS):
            await cluster.state_changed.wait()
    return None


async def _place(
    cluster: ClusterClient, card: ModelCard, keep_alive: KeepAlive | None
) -> InstanceId | None:
    """Send the on-request placement; None when the model already had an instance."""
    # Raced against the node's stop here as well (the command's outcome is, in `submit`):
    # the caller's shield keeps the stop's cancellation out.
    await cluster.stop.unless_stopping(cluster.wait_for_node_reports)
    command = PlaceInstance(
        command_id=CommandId.new(), model_id=card.model_id, on_request=True, keep_alive=keep_alive
    )
    logger.info(f"api: placing {card.model_id} on request")
    try:
        event = await cluster.submit(command)
    except CommandRejectedError as error:
        if error.status_code == 409:
            return None
        if error.status_code == 404:
            raise ModelNotFoundError(error.reason) from None
        raise NoCapacityError(error.reason, code="insufficient_memory") from None
    except CommandTimeoutError as error:
        raise NoCapacityError(str(error)) from None
    assert isinstance(event, InstanceCreated)
    return event.instance.instance_id


async def _wait_until_ready(
    cluster: ClusterClient,
    model_id: ModelId,
    placed: InstanceId | None,
    earlier_failures: dict[NodeId, DownloadStatus],
    earlier_load_failure: LoadFailure | None,
) -> None:
    """Wait until an instance of `model_id` is ready. A node's failure to prepare the
    model counts only if its status is not one of `earlier_failures` (the statuses from
    before the placement: an earlier instance's failure does not fail this one), and a
    load failure only if it is not `earlier_load_failure`.

    Raises:
        NoCapacityError: every instance of the model is gone (unloaded, or its runners
            failed for a reason that may pass), or a node cannot prepare its files (then
            the instance this request placed is deleted, so the next request starts afresh).
        GenerationError: a node cannot prepare its files for good (`DownloadFailed.permanent`,
            a GGUF that does not convert), or the instance was deleted because its runners
            failed to load the model for good (`InstanceDeleted.load_failure`): a 500, which
            clients do not retry; the instance this request placed is deleted as above.
    """
    last_failure = ""
    while True:
        state = cluster.state
        instances = state.instances_of_model(model_id)
        load_failure = state.load_failures.get(model_id)
        if not instances and load_failure is not None and load_failure != earlier_load_failure:
            raise load_failed_error(model_id, load_failure)
        if not instances:
            raise NoCapacityError(
                f"{model_id} was unloaded before it finished loading"
                + (f": {last_failure}" if last_failure else "")
            )
        if any(instance_ready(state, instance) for instance in instances):
            return
        last_failure = _runner_failure(state, model_id) or last_failure
        preparation_failure = _preparation_failure(state, model_id, earlier_failures)
        if preparation_failure is not None:
            if placed is not None and placed in state.instances:
                cluster.send_and_forget(
                    DeleteInstance(command_id=CommandId.new(), instance_id=placed)
                )
            message = f"{model_id} cannot be prepared: {preparation_failure.error_message}"
            if preparation_failure.permanent:
                raise GenerationError(message)
            raise NoCapacityError(message)
        with anyio.move_on_after(STATE_CHECK_SECONDS):
            await cluster.state_changed.wait()


def _runner_failure(state: State, model_id: ModelId) -> str | None:
    for instance in state.instances_of_model(model_id):
        for runner_id in instance.shard_assignments.runner_to_shard:
            status = state.runners.get(runner_id)
            if isinstance(status, RunnerFailed):
                return status.error_message
    return None


def _preparation_statuses(state: State, model_id: ModelId) -> dict[NodeId, DownloadStatus]:
    """Each node's current preparation status of `model_id` (compared by identity)."""
    return {
        node_id: downloads[model_id]
        for node_id, downloads in state.downloads.items()
        if model_id in downloads
    }


def _preparation_failure(
    state: State, model_id: ModelId, earlier: dict[NodeId, DownloadStatus]
) -> DownloadFailed | None:
    for instance in state.instances_of_model(model_id):
        for node_id in instance.shard_assignments.node_to_runner:
            status = state.downloads.get(node_id, {}).get(model_id)
            if isinstance(status, DownloadFailed) and earlier.get(node_id) is not status:
                return status
    return None


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while not await request.is_disconnected():
        await anyio.sleep(DISCONNECT_POLL_SECONDS)
    scope.cancel()
