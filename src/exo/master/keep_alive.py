"""Keep-alive and idle unloading: pure decisions of the master over the state.

An instance with a keep-alive has a usage record in the state (`State.instance_usage`):
when it was last used, by the master's wall clock, and how long it may then stay idle.
The master records a use (`InstanceUsed`) when such an instance is placed, when it becomes
ready (so a long load does not count as idle time), when a generation starts on it and
when one ends, and when a request sets its keep-alive. Instances without one cost no
events. Because the record is state, a newly elected master unloads on the same schedule.

An instance is unloaded (`InstanceDeleted`) once it is ready, runs no generation, and has
been idle at least its keep-alive. An instance without a keep-alive stays until deleted:
exo's default. A keep-alive comes from Ollama's `keep_alive` in a request or from the
`--idle-unload` option of the node that placed the instance or served a request for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from exo.shared.types.commands import (
    Command,
    ComputeEmbeddings,
    GenerateText,
    KeepAlive,
    PlaceInstance,
    SetKeepAlive,
)
from exo.shared.types.common import CommandId, InstanceId
from exo.shared.types.events import (
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceUsed,
    RunnerStatusUpdated,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.shared.types.state import State
from exo.shared.types.tasks import TERMINAL_TASK_STATUSES


def instance_ready(state: State, instance: Instance) -> bool:
    """Whether every rank of `instance` is ready (or generating)."""
    return all(
        isinstance(state.runners.get(runner_id), RunnerReady | RunnerRunning)
        for runner_id in instance.shard_assignments.runner_to_shard
    )


def current_keep_alive_seconds(state: State, instance_id: InstanceId) -> float | None:
    """The instance's keep-alive in seconds; None when it stays until deleted."""
    usage = state.instance_usage.get(instance_id)
    return usage.keep_alive_seconds if usage is not None else None


def usage_after_command(
    state: State, command: Command, events: Sequence[Event], now: float
) -> list[Event]:
    """The uses that `events`, carrying out `command` on `state`, make.

    Args:
        state: the state before `events`.
        now: the master's wall clock, Unix seconds.
    """
    used: list[Event] = []
    for event in events:
        match event:
            case InstanceCreated(instance=instance):
                keep_alive = command.keep_alive if isinstance(command, PlaceInstance) else None
                used += _tracked_use(state, instance.instance_id, now, _seconds(keep_alive))
            case TaskCreated(task=task):
                keep_alive = (
                    command.keep_alive
                    if isinstance(command, GenerateText | ComputeEmbeddings)
                    else None
                )
                seconds = (
                    keep_alive.seconds
                    if keep_alive is not None
                    else current_keep_alive_seconds(state, task.instance_id)
                )
                used += _tracked_use(state, task.instance_id, now, seconds)
            case _:
                pass
    return used


def set_keep_alive(state: State, command: SetKeepAlive, now: float) -> list[InstanceUsed]:
    """The uses that set the keep-alive of every instance of the command's model (empty
    when it has none); each names the command."""
    return [
        _used(instance.instance_id, now, command.keep_alive.seconds, command.command_id)
        for instance in state.instances_of_model(command.model_id)
    ]


def usage_after_local_event(before: State, after: State, event: Event, now: float) -> list[Event]:
    """The use a node's event makes: a generation ended on an instance, or an instance
    became ready.

    Args:
        before: the state before `event`; after: the state after it.
        now: the master's wall clock, Unix seconds.
    """
    match event:
        case TaskStatusUpdated(task_id=task_id, status=status) if isinstance(
            status, TERMINAL_TASK_STATUSES
        ):
            task = before.tasks.get(task_id)
            if task is None or task.instance_id not in after.instances:
                return []
            keep_alive = current_keep_alive_seconds(after, task.instance_id)
            return _tracked_use(after, task.instance_id, now, keep_alive)
        case RunnerStatusUpdated(runner_id=runner_id, status=RunnerReady()):
            for instance in after.instances.values():
                if runner_id not in instance.shard_assignments.runner_to_shard:
                    continue
                if instance_ready(after, instance) and not instance_ready(before, instance):
                    keep_alive = current_keep_alive_seconds(after, instance.instance_id)
                    return _tracked_use(after, instance.instance_id, now, keep_alive)
            return []
        case _:
            return []


def idle_instances(state: State, now: float) -> list[Event]:
    """Instances to unload now: ready, running no generation, and idle at least their
    keep-alive.

    Args:
        now: the master's wall clock, Unix seconds.
    """
    busy = {task.instance_id for task in state.tasks.values()}
    unload: list[Event] = []
    for instance_id, usage in sorted(state.instance_usage.items()):
        instance = state.instances.get(instance_id)
        if instance is None or usage.keep_alive_seconds is None or instance_id in busy:
            continue
        if not instance_ready(state, instance):
            continue  # still loading, or recovering: its idle time has not started
        if now - usage.last_used_at >= usage.keep_alive_seconds:
            unload.append(InstanceDeleted(instance_id=instance_id))
    return unload


def _tracked_use(
    state: State, instance_id: InstanceId, now: float, keep_alive_seconds: float | None
) -> list[Event]:
    """A use of the instance, when it has a keep-alive before or after it (an instance
    kept until deleted needs no record)."""
    if keep_alive_seconds is None and current_keep_alive_seconds(state, instance_id) is None:
        return []
    return [_used(instance_id, now, keep_alive_seconds)]


def _seconds(keep_alive: KeepAlive | None) -> float | None:
    return keep_alive.seconds if keep_alive is not None else None


def _used(
    instance_id: InstanceId,
    now: float,
    keep_alive_seconds: float | None,
    command_id: CommandId | None = None,
) -> InstanceUsed:
    return InstanceUsed(
        instance_id=instance_id,
        used_at=now,
        keep_alive_seconds=keep_alive_seconds,
        command_id=command_id,
    )
