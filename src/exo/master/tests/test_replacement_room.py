"""Re-placing several instances after one node loss: each counts the memory of those
placed before it, and no node gets a second copy of a model it already runs (trial 43:
two instances of one model lost a node and both landed on the one node left)."""

from exo.master.placement_memory import placement_room, required_memory_bytes
from exo.master.recovery import (
    events_after_node_lost,
    replacement_nodes,
    replacements_for_waiting,
    replacements_nearer_files,
)
from exo.master.tests.test_recovery import _holding, _lost_and_re_placed, _rejoined
from exo.shared.apply import apply_event
from exo.shared.types.common import CommandId, InstanceId, NodeId
from exo.shared.types.events import (
    Event,
    InstanceDeleted,
    InstanceReplaced,
    InstanceUnplaced,
    NodeRejoined,
)
from exo.shared.types.state import State
from exo.testing.builders import MIB, make_card, make_instance, make_node_info, make_state

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
ROOMY = make_node_info(4096)
OTHER_CARD = make_card(model_id="test/other-model")


def apply_events(state: State, events: list[Event]) -> State:
    for event in events:
        state = apply_event(state, event)
    return state


def placed_nodes(event: Event) -> list[NodeId]:
    assert isinstance(event, InstanceReplaced)
    return list(event.instance.shard_assignments.node_to_runner)


def test_two_instances_lost_together_do_not_share_one_nodes_free_memory() -> None:
    # Two models on B; A has room for one of them, not both.
    one_runner_mb = required_memory_bytes(make_card()) // MIB + 1
    room_for_one = make_node_info(int(one_runner_mb * 1.5))
    first = make_instance(NODE_B, instance_id="first")
    second = make_instance(NODE_B, OTHER_CARD, instance_id="second")
    state = make_state(nodes={NODE_A: room_for_one, NODE_B: ROOMY}, instances=[first, second])

    events = events_after_node_lost(state, NODE_B)

    replaced = [e for e in events if isinstance(e, InstanceReplaced)]
    unplaced = [e for e in events if isinstance(e, InstanceUnplaced)]
    assert [e.instance.instance_id for e in replaced] == ["first"]
    assert placed_nodes(replaced[0]) == [NODE_A]
    assert [e.instance_id for e in unplaced] == ["second"]
    assert unplaced[0].reason.startswith("node node-b left; waiting for room: ")
    assert "promised to 1 runner(s) already placed there" in unplaced[0].reason
    after = apply_events(state, events)
    assert after.unavailable_instances[InstanceId("second")].waiting_for_room
    # A is not overcommitted: what it reported covers what its runners were promised.
    room = placement_room(after)[NODE_A]
    assert room.promised_bytes <= room.reported_bytes


def test_a_node_running_the_model_gets_no_second_copy_of_it() -> None:
    # Two instances of one model, one per node; B leaves. A could hold a second copy, but
    # it would share A's cores with the first: the lost one waits, the first serves.
    first = make_instance(NODE_A, instance_id="first")
    second = make_instance(NODE_B, instance_id="second")
    state = make_state(nodes={NODE_A: ROOMY, NODE_B: ROOMY}, instances=[first, second])

    events = events_after_node_lost(state, NODE_B)

    assert not [e for e in events if isinstance(e, InstanceReplaced)]
    [unplaced] = [e for e in events if isinstance(e, InstanceUnplaced)]
    assert unplaced.instance_id == "second"
    assert unplaced.reason == (
        f"node node-b left; waiting for room: node-a runs instance first of {first.model_id}, "
        "and a second copy on a node shares its cores and serves no faster (requests go to "
        "that instance meanwhile)"
    )
    state = apply_events(state, events)
    assert replacements_for_waiting(state) == []
    # B comes back: the waiting instance goes there, not next to the first.
    back = apply_event(state, NodeRejoined(node_id=NODE_B))
    [replaced] = replacements_for_waiting(back)
    assert placed_nodes(replaced) == [NODE_B]
    # Or the first instance is deleted: the wish is placed on A after all.
    deleted = apply_event(
        state, InstanceDeleted(instance_id=InstanceId("first"), command_id=CommandId("d"))
    )
    [replaced] = replacements_for_waiting(deleted)
    assert placed_nodes(replaced) == [NODE_A]


def test_instances_that_lost_the_same_node_spread_over_the_nodes_left() -> None:
    # Three nodes; both instances span B. Each goes where the other does not run.
    one = make_instance([NODE_A, NODE_B], instance_id="one")
    two = make_instance([NODE_B, NODE_C], instance_id="two")
    state = make_state(nodes={NODE_A: ROOMY, NODE_B: ROOMY, NODE_C: ROOMY}, instances=[one, two])

    events = events_after_node_lost(state, NODE_B)

    replaced = {
        e.instance.instance_id: placed_nodes(e) for e in events if isinstance(e, InstanceReplaced)
    }
    assert replaced == {"one": [NODE_A], "two": [NODE_C]}


def test_replacement_nodes_ignore_instances_that_run_nowhere() -> None:
    waiting = make_instance(NODE_A, instance_id="waiting")
    lost = make_instance(NODE_B, instance_id="lost")
    state = make_state(nodes={NODE_A: ROOMY, NODE_B: ROOMY}, instances=[waiting, lost])
    state = apply_event(
        state, InstanceUnplaced(instance_id=InstanceId("waiting"), reason="waiting for room: x")
    )
    # Another model on A does not count either.
    other = make_instance(NODE_A, OTHER_CARD, instance_id="other")
    state = state.model_copy(update={"instances": {**state.instances, other.instance_id: other}})
    assert replacement_nodes(state, lost) == ([NODE_A, NODE_B], {})


def test_a_returning_node_running_the_model_does_not_take_back_a_copy() -> None:
    # The lost instance fetches its files on A; B came back holding them, but an instance
    # of the same model was placed on B meanwhile: moving there would double the model.
    state = _rejoined(_lost_and_re_placed(_holding(NODE_B)))
    assert [e for e in replacements_nearer_files(state) if isinstance(e, InstanceReplaced)]
    placed_on_b = make_instance(NODE_B, instance_id="placed-on-b")
    state = state.model_copy(
        update={"instances": {**state.instances, placed_on_b.instance_id: placed_on_b}}
    )
    assert replacements_nearer_files(state) == []
