"""A node's memory for a new placement: the runner process counts, and instances placed
before promise their memory until the node's report can show it."""

from __future__ import annotations

import pytest

from exo.master.decisions import events_for_command
from exo.master.placement import PlacementError, place_instance
from exo.master.placement_memory import (
    placement_room,
    required_memory_bytes,
    runner_bytes,
    runner_unallocated_bytes,
)
from exo.shared.apply import apply_event
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.kv_cache_memory import kv_cache_budget_bytes
from exo.shared.models.memory import RUNNER_PROCESS_OVERHEAD_BYTES, resident_weight_bytes
from exo.shared.models.weight_formats import ENGINE_CPU_WEIGHT_FORMAT
from exo.shared.types.commands import PlaceInstance
from exo.shared.types.common import CommandId, InstanceId, NodeId, RunnerId
from exo.shared.types.events import CommandRejected, InstanceCreated, RunnerStatusUpdated
from exo.shared.types.runners import (
    RunnerFailed,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
)
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.state import InstanceUnavailable, State
from exo.testing.builders import MIB, SMOLLM2, make_card, make_node_info, make_state

NODE = NodeId("node-a")
CARD = make_card(n_layers=12).model_copy(update={"vocab_size": 512})
NEED = required_memory_bytes(CARD)


def one_node(available_bytes: int) -> State:
    return make_state(nodes={NODE: make_node_info(available_bytes // MIB)})


def place(state: State, number: int) -> State:
    """Place CARD as instance `number` and apply the `InstanceCreated` event."""
    instance = place_instance(CARD, state, InstanceId(f"instance-{number}"))
    return apply_event(state, InstanceCreated(instance=instance))


def runner_of(state: State, number: int) -> tuple[RunnerId, ShardMetadata]:
    instance = state.instances[InstanceId(f"instance-{number}")]
    [(runner_id, shard)] = instance.shard_assignments.runner_to_shard.items()
    return runner_id, shard


def set_status(state: State, number: int, status: RunnerStatus) -> State:
    runner_id, _ = runner_of(state, number)
    event = RunnerStatusUpdated(runner_id=runner_id, node_id=NODE, status=status)
    return apply_event(state, event)


def test_the_runner_process_counts_in_what_a_node_needs() -> None:
    model_part = NEED - RUNNER_PROCESS_OVERHEAD_BYTES
    assert model_part > 0 and RUNNER_PROCESS_OVERHEAD_BYTES == 320 * MIB
    # Room for the weights and KV cache but not the process around them: refused.
    with pytest.raises(PlacementError, match=r"needs \d+ MiB but the node has \d+ MiB available"):
        place_instance(CARD, one_node(model_part + 100 * MIB), InstanceId("i"))
    instance = place_instance(CARD, one_node(NEED + MIB), InstanceId("i"))
    assert list(instance.shard_assignments.node_to_runner) == [NODE]


def test_placements_in_quick_succession_stop_when_the_node_is_full() -> None:
    # Memory for three runners and a half; the node's report never changes in between.
    reported = (3 * NEED + NEED // 2) // MIB * MIB
    state = one_node(reported)
    for number in range(3):
        state = place(state, number)
    room = placement_room(state)[NODE]
    assert (room.promised_runners, room.promised_bytes) == (3, 3 * NEED)
    left = reported - 3 * NEED
    assert room.available_bytes == left
    with pytest.raises(PlacementError) as refused:
        place(state, 3)
    message = str(refused.value)
    assert f"needs {NEED / MIB:.0f} MiB but the node has {left / MIB:.0f} MiB available" in message
    assert f"({reported / MIB:.0f} MiB free" in message
    assert f"{3 * NEED / MIB:.0f} MiB of it promised to 3 runner(s) already placed there" in (
        message
    )


def test_the_master_answers_a_placement_on_a_full_node_with_400_and_the_numbers() -> None:
    card = load_builtin_cards()[SMOLLM2]
    need = required_memory_bytes(card)
    state = make_state(nodes={NODE: make_node_info((need + need // 2) // MIB)})
    cards = {SMOLLM2: card}
    ids = iter(InstanceId(f"instance-{n}") for n in range(2))
    answers = []
    for number in range(2):
        command = PlaceInstance(command_id=CommandId(f"command-{number}"), model_id=SMOLLM2)
        [event] = events_for_command(state, NODE, command, cards, new_instance_id=lambda: next(ids))
        state = apply_event(state, event)
        answers.append(event)
    assert isinstance(answers[0], InstanceCreated)
    refused = answers[1]
    assert isinstance(refused, CommandRejected) and refused.status_code == 400
    assert f"needs {need / MIB:.0f} MiB" in refused.reason
    assert "promised to 1 runner(s) already placed there" in refused.reason


def test_a_ready_runner_promises_only_what_it_has_not_allocated() -> None:
    state = place(one_node(10 * NEED), 0)
    _, shard = runner_of(state, 0)
    assert placement_room(state)[NODE].promised_bytes == NEED
    # Loading (or failed, to be started again): still all of it.
    for status in (
        RunnerLoading(layers_loaded=3, total_layers=12),
        RunnerFailed(error_message="x"),
    ):
        assert placement_room(set_status(state, 0, status))[NODE].promised_bytes == NEED
    # Ready or running: its weights and process are in the node's report; the KV cache it
    # fills later (and the overhead fraction) is still promised.
    unallocated = runner_unallocated_bytes(shard)
    resident = resident_weight_bytes(CARD, ENGINE_CPU_WEIGHT_FORMAT)
    assert unallocated == NEED - resident - RUNNER_PROCESS_OVERHEAD_BYTES
    assert unallocated >= kv_cache_budget_bytes(CARD)
    for loaded in (RunnerReady(weight_bytes=resident), RunnerRunning()):
        assert placement_room(set_status(state, 0, loaded))[NODE].promised_bytes == unallocated
    assert runner_bytes(shard) == NEED


def test_a_re_placement_does_not_count_the_instance_it_replaces() -> None:
    state = place(one_node(NEED + NEED // 2), 0)
    with pytest.raises(PlacementError):
        place_instance(CARD, state, InstanceId("instance-other"))
    again = place_instance(CARD, state, InstanceId("instance-0"), runner_tag="r1")
    assert list(again.shard_assignments.node_to_runner) == [NODE]
    assert placement_room(state, exclude=InstanceId("instance-0"))[NODE].promised_bytes == 0


def test_an_instance_waiting_for_room_promises_nothing() -> None:
    state = place(one_node(NEED + NEED // 2), 0)
    waiting = InstanceUnavailable(reason="node x left; waiting for room", waiting_for_room=True)
    state = state.model_copy(update={"unavailable_instances": {InstanceId("instance-0"): waiting}})
    assert placement_room(state)[NODE].promised_bytes == 0
    place(state, 1)
