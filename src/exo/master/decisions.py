"""Pure decisions of the master: which events a command produces."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping

from exo.master.keep_alive import set_keep_alive
from exo.master.placement import PlacementError, place_instance
from exo.master.placement_memory import (
    cluster_too_small_message,
    placement_room,
    required_memory_bytes,
)
from exo.master.recovery import unavailable_message
from exo.shared.models.cards import UnknownModelError, resolve_card
from exo.shared.models.names import resolve_model_name
from exo.shared.types.commands import (
    MAX_GENERATION_BYTES,
    AddCustomModel,
    CancelGeneration,
    Command,
    ComputeEmbeddings,
    ControlDownload,
    DeleteCustomModel,
    DeleteInstance,
    GenerateText,
    PlaceInstance,
    RequestEventReplay,
    SetKeepAlive,
)
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    Event,
    InstanceCreated,
    InstanceDeleted,
    RunnerDeleted,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadFailed
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.shared.types.state import State
from exo.shared.types.tasks import Embedding, TaskCancelled, TaskFailed, TextGeneration


def no_instance_message(model_id: str) -> str:
    return (
        f"no instance of model '{model_id}' is running. Place one with "
        f'POST /place_instance {{"model_id": "{model_id}"}} and wait until it is ready.'
    )


def no_room_message(card: ModelCard, state: State, placement_error: str) -> str:
    """Why a model asked for cannot be loaded, with how much memory the cluster lacks when
    its nodes together have too little."""
    needed = required_memory_bytes(card)
    available = sum(room.available_bytes for room in placement_room(state).values())
    message = f"the cluster has no room to load {card.model_id}: {placement_error}"
    if needed > available:
        message += (
            f" ({(needed - available) / 2**20:.0f} MiB missing: it needs "
            f"{needed / 2**20:.0f} MiB, all nodes together have {available / 2**20:.0f} MiB "
            "available)"
        )
    return message


def choose_instance(
    state: State, model_id: ModelId, command_id: CommandId | None = None
) -> Instance | None:
    """The instance of `model_id` to send a new generation to, among those that can
    serve (not unavailable after losing a node): ready ones first, then the least busy
    (fewest unfinished tasks: queued plus running), then a tie broken by a hash of the
    command and instance ids, so equally idle instances share sequential requests and
    every master decides the same. None when no instance can serve.
    """
    candidates = [
        instance
        for instance in state.instances_of_model(model_id)
        if instance.instance_id not in state.unavailable_instances
    ]
    if not candidates:
        return None

    def load(instance: Instance) -> tuple[int, int, str, str]:
        rank_zero = instance.shard_assignments.rank_zero_runner()
        ready = isinstance(state.runners.get(rank_zero), RunnerReady | RunnerRunning)
        active = sum(1 for t in state.tasks.values() if t.instance_id == instance.instance_id)
        spread = hashlib.sha256(f"{command_id}/{instance.instance_id}".encode()).hexdigest()
        return (0 if ready else 1, active, spread if command_id else "", instance.instance_id)

    return min(candidates, key=load)


def _pinned_instance_refusal(
    state: State, model_id: ModelId, instance_id: InstanceId
) -> tuple[str, int] | None:
    """Why a generation pinned to `instance_id` cannot run there (reason, HTTP status):
    no such instance (404), an instance of another model (400), or one that cannot serve
    now (503): unavailable after a node loss, or not ready yet (its rank-0 runner not
    `RunnerReady` / `RunnerRunning`: still loading). A pinned request never waits for its
    instance (docs/cluster.md, "Routing"), so a loading one is refused at once rather than
    queued on a runner that answers only once loaded. None when it can run there."""
    instance = state.instances.get(instance_id)
    if instance is None:
        return f"no instance '{instance_id}'", 404
    if instance.model_id != model_id:
        return f"instance '{instance_id}' serves {instance.model_id}, not {model_id}", 400
    if instance_id in state.unavailable_instances:
        return unavailable_message(state, instance), 503
    status = state.runners.get(instance.shard_assignments.rank_zero_runner())
    if not isinstance(status, RunnerReady | RunnerRunning):
        failed = _failed_preparation(state, instance)
        if failed is not None:
            return failed[0], 500 if failed[1] else 503
        stage = (
            "starting"
            if status is None
            else re.sub(r"(?<!^)(?=[A-Z])", " ", status.kind.removeprefix("Runner")).lower()
        )
        return (
            f"instance {instance_id} of {model_id} is not ready ({stage}); a pinned request "
            "does not wait for it: retry once GET /state shows its runners ready",
            503,
        )
    return None


def events_for_command(
    state: State,
    origin: NodeId,
    command: Command,
    cards: Mapping[ModelId, ModelCard],
    new_instance_id: Callable[[], InstanceId] = InstanceId.new,
    new_task_id: Callable[[], TaskId] = TaskId.new,
    now: float = 0.0,
) -> list[Event]:
    """The events that carry out `command`, or a `CommandRejected` saying why not.

    Args:
        now: the master's wall clock (Unix seconds), stamped on keep-alive records.
    """
    match command:
        case PlaceInstance():
            if command.only_if_cluster_empty and state.instances:
                return [
                    _reject(command.command_id, origin, "the cluster already runs a model", 409)
                ]
            try:
                card = resolve_card(command.model_id, cards, state.custom_cards)
            except UnknownModelError as error:
                return [_reject(command.command_id, origin, str(error), 404)]
            if command.on_request and state.instances_of_model(card.model_id):
                # Another request (on this or another API node) placed it first.
                return [
                    _reject(command.command_id, origin, f"{card.model_id} is already placed", 409)
                ]
            try:
                instance = place_instance(
                    card,
                    state,
                    new_instance_id(),
                    sharding=command.sharding,
                    min_nodes=command.min_nodes,
                    node_ids=command.node_ids,
                    cards=cards,
                )
            except PlacementError as error:
                if command.on_request:
                    reason = no_room_message(card, state, str(error))
                    return [_reject(command.command_id, origin, reason, 503)]
                return [_reject(command.command_id, origin, str(error), 400)]
            return [InstanceCreated(instance=instance, command_id=command.command_id)]
        case SetKeepAlive(model_id=model_id):
            if not state.instances_of_model(model_id):
                return [_reject(command.command_id, origin, no_instance_message(model_id), 404)]
            return list(set_keep_alive(state, command, now))
        case DeleteInstance(instance_id=instance_id):
            if instance_id not in state.instances:
                return [_reject(command.command_id, origin, f"no instance '{instance_id}'", 404)]
            return [InstanceDeleted(instance_id=instance_id, command_id=command.command_id)]
        case GenerateText(params=params) | ComputeEmbeddings(params=params):
            size = len(params.__pydantic_serializer__.to_json(params))
            if size > MAX_GENERATION_BYTES:
                reason = f"the request is {size} bytes; at most {MAX_GENERATION_BYTES} are accepted"
                return [_reject(command.command_id, origin, reason, 413)]
            chosen: Instance | None
            if command.instance_id is not None:
                refusal = _pinned_instance_refusal(state, params.model, command.instance_id)
                if refusal is not None:
                    return [_reject(command.command_id, origin, *refusal)]
                chosen = state.instances[command.instance_id]
            else:
                chosen = choose_instance(state, params.model, command.command_id)
            if chosen is None:
                unavailable = state.instances_of_model(params.model)
                if unavailable:
                    reason = unavailable_message(state, unavailable[0])
                    return [_reject(command.command_id, origin, reason, 503)]
                return [_reject(command.command_id, origin, no_instance_message(params.model), 404)]
            failed = _failed_preparation(state, chosen)
            if failed is not None:
                reason, permanent = failed
                return [_reject(command.command_id, origin, reason, 500 if permanent else 503)]
            task: TextGeneration | Embedding
            if isinstance(command, ComputeEmbeddings):
                task = Embedding(
                    task_id=new_task_id(),
                    command_id=command.command_id,
                    instance_id=chosen.instance_id,
                    origin_node_id=origin,
                    params=command.params,
                )
            else:
                task = TextGeneration(
                    task_id=new_task_id(),
                    command_id=command.command_id,
                    instance_id=chosen.instance_id,
                    origin_node_id=origin,
                    params=command.params,
                )
            return [TaskCreated(task=task)]
        case RequestEventReplay():
            return []  # served from the log by the master, nothing new happens
        case AddCustomModel(card=card):
            if resolve_model_name(card.model_id, cards) is not None:
                reason = f"{card.model_id} is a catalog model: it needs no adding"
                return [_reject(command.command_id, origin, reason, 409)]
            return [CustomModelAdded(card=card, command_id=command.command_id)]
        case DeleteCustomModel(model_id=model_id):
            refusal = _custom_model_refusal(state, model_id, cards)
            if refusal is not None:
                return [_reject(command.command_id, origin, *refusal)]
            return [CustomModelDeleted(model_id=model_id, command_id=command.command_id)]
        case ControlDownload(node_id=node_id, card=card, action=action):
            if node_id not in state.node_info:
                known = ", ".join(sorted(state.node_info)) or "none"
                reason = f"no node {node_id} in the cluster (known: {known})"
                return [_reject(command.command_id, origin, reason, 404)]
            placed = [
                instance.instance_id
                for instance in state.instances_of_model(card.model_id)
                if node_id in instance.shard_assignments.node_to_runner
            ]
            if action == "delete" and placed:
                reason = (
                    f"{card.model_id} has a shard on {node_id} (instance {placed[0]}); delete "
                    "the instance first (DELETE /instance/{id})"
                )
                return [_reject(command.command_id, origin, reason, 409)]
            too_small = cluster_too_small_message(card, state) if action == "start" else None
            if too_small is not None:
                return [_reject(command.command_id, origin, too_small, 409)]
            return [
                DownloadControlled(
                    node_id=node_id, card=card, action=action, command_id=command.command_id
                )
            ]
        case CancelGeneration(target_command_id=target):
            return [
                TaskStatusUpdated(task_id=task.task_id, status=TaskCancelled())
                for task in state.tasks.values()
                if task.command_id == target
            ]


def _custom_model_refusal(
    state: State, model_id: ModelId, catalog: Mapping[ModelId, ModelCard]
) -> tuple[str, int] | None:
    """Why the custom model `model_id` cannot be deleted (reason, HTTP status), or None."""
    if resolve_model_name(model_id, catalog) is not None:
        return f"{model_id} is a catalog model; only custom models can be deleted", 400
    if model_id not in state.custom_cards:
        known = ", ".join(sorted(state.custom_cards)) or "none"
        return f"no custom model {model_id} (known: {known})", 404
    placed = state.instances_of_model(model_id)
    if placed:
        return (
            f"{model_id} has {len(placed)} placed instance(s) "
            f"({', '.join(i.instance_id for i in placed)}); delete them first "
            "(DELETE /instance/{id})",
            409,
        )
    return None


def _failed_preparation(state: State, instance: Instance) -> tuple[str, bool] | None:
    """Why `instance` cannot become ready, and whether for good: a node failed to prepare
    its model (it retries with backoff, but a request should not wait on that), or failed
    permanently (`DownloadFailed.permanent`: a 500, which clients do not retry, not a 503)."""
    rank_zero = instance.shard_assignments.rank_zero_runner()
    if isinstance(state.runners.get(rank_zero), RunnerReady | RunnerRunning):
        return None
    for node_id in instance.shard_assignments.node_to_runner:
        status = state.downloads.get(node_id, {}).get(instance.model_id)
        if isinstance(status, DownloadFailed):
            reason = f"model {instance.model_id} cannot be prepared: {status.error_message}"
            return reason, status.permanent
    return None


def events_after_restart(state: State, node_id: NodeId) -> list[Event]:
    """Clean-up when `node_id` starts again from its log: its runners are gone, and the
    requests it was serving have no client any more."""
    events: list[Event] = [
        RunnerDeleted(runner_id=runner_id)
        for runner_id, runner_node in state.runner_nodes.items()
        if runner_node == node_id
    ]
    events.extend(
        TaskStatusUpdated(task_id=task.task_id, status=TaskFailed(error_message="node restarted"))
        for task in state.tasks.values()
        if task.origin_node_id == node_id
    )
    return events


def _reject(
    command_id: CommandId, origin: NodeId, reason: str, status_code: int
) -> CommandRejected:
    return CommandRejected(
        command_id=command_id, origin=origin, reason=reason, status_code=status_code
    )
