"""Node loss and recovery: pure decisions of the master over the state and its links.

A node whose link to the master drops (zenoh liveliness: about a second after its process
dies, at once when it closes) is lost (`NodeLost`): its instances stop receiving requests
at once and the requests they were serving fail with a 503 the API retries elsewhere. An
instance is a wish the user made: one that lost a node is placed again on the nodes that
remain, keeping its id, model and sharding (`InstanceReplaced`, new runners), or, when
they have no room, waits with the reason in the state (`InstanceUnplaced`) and is placed
as soon as room appears. The instances that lost a node are placed one after the other,
each counting the memory the ones before it were given (`placement_room`), so two never
share the same free memory. A re-placement never puts a second copy of a model on a node
that already runs an instance of that model (`replacement_nodes`): the engine batches
concurrent requests in one instance, so a second copy there would take as much memory
again and share the same cores and memory bandwidth, serving no faster; it waits instead
(`InstanceUnplaced`, naming the instance it would have doubled; requests go to that one)
until a node without the model appears or that instance is deleted. `DELETE /instance`
ends the wish. A lost node that returns is placed on again (`NodeRejoined`); one silent
for the timeout is removed (`NodeTimedOut`), and the requests it sent end with it: it was
their API node, the only one that can deliver their tokens to a client (a loss alone does
not end them: the node may come back within the timeout).
"""

from __future__ import annotations

from collections.abc import Collection

from exo.master.placement import PlacementError, holds_files, place_instance
from exo.shared.apply import apply_event
from exo.shared.types.common import InstanceId, NodeId
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
from exo.shared.types.models import ModelCard
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
        failed: list[Event] = [
            TaskStatusUpdated(task_id=task.task_id, status=TaskFailed(error_message=message))
            for task in after.tasks.values()
            if task.instance_id == instance.instance_id
        ]
        # Applied before the next instance is placed: its runners' memory then counts.
        decided = [*failed, replacement(after, instance, f"node {node_id} left")]
        events.extend(decided)
        after = _apply_all(after, decided)
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
    """`instance` placed again on reachable nodes (new runner ids) that run no other
    instance of its model (`replacement_nodes`), or why it cannot be.

    Args:
        cause: what happened to it, e.g. "node X left"; starts the reason either way.
    """
    nodes, doubled = replacement_nodes(state, instance)
    if not nodes:
        reason = f"{cause}; waiting for room: {_doubling_note(instance, doubled)}"
        return InstanceUnplaced(instance_id=instance.instance_id, reason=reason)
    try:
        placed = place_instance(
            _card_of(instance),
            state,
            instance.instance_id,
            sharding=instance.sharding,
            node_ids=nodes,
            runner_tag=f"r{state.last_event_applied_idx + 1}",
        )
    except PlacementError as error:
        reason = f"{cause}; waiting for room: {error}"
        if doubled:
            reason += f" (and {_doubling_note(instance, doubled)})"
        return InstanceUnplaced(instance_id=instance.instance_id, reason=reason)
    placed_nodes = ", ".join(placed.shard_assignments.node_to_runner)
    return InstanceReplaced(
        instance=placed, reason=f"{cause}; re-placed on {placed_nodes}, loading"
    )


def replacement_nodes(
    state: State, instance: Instance
) -> tuple[list[NodeId], dict[NodeId, InstanceId]]:
    """The reachable nodes `instance` may be placed again on, and those it may not because
    they run another instance of its model (node -> that instance).

    Two copies of one model on a node take its memory twice and share its cores and
    memory bandwidth: one instance batches concurrent requests, so a second copy there
    serves them no faster (`engine.md`, batching). Another instance counts when it runs
    (or loads) on the node: not when it waits for room (it runs nowhere) nor when it lost
    a node itself (it is being placed again; its runners there stop).
    """
    holders: dict[NodeId, InstanceId] = {}
    for other in sorted(state.instances.values(), key=lambda i: i.instance_id):
        if other.instance_id == instance.instance_id or other.model_id != instance.model_id:
            continue
        unavailable = state.unavailable_instances.get(other.instance_id)
        if unavailable is not None and unavailable.waiting_for_room:
            continue
        nodes = other.shard_assignments.node_to_runner
        if any(node in state.lost_nodes for node in nodes):
            continue
        for node in nodes:
            holders.setdefault(node, other.instance_id)
    reachable = [node for node in sorted(state.node_info) if node not in state.lost_nodes]
    allowed = [node for node in reachable if node not in holders]
    return allowed, {node: holders[node] for node in reachable if node in holders}


def _doubling_note(instance: Instance, doubled: dict[NodeId, InstanceId]) -> str:
    """Why the nodes of `doubled` are not used for `instance`."""
    if not doubled:
        return "no node is reachable"
    runs = ", ".join(f"{node} runs instance {other}" for node, other in doubled.items())
    return (
        f"{runs} of {instance.model_id}, and a second copy on a node shares its cores "
        "and serves no faster (requests go to that instance meanwhile)"
    )


def replacements_nearer_files(state: State) -> list[Event]:
    """Instances being placed again after a node loss whose placement still has to fetch
    the model's files, placed once more where fewer nodes must fetch them.

    The placement chosen while a node was gone may have landed on nodes that must first
    download the model (minutes for a large one, while requests wait for it); a node that
    comes back — restarted within seconds, its files still on disk — then serves far
    sooner. So while an instance is unavailable and not waiting for room (re-placed, its
    runners not all ready), and `place_instance` on the state now would choose nodes of
    which fewer lack the files (`placement.holds_files`: a completed download reported),
    it is placed there (`InstanceReplaced`, new runners; the old ones stop, their download
    is no longer needed). A placement whose every node holds the files never moves, and
    each move lowers the number of nodes that must fetch, so an instance moves at most once
    per node it was placed on; an instance that lost a node the master has not placed
    again yet is left to `events_after_node_lost`.
    """
    events: list[Event] = []
    for instance_id, unavailable in sorted(state.unavailable_instances.items()):
        instance = state.instances.get(instance_id)
        if instance is None or unavailable.waiting_for_room:
            continue
        nodes = list(instance.shard_assignments.node_to_runner)
        if any(node in state.lost_nodes for node in nodes):
            continue
        card = _card_of(instance)
        fetching = _nodes_fetching(state, card, nodes)
        allowed, _ = replacement_nodes(state, instance)
        if fetching == 0 or not allowed:
            continue
        try:
            placed = place_instance(
                card,
                state,
                instance_id,
                sharding=instance.sharding,
                node_ids=allowed,
                runner_tag=f"r{state.last_event_applied_idx + 1}",
            )
        except PlacementError:
            continue
        placed_nodes = list(placed.shard_assignments.node_to_runner)
        if _nodes_fetching(state, card, placed_nodes) >= fetching:
            continue
        cause = unavailable.reason.split("; re-placed", 1)[0]
        event = InstanceReplaced(
            instance=placed,
            reason=f"{cause}; re-placed on {', '.join(placed_nodes)} (holding its files), loading",
        )
        events.append(event)
        state = apply_event(state, event)
    return events


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


def _card_of(instance: Instance) -> ModelCard:
    return next(iter(instance.shard_assignments.runner_to_shard.values())).model_card


def _nodes_fetching(state: State, card: ModelCard, nodes: list[NodeId]) -> int:
    """How many of `nodes` must fetch `card`'s files before their runner loads."""
    return sum(not holds_files(state, card, node) for node in nodes)


def _apply_all(state: State, events: list[Event]) -> State:
    for event in events:
        state = apply_event(state, event)
    return state
