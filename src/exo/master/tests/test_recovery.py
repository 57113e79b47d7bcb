"""Node loss and recovery decisions, and routing among instances, on built states."""

from exo.master.decisions import choose_instance, events_for_command
from exo.master.recovery import (
    connectivity_events,
    events_after_node_lost,
    replacements_for_waiting,
    replacements_nearer_files,
)
from exo.shared.apply import apply_event
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import GenerateText, PlaceInstance
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.events import (
    CommandRejected,
    Event,
    InstanceCreated,
    InstanceReplaced,
    InstanceUnplaced,
    NodeLost,
    NodeRejoined,
    RunnerStatusUpdated,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.nodes import DownloadCompleted, DownloadStatus
from exo.shared.types.runners import RunnerReady
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskFailed
from exo.testing.builders import (
    make_card,
    make_instance,
    make_node_info,
    make_params,
    make_state,
    make_text_generation_task,
)

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
ROOMY = make_node_info(4096)
CRAMPED = make_node_info(10)


def apply_events(state: State, events: list[Event]) -> State:
    for event in events:
        state = apply_event(state, event)
    return state


def test_a_lost_node_fails_its_requests_and_its_instance_is_placed_again_on_a_survivor() -> None:
    lost = make_instance(NODE_A, instance_id="lost")
    kept = make_instance(NODE_B, instance_id="kept")
    state = make_state(
        nodes={NODE_A: ROOMY, NODE_B: ROOMY, NODE_C: ROOMY},
        instances=[lost, kept],
        tasks=[
            make_text_generation_task(instance_id="lost", task_id="on-lost"),
            make_text_generation_task(instance_id="kept", task_id="on-kept"),
        ],
        last_event_applied_idx=6,
    )
    events = events_after_node_lost(state, NODE_A)
    assert events[0] == NodeLost(node_id=NODE_A)
    [failed] = [e for e in events if isinstance(e, TaskStatusUpdated)]
    assert failed.task_id == "on-lost" and isinstance(failed.status, TaskFailed)
    assert "instance lost of" in failed.status.error_message
    assert "is unavailable: node node-a left; re-placing" in failed.status.error_message
    [replaced] = [e for e in events if isinstance(e, InstanceReplaced)]
    moved = replaced.instance
    # Same wish (id, model, sharding), new runners on a node that remains.
    assert moved.instance_id == "lost" and moved.model_id == lost.model_id
    assert set(moved.shard_assignments.node_to_runner) <= {NODE_B, NODE_C}
    assert set(moved.shard_assignments.runner_to_shard).isdisjoint(
        lost.shard_assignments.runner_to_shard
    )
    assert replaced.reason.startswith("node node-a left; re-placed on node-")

    after = apply_events(state, events)
    assert after.unavailable_instances.keys() == {"lost"}
    assert set(after.tasks) == {"on-kept"}
    # Requests go to the healthy instance meanwhile; none to the one loading again.
    assert choose_instance(after, lost.model_id) == kept
    # Once its new runner is ready it serves again.
    node = next(iter(moved.shard_assignments.node_to_runner))
    ready = apply_event(
        after,
        RunnerStatusUpdated(
            runner_id=moved.shard_assignments.rank_zero_runner(), node_id=node, status=RunnerReady()
        ),
    )
    assert ready.unavailable_instances == {}


def test_a_tensor_instance_stays_tensor_when_placed_again() -> None:
    card = make_card(supports_tensor=True)
    pair = make_instance([NODE_A, NODE_B], card, "tensor", "pair")
    state = make_state(nodes={NODE_A: ROOMY, NODE_B: ROOMY, NODE_C: ROOMY}, instances=[pair])
    [replaced] = [
        e for e in events_after_node_lost(state, NODE_B) if isinstance(e, InstanceReplaced)
    ]
    assert replaced.instance.sharding == "tensor"
    assert NODE_B not in replaced.instance.shard_assignments.node_to_runner


def test_without_room_the_instance_waits_with_its_reason_and_is_placed_when_room_appears() -> None:
    lost = make_instance(NODE_A, instance_id="lost")
    state = make_state(nodes={NODE_A: ROOMY, NODE_B: CRAMPED}, instances=[lost])
    events = events_after_node_lost(state, NODE_A)
    [unplaced] = [e for e in events if isinstance(e, InstanceUnplaced)]
    assert unplaced.reason.startswith("node node-a left; waiting for room: ")
    assert "MiB" in unplaced.reason
    state = apply_events(state, events)
    waiting = state.unavailable_instances[InstanceId("lost")]
    assert waiting.waiting_for_room and waiting.reason == unplaced.reason
    assert replacements_for_waiting(state) == []
    # A request names the reason, with a 503.
    [rejected] = events_for_command(
        state,
        NODE_B,
        GenerateText(command_id=CommandId("c"), params=make_params()),
        load_builtin_cards(),
    )
    assert isinstance(rejected, CommandRejected) and rejected.status_code == 503
    assert rejected.reason == (
        f"instance lost of {lost.model_id} is unavailable: {unplaced.reason}"
    )
    # A node with room joins: the wish is fulfilled there.
    state = state.model_copy(update={"node_info": {**state.node_info, NODE_C: ROOMY}})
    [replaced] = replacements_for_waiting(state)
    assert isinstance(replaced, InstanceReplaced)
    assert list(replaced.instance.shard_assignments.node_to_runner) == [NODE_C]
    assert replaced.reason.startswith("node node-a left; re-placed on node-c")


def test_links_decide_losses_and_returns() -> None:
    state = make_state(nodes={NODE_A: ROOMY, NODE_B: ROOMY, NODE_C: ROOMY})
    # B was heard from and its link is gone: lost at once. C was never heard from: only
    # after the grace of a new master.
    events = connectivity_events(state, NODE_A, set(), {NODE_B}, grace_over=False)
    assert events == [NodeLost(node_id=NODE_B)]
    state = apply_events(state, events)
    assert connectivity_events(state, NODE_A, set(), {NODE_B}, grace_over=True) == [
        NodeLost(node_id=NODE_C)
    ]
    assert connectivity_events(state, NODE_A, {NODE_B, NODE_C}, {NODE_B}, grace_over=True) == [
        NodeRejoined(node_id=NODE_B)
    ]


def test_placements_skip_lost_nodes() -> None:
    state = apply_event(make_state(nodes={NODE_A: ROOMY, NODE_B: ROOMY}), NodeLost(node_id=NODE_A))
    cards = load_builtin_cards()
    model = make_params().model
    on_lost = PlaceInstance(command_id=CommandId("c1"), model_id=model, node_ids=(NODE_A,))
    [refused] = events_for_command(state, NODE_B, on_lost, cards)
    assert isinstance(refused, CommandRejected) and "node-a left the cluster" in refused.reason
    anywhere = PlaceInstance(command_id=CommandId("c2"), model_id=model, min_nodes=1)
    [created] = events_for_command(state, NODE_B, anywhere, cards)
    assert isinstance(created, InstanceCreated)
    assert list(created.instance.shard_assignments.node_to_runner) == [NODE_B]


def test_equally_idle_instances_share_sequential_requests_and_busy_ones_get_fewer() -> None:
    one = make_instance(NODE_A, instance_id="one")
    two = make_instance(NODE_B, instance_id="two")
    runners = {
        RunnerId("one-rank0"): (NODE_A, RunnerReady()),
        RunnerId("two-rank0"): (NODE_B, RunnerReady()),
    }
    idle = make_state(instances=[one, two], runners=runners)
    chosen = [choose_instance(idle, one.model_id, CommandId(f"command-{i}")) for i in range(40)]
    counts = {
        instance_id: sum(c is not None and c.instance_id == instance_id for c in chosen)
        for instance_id in ("one", "two")
    }
    print(f"40 sequential requests over two idle instances: {counts}")
    assert counts["one"] > 5 and counts["two"] > 5
    # The same command always goes to the same instance (any master decides the same).
    assert choose_instance(idle, one.model_id, CommandId("command-7")) == chosen[7]
    busy = make_state(
        instances=[one, two],
        runners=runners,
        tasks=[make_text_generation_task(instance_id="one", task_id="queued")],
    )
    for i in range(10):
        command = GenerateText(command_id=CommandId(f"c-{i}"), params=make_params())
        [created] = events_for_command(busy, NODE_A, command, load_builtin_cards())
        assert isinstance(created, TaskCreated) and created.task.instance_id == "two"


def _holding(*nodes: NodeId) -> dict[NodeId, dict[ModelId, DownloadStatus]]:
    """Downloads: each of `nodes` reported the default model's files complete."""
    model = make_params().model
    return {node: {model: DownloadCompleted(path=f"/models/{node}")} for node in nodes}


def _lost_and_re_placed(downloads: dict[NodeId, dict[ModelId, DownloadStatus]]) -> State:
    """B ran the instance and left; the master placed it again on A (the only node left),
    whose runner now waits for the files."""
    lost = make_instance(NODE_B, instance_id="lost")
    state = make_state(
        nodes={NODE_A: ROOMY, NODE_B: ROOMY},
        instances=[lost],
        downloads=downloads,
        last_event_applied_idx=6,
    )
    state = apply_events(state, events_after_node_lost(state, NODE_B))
    assert list(state.instances[InstanceId("lost")].shard_assignments.node_to_runner) == [NODE_A]
    return state


def _rejoined(state: State) -> State:
    """`state` after B's return, as the master holds it: the events of the loss and the
    return applied (indexed: each took the next index, which re-placements tag runners
    with)."""
    back = apply_events(state, [NodeRejoined(node_id=NODE_B)])
    return back.model_copy(update={"last_event_applied_idx": state.last_event_applied_idx + 5})


def test_a_returning_node_holding_the_files_takes_back_an_instance_still_fetching_them() -> None:
    state = _lost_and_re_placed(_holding(NODE_B))
    # While B is gone nothing better exists: A stays.
    assert replacements_nearer_files(state) == []
    back = _rejoined(state)
    [replaced] = replacements_nearer_files(back)
    assert isinstance(replaced, InstanceReplaced)
    moved = replaced.instance
    assert list(moved.shard_assignments.node_to_runner) == [NODE_B]
    before = back.instances[InstanceId("lost")].shard_assignments.runner_to_shard
    assert set(moved.shard_assignments.runner_to_shard).isdisjoint(before)
    assert replaced.reason == "node node-b left; re-placed on node-b (holding its files), loading"
    after = apply_events(back, [replaced])
    assert after.unavailable_instances[InstanceId("lost")].reason == replaced.reason
    # Settled: every node of it holds the files, so it never moves again.
    assert replacements_nearer_files(after) == []


def test_an_instance_whose_nodes_hold_the_files_or_none_that_do_stays() -> None:
    # A holds the files too: its load is under way, B's return changes nothing.
    both = apply_events(
        _lost_and_re_placed(_holding(NODE_A, NODE_B)), [NodeRejoined(node_id=NODE_B)]
    )
    assert replacements_nearer_files(both) == []
    # Nobody holds them: B back would have to fetch them as A does.
    neither = apply_events(_lost_and_re_placed({}), [NodeRejoined(node_id=NODE_B)])
    assert replacements_nearer_files(neither) == []
    # Serving already (no longer unavailable): a running instance is never moved.
    state = _lost_and_re_placed(_holding(NODE_B))
    moved = state.instances[InstanceId("lost")]
    ready = apply_events(
        state,
        [
            NodeRejoined(node_id=NODE_B),
            RunnerStatusUpdated(
                runner_id=moved.shard_assignments.rank_zero_runner(),
                node_id=NODE_A,
                status=RunnerReady(),
            ),
        ],
    )
    assert ready.unavailable_instances == {}
    assert replacements_nearer_files(ready) == []


def test_an_instance_waiting_for_room_is_left_to_the_room_decision() -> None:
    lost = make_instance(NODE_B, instance_id="lost")
    state = make_state(
        nodes={NODE_A: CRAMPED, NODE_B: ROOMY}, instances=[lost], downloads=_holding(NODE_B)
    )
    state = apply_events(state, events_after_node_lost(state, NODE_B))
    assert state.unavailable_instances[InstanceId("lost")].waiting_for_room
    back = _rejoined(state)
    assert replacements_nearer_files(back) == []
    [replaced] = replacements_for_waiting(back)
    assert isinstance(replaced, InstanceReplaced)
    assert list(replaced.instance.shard_assignments.node_to_runner) == [NODE_B]
