"""The pure state transition: `apply(state, indexed_event) -> state`.

Total over every event type; never mutates its input. Events for things the state no
longer holds (a status for a deleted task, a runner of a deleted instance) are no-ops,
because they can legitimately arrive after the deletion.
"""

from __future__ import annotations

from collections.abc import Iterable

from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceReplaced,
    InstanceReported,
    InstanceUnplaced,
    InstanceUsed,
    NodeDownloadProgress,
    NodeGatheredInfo,
    NodeLost,
    NodeRejoined,
    NodeTimedOut,
    RunnerDeleted,
    RunnerStatusUpdated,
    StateSnapshot,
    TaskCreated,
    TaskStatusUpdated,
    TopologyEdgeMeasured,
    TopologyEdgeRemoved,
)
from exo.shared.types.instances import Instance
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.runners import RunnerFailed, RunnerReady, RunnerRunning, RunnerStatus
from exo.shared.types.state import (
    MAX_COMMAND_OUTCOMES,
    MAX_LOAD_FAILURES,
    CommandOutcome,
    InstanceUnavailable,
    InstanceUsage,
    LoadFailure,
    State,
)
from exo.shared.types.tasks import TERMINAL_TASK_STATUSES


class EventOutOfOrderError(ValueError):
    """An indexed event was not the next one after the state's last applied index."""


def apply(state: State, indexed_event: IndexedEvent) -> State:
    """Return the state after `indexed_event`.

    Raises:
        EventOutOfOrderError: `indexed_event.idx != state.last_event_applied_idx + 1`.
    """
    expected = state.last_event_applied_idx + 1
    if indexed_event.idx != expected:
        raise EventOutOfOrderError(f"expected event {expected}, got {indexed_event.idx}")
    new_state = apply_event(state, indexed_event.event)
    update: dict[str, object] = {"last_event_applied_idx": indexed_event.idx}
    answered = command_outcome(indexed_event)
    if answered is not None and answered[0] not in new_state.command_outcomes:
        # The first event that carries out a command is its answer (an InstanceUsed may
        # follow a TaskCreated under the same command id).
        outcomes = {**new_state.command_outcomes, answered[0]: answered[1]}
        while len(outcomes) > MAX_COMMAND_OUTCOMES:
            del outcomes[next(iter(outcomes))]
        update["command_outcomes"] = outcomes
    if indexed_event.origin is not None and indexed_event.origin_idx is not None:
        key = origin_key(indexed_event.origin, indexed_event.origin_session or "")
        update["local_event_progress"] = {
            **new_state.local_event_progress,
            key: indexed_event.origin_idx,
        }
    return new_state.model_copy(update=update)


def command_outcome(indexed_event: IndexedEvent) -> tuple[CommandId, CommandOutcome] | None:
    """The command `indexed_event` answers and how, for events that answer one."""
    event = indexed_event.event
    outcome = CommandOutcome(event_idx=indexed_event.idx, kind=event.kind)
    match event:
        case CommandRejected(command_id=command_id):
            update = {
                "origin": event.origin,
                "reason": event.reason,
                "status_code": event.status_code,
            }
        case TaskCreated(task=task):
            command_id = task.command_id
            update = {"task_id": task.task_id, "instance_id": task.instance_id}
        case InstanceCreated(instance=instance, command_id=command_id):
            update = {"instance_id": instance.instance_id}
        case InstanceDeleted(command_id=command_id) | InstanceUsed(command_id=command_id):
            update = {"instance_id": event.instance_id}
        case CustomModelAdded(command_id=command_id) | CustomModelDeleted(command_id=command_id):
            update = {}
        case DownloadControlled(command_id=command_id):
            update = {}
        case _:
            return None
    if command_id is None:
        return None
    return command_id, outcome.model_copy(update=update)


def origin_key(origin: str, session: str) -> str:
    """The `State.local_event_progress` key of one process of one node."""
    return f"{origin}/{session}"


def apply_all(state: State, indexed_events: Iterable[IndexedEvent]) -> State:
    for indexed_event in indexed_events:
        state = apply(state, indexed_event)
    return state


def apply_event(state: State, event: Event) -> State:
    match event:
        case InstanceCreated(instance=instance):
            return state.model_copy(
                update={"instances": {**state.instances, instance.instance_id: instance}}
            )
        case InstanceDeleted(instance_id=instance_id):
            if instance_id not in state.instances:
                return state
            instances = {k: v for k, v in state.instances.items() if k != instance_id}
            # Tasks of a deleted instance can never finish; runners report their own end.
            tasks = {k: t for k, t in state.tasks.items() if t.instance_id != instance_id}
            failures = {k: v for k, v in state.instance_failures.items() if k != instance_id}
            usage = {k: v for k, v in state.instance_usage.items() if k != instance_id}
            unavailable = {k: v for k, v in state.unavailable_instances.items() if k != instance_id}
            load_failures = state.load_failures
            if event.load_failure is not None:
                model_id = state.instances[instance_id].model_id
                load_failures = _with_load_failure(state, model_id, event.load_failure)
            return _without_runners(
                state.model_copy(
                    update={
                        "instances": instances,
                        "tasks": tasks,
                        "instance_failures": failures,
                        "instance_usage": usage,
                        "unavailable_instances": unavailable,
                        "load_failures": load_failures,
                    }
                ),
                _runners_of(state.instances[instance_id]),
            )
        case InstanceReplaced(instance=instance, reason=reason):
            old = state.instances.get(instance.instance_id)
            if old is None:
                return state  # deleted meanwhile: the wish ended
            gone = _runners_of(old) - _runners_of(instance)
            return _without_runners(
                state.model_copy(
                    update={
                        "instances": {**state.instances, instance.instance_id: instance},
                        "unavailable_instances": {
                            **state.unavailable_instances,
                            instance.instance_id: InstanceUnavailable(reason=reason),
                        },
                        "instance_failures": {
                            k: v
                            for k, v in state.instance_failures.items()
                            if k != instance.instance_id
                        },
                    }
                ),
                gone,
            )
        case InstanceUnplaced(instance_id=instance_id, reason=reason):
            if instance_id not in state.instances:
                return state
            waiting = InstanceUnavailable(reason=reason, waiting_for_room=True)
            return state.model_copy(
                update={
                    "unavailable_instances": {**state.unavailable_instances, instance_id: waiting}
                }
            )
        case NodeLost(node_id=node_id):
            if node_id not in state.node_info or node_id in state.lost_nodes:
                return state
            unavailable = {
                **state.unavailable_instances,
                **{
                    instance.instance_id: InstanceUnavailable(reason=f"node {node_id} left")
                    for instance in state.instances_on_node(node_id)
                },
            }
            # Its runners' last statuses say nothing any more (a lost rank is no rank).
            on_node = {r for r, n in state.runner_nodes.items() if n == node_id}
            return _without_runners(
                state.model_copy(
                    update={
                        "lost_nodes": (*state.lost_nodes, node_id),
                        "unavailable_instances": unavailable,
                    }
                ),
                on_node,
            )
        case NodeRejoined(node_id=node_id):
            lost = tuple(n for n in state.lost_nodes if n != node_id)
            return state.model_copy(update={"lost_nodes": lost})
        case InstanceUsed(instance_id=instance_id):
            if instance_id not in state.instances:
                return state
            used = InstanceUsage(
                last_used_at=event.used_at, keep_alive_seconds=event.keep_alive_seconds
            )
            return state.model_copy(
                update={"instance_usage": {**state.instance_usage, instance_id: used}}
            )
        case TaskCreated(task=task):
            return state.model_copy(update={"tasks": {**state.tasks, task.task_id: task}})
        case TaskStatusUpdated(task_id=task_id, status=status):
            if task_id not in state.tasks:
                return state
            if isinstance(status, TERMINAL_TASK_STATUSES):
                tasks = {k: t for k, t in state.tasks.items() if k != task_id}
            else:
                updated = state.tasks[task_id].model_copy(update={"status": status})
                tasks = {**state.tasks, task_id: updated}
            return state.model_copy(update={"tasks": tasks})
        case RunnerStatusUpdated(runner_id=runner_id, node_id=node_id, status=status):
            if any(i.draft_runner is not None and i.draft_runner.runner_id == runner_id
                   for i in state.instances.values()):  # fmt: skip
                # A draft runner on a spare node: its status is shown and counted in its
                # node's memory, never in its instance's readiness or failures (the ranks
                # draft without it while it loads or after it fails).
                return state.model_copy(
                    update={
                        "runners": {**state.runners, runner_id: status},
                        "runner_nodes": {**state.runner_nodes, runner_id: node_id},
                    }
                )
            owner = _instance_of_runner(state, runner_id)
            if owner is None:
                # A runner of a deleted (or re-placed) instance reporting its end: the
                # state keeps no trace of it.
                return state
            runners = {**state.runners, runner_id: status}
            unavailable = state.unavailable_instances
            if owner.instance_id in unavailable and _all_ready(owner, runners):
                unavailable = {k: v for k, v in unavailable.items() if k != owner.instance_id}
            load_failures = state.load_failures
            if isinstance(status, RunnerReady) and _all_ready(owner, runners):
                load_failures = _without_load_failure(state, owner.model_id)  # it loads now
            return state.model_copy(
                update={
                    "runners": runners,
                    "runner_nodes": {**state.runner_nodes, runner_id: node_id},
                    "instance_failures": _instance_failures(state, runners, runner_id, status),
                    "unavailable_instances": unavailable,
                    "load_failures": load_failures,
                }
            )
        case RunnerDeleted(runner_id=runner_id):
            return state.model_copy(
                update={
                    "runners": {k: v for k, v in state.runners.items() if k != runner_id},
                    "runner_nodes": {k: v for k, v in state.runner_nodes.items() if k != runner_id},
                }
            )
        case NodeGatheredInfo(node_id=node_id, info=info):
            return state.model_copy(update={"node_info": {**state.node_info, node_id: info}})
        case NodeDownloadProgress(node_id=node_id, model_id=model_id, status=status):
            node_downloads = {**state.downloads.get(node_id, {}), model_id: status}
            # A download completed (new files, or files found anew): worth loading again.
            completed = isinstance(status, DownloadCompleted)
            return state.model_copy(
                update={
                    "downloads": {**state.downloads, node_id: node_downloads},
                    "load_failures": (
                        _without_load_failure(state, model_id) if completed else state.load_failures
                    ),
                }
            )
        case CustomModelAdded(card=card):
            return state.model_copy(
                update={
                    "custom_cards": {**state.custom_cards, card.model_id: card},
                    "load_failures": _without_load_failure(state, card.model_id),
                }
            )
        case CustomModelDeleted(model_id=model_id):
            cards = {k: v for k, v in state.custom_cards.items() if k != model_id}
            return state.model_copy(
                update={
                    "custom_cards": cards,
                    "load_failures": _without_load_failure(state, model_id),
                }
            )
        case CommandRejected() | DownloadControlled():
            return state
        case ClusterHistoryStarted(history_id=history_id):
            return state.model_copy(update={"history_id": history_id})
        case NodeTimedOut(node_id=node_id):
            return _remove_node(state, node_id)
        case TopologyEdgeMeasured(edge=edge):
            edges = {**state.topology.get(edge.source, {}), edge.sink: edge}
            return state.model_copy(update={"topology": {**state.topology, edge.source: edges}})
        case TopologyEdgeRemoved(source=source, sink=sink):
            if sink not in state.topology.get(source, {}):
                return state
            remaining = {k: v for k, v in state.topology[source].items() if k != sink}
            topology = {**state.topology, source: remaining}
            if not remaining:
                del topology[source]
            return state.model_copy(update={"topology": topology})
        case StateSnapshot(state=snapshot_state):
            return snapshot_state
        case InstanceReported():
            return _reported_instance(state, event)


def _reported_instance(state: State, report: InstanceReported) -> State:
    """Add back an instance a node still runs after a healed split (see
    `InstanceReported`); a no-op when its id or a runner id is already taken."""
    instance = report.instance
    runner_ids = set(instance.shard_assignments.runner_to_shard)
    taken = set(state.runners) | set(state.runner_nodes)
    for other in state.instances.values():
        taken |= set(other.shard_assignments.runner_to_shard)
    if instance.instance_id in state.instances or runner_ids & taken:
        return state
    runner_nodes = {
        runner_id: node_id
        for node_id, runner_id in instance.shard_assignments.node_to_runner.items()
    }
    statuses = {k: v for k, v in report.runners.items() if k in runner_ids}
    update: dict[str, object] = {
        "instances": {**state.instances, instance.instance_id: instance},
        "runners": {**state.runners, **statuses},
        "runner_nodes": {**state.runner_nodes, **runner_nodes},
    }
    if report.usage is not None:
        update["instance_usage"] = {**state.instance_usage, instance.instance_id: report.usage}
    return state.model_copy(update=update)


def _runners_of(instance: Instance) -> set[RunnerId]:
    """Its ranks' runners and its draft runner on a spare node, if any."""
    runners = set(instance.shard_assignments.runner_to_shard)
    if instance.draft_runner is not None:
        runners.add(instance.draft_runner.runner_id)
    return runners


def _instance_of_runner(state: State, runner_id: RunnerId) -> Instance | None:
    return next(
        (i for i in state.instances.values() if runner_id in i.shard_assignments.runner_to_shard),
        None,
    )


def _all_ready(instance: Instance, runners: dict[RunnerId, RunnerStatus]) -> bool:
    return all(
        isinstance(runners.get(r), RunnerReady | RunnerRunning)
        for r in instance.shard_assignments.runner_to_shard
    )


def _without_runners(state: State, runner_ids: set[RunnerId]) -> State:
    if not runner_ids & state.runners.keys() and not runner_ids & state.runner_nodes.keys():
        return state
    return state.model_copy(
        update={
            "runners": {k: v for k, v in state.runners.items() if k not in runner_ids},
            "runner_nodes": {k: v for k, v in state.runner_nodes.items() if k not in runner_ids},
        }
    )


def _instance_failures(
    state: State, runners: dict[RunnerId, RunnerStatus], runner_id: RunnerId, status: RunnerStatus
) -> dict[InstanceId, int]:
    """Count a failed runner against its instance; forget the count once every runner of
    the instance is ready."""
    instance = _instance_of_runner(state, runner_id)
    if instance is None:
        return state.instance_failures
    instance_id = instance.instance_id
    if isinstance(status, RunnerFailed):
        return {
            **state.instance_failures,
            instance_id: state.instance_failures.get(instance_id, 0) + 1,
        }
    if isinstance(status, RunnerReady) and _all_ready(instance, runners):
        return {k: v for k, v in state.instance_failures.items() if k != instance_id}
    return state.instance_failures


def _with_load_failure(
    state: State, model_id: ModelId, failure: LoadFailure
) -> dict[ModelId, LoadFailure]:
    """`state.load_failures` with `failure` as `model_id`'s newest, the oldest dropped
    past `MAX_LOAD_FAILURES`."""
    failures = {**_without_load_failure(state, model_id), model_id: failure}
    return dict(list(failures.items())[-MAX_LOAD_FAILURES:])


def _without_load_failure(state: State, model_id: ModelId) -> dict[ModelId, LoadFailure]:
    if model_id not in state.load_failures:
        return state.load_failures
    return {k: v for k, v in state.load_failures.items() if k != model_id}


def _remove_node(state: State, node_id: NodeId) -> State:
    # An instance waiting for room keeps its wish (it is placed again when room appears);
    # any other instance still using the node goes with it.
    gone_instances = {
        i.instance_id
        for i in state.instances_on_node(node_id)
        if not (
            (unavailable := state.unavailable_instances.get(i.instance_id)) is not None
            and unavailable.waiting_for_room
        )
    }
    gone_runners = {r for r, n in state.runner_nodes.items() if n == node_id}
    topology = {
        source: {sink: edge for sink, edge in edges.items() if sink != node_id}
        for source, edges in state.topology.items()
        if source != node_id
    }
    return state.model_copy(
        update={
            "node_info": {k: v for k, v in state.node_info.items() if k != node_id},
            "downloads": {k: v for k, v in state.downloads.items() if k != node_id},
            "topology": {source: edges for source, edges in topology.items() if edges},
            "instances": {k: v for k, v in state.instances.items() if k not in gone_instances},
            "instance_usage": {
                k: v for k, v in state.instance_usage.items() if k not in gone_instances
            },
            "instance_failures": {
                k: v for k, v in state.instance_failures.items() if k not in gone_instances
            },
            "unavailable_instances": {
                k: v for k, v in state.unavailable_instances.items() if k not in gone_instances
            },
            "lost_nodes": tuple(n for n in state.lost_nodes if n != node_id),
            "tasks": {k: t for k, t in state.tasks.items() if t.instance_id not in gone_instances},
            "runners": {k: v for k, v in state.runners.items() if k not in gone_runners},
            "runner_nodes": {k: v for k, v in state.runner_nodes.items() if k not in gone_runners},
        }
    )
