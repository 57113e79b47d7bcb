"""Node loss and recovery: pure decisions of the master over the state and its links.

A node whose link to the master drops (zenoh liveliness: about a second after its process
dies, at once when it closes) is lost (`NodeLost`): its instances stop receiving requests
at once and the requests they were serving fail with a 503 the API retries elsewhere. An
instance is a wish the user made: one that lost a node is placed again on the nodes that
remain, keeping its id, model and sharding (`InstanceReplaced`, new runners), or, when
they have no room, waits with the reason in the state (`InstanceUnplaced`) and is placed
as soon as room appears. `DELETE /instance` ends the wish. A lost node that returns is
placed on again (`NodeRejoined`); one silent for the timeout is removed (`NodeTimedOut`),
and the requests it sent end with it: it was their API node, the only one that can deliver
their tokens to a client (a loss alone does not end them: the node may come back within
the timeout).
"""

from __future__ import annotations

from collections.abc import Collection

from exo.master.placement import PlacementError, place_instance
from exo.shared.apply import apply_event
from exo.shared.types.common import NodeId
from exo.shared.types.events import (
    Event,
    InstanceReplaced,
    InstanceUnplaced,
    NodeLost,
    NodeRejoined,
    NodeTimedOut,
    TaskStatusUpdated,
)
from exo.shared.types.instances import Instance
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskFailed

# A master that just took over gives nodes it never heard from this long to connect
# before it calls them lost (a cluster restarting from its logs: some nodes start later).
ACTIVATION_GRACE_SECONDS = 5.0


def unavailable_message(state: State, instance: Instance) -> str:
    """What a request for `instance` while it cannot serve is told (with a 503)."""
    unavailable = state.unavailable_instances.get(instance.instance_id)
    reason = unavailable.reason if unavailable is not None else "it is recovering"
    return f"instance {instance.instance_id} of {instance.model_id} is unavailable: {reason}"


def connectivity_events(
    state: State,
    master: NodeId,
    peers: Collection[NodeId],
    heard_from: Collection[NodeId],
    grace_over: bool,
) -> list[Event]:
    """Losses and returns of nodes as the master's links show them, with what they imply.

    Args:
        master: the master's own node (never lost).
        peers: nodes the master is linked to now.
        heard_from: nodes the master heard from since it started; a node of the state it
            never heard from is only called lost once `grace_over`.
    """
    events: list[Event] = []
    for node_id in sorted(state.node_info):
        if node_id == master:
            continue
        lost = node_id in state.lost_nodes
        if node_id in peers and lost:
            events.append(NodeRejoined(node_id=node_id))
        elif node_id not in peers and not lost and (node_id in heard_from or grace_over):
            lost_events = events_after_node_lost(state, node_id)
            events.extend(lost_events)
            state = _apply_all(state, lost_events)
    return events


def events_after_node_lost(state: State, node_id: NodeId) -> list[Event]:
    """`NodeLost`, the failure of the requests its instances were serving, and a new
    placement (or the wait for one) of each of those instances."""
    events: list[Event] = [NodeLost(node_id=node_id)]
    after = apply_event(state, events[0])
    for instance in sorted(after.instances_on_node(node_id), key=lambda i: i.instance_id):
        message = f"instance {instance.instance_id} of {instance.model_id} is unavailable: "
        message += f"node {node_id} left; re-placing"
        events.extend(
            TaskStatusUpdated(task_id=task.task_id, status=TaskFailed(error_message=message))
            for task in after.tasks.values()
            if task.instance_id == instance.instance_id
        )
        events.append(replacement(after, instance, f"node {node_id} left"))
    return events


def events_after_node_removed(state: State, node_id: NodeId) -> list[Event]:
    """`NodeTimedOut` for a node silent for the timeout, after what its loss implies (when
    it was not lost before) and the failure of every request it sent.

    A request's tokens go to its API node (`origin_node_id`) only: once that node is
    gone, the instance serving the request would generate up to `max_tokens` for nobody,
    holding a batch slot. Failing the task removes it from the state; the runner holding
    it then cancels the generation (the worker's `CancelTask`), as after a restart of the
    API node (`events_after_restart`). A request sent again by a mid-stream failover has
    the surviving API node as its origin and is kept.
    """
    events: list[Event] = []
    if node_id not in state.lost_nodes:
        events += events_after_node_lost(state, node_id)
    after = _apply_all(state, events)
    message = f"node {node_id}, which sent this request, left the cluster"
    events.extend(
        TaskStatusUpdated(task_id=task.task_id, status=TaskFailed(error_message=message))
        for task in after.tasks.values()
        if task.origin_node_id == node_id
    )
    events.append(NodeTimedOut(node_id=node_id))
    return events


def replacement(state: State, instance: Instance, cause: str) -> Event:
    """`instance` placed again on reachable nodes (new runner ids), or why it cannot be.

    Args:
        cause: what happened to it, e.g. "node X left"; starts the reason either way.
    """
    shard = next(iter(instance.shard_assignments.runner_to_shard.values()))
    try:
        placed = place_instance(
            shard.model_card,
            state,
            instance.instance_id,
            sharding=instance.sharding,
            runner_tag=f"r{state.last_event_applied_idx + 1}",
        )
    except PlacementError as error:
        return InstanceUnplaced(
            instance_id=instance.instance_id, reason=f"{cause}; waiting for room: {error}"
        )
    nodes = ", ".join(placed.shard_assignments.node_to_runner)
    return InstanceReplaced(instance=placed, reason=f"{cause}; re-placed on {nodes}, loading")


def replacements_for_waiting(state: State) -> list[Event]:
    """Instances waiting for room that fit now."""
    events: list[Event] = []
    for instance_id, unavailable in sorted(state.unavailable_instances.items()):
        instance = state.instances.get(instance_id)
        if instance is None or not unavailable.waiting_for_room:
            continue
        cause = unavailable.reason.split("; waiting for room", 1)[0]
        event = replacement(state, instance, cause)
        if isinstance(event, InstanceReplaced):
            events.append(event)
            state = apply_event(state, event)
    return events


def _apply_all(state: State, events: list[Event]) -> State:
    for event in events:
        state = apply_event(state, event)
    return state
