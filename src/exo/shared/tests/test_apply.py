from typing import get_args

import pytest

from exo.master.main import MAX_INSTANCE_FAILURES, failed_instances
from exo.shared.apply import EventOutOfOrderError, apply, apply_all, origin_key
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
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
from exo.shared.types.nodes import DownloadCompleted, DownloadOngoing, TopologyEdge
from exo.shared.types.runners import (
    RunnerFailed,
    RunnerIdle,
    RunnerReady,
    RunnerShutdown,
    RunnerStatus,
)
from exo.shared.types.state import CommandOutcome, InstanceUsage, State
from exo.shared.types.tasks import (
    TaskCancelled,
    TaskComplete,
    TaskFailed,
    TaskPending,
    TaskRunning,
    TaskStatus,
)
from exo.testing.builders import (
    SMOLLM2,
    indexed,
    make_card,
    make_instance,
    make_node_info,
    make_state,
    make_text_generation_task,
)

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
RUNNER = RunnerId("instance-1-rank0")
INSTANCE = make_instance(NODE_A, instance_id="instance-1")
OTHER_INSTANCE = make_instance(NODE_B, instance_id="instance-2")
CUSTOM_CARD = make_card(model_id="someone/tiny-llama")


def edge(source: NodeId, sink: NodeId, latency_ms: float = 1.0) -> TopologyEdge:
    return TopologyEdge(
        source=source,
        sink=sink,
        address=f"10.0.0.{sink[-1]}",
        latency_ms=latency_ms,
        bandwidth_mbps=1000.0,
    )


# One event of every type, applied to `populated_state()`; a new event type without a
# sample fails `test_every_event_type_has_a_sample`.
SAMPLE_EVENTS: dict[type, Event] = {
    InstanceCreated: InstanceCreated(instance=OTHER_INSTANCE, command_id=CommandId("c-1")),
    InstanceDeleted: InstanceDeleted(instance_id=INSTANCE.instance_id),
    InstanceUsed: InstanceUsed(
        instance_id=INSTANCE.instance_id, used_at=1_700_000_000.0, keep_alive_seconds=300.0
    ),
    TaskCreated: TaskCreated(task=make_text_generation_task(task_id="task-new")),
    TaskStatusUpdated: TaskStatusUpdated(task_id=TaskId("task-1"), status=TaskRunning()),
    RunnerStatusUpdated: RunnerStatusUpdated(
        runner_id=RUNNER, node_id=NODE_A, status=RunnerReady()
    ),
    RunnerDeleted: RunnerDeleted(runner_id=RUNNER),
    NodeGatheredInfo: NodeGatheredInfo(node_id=NODE_B, info=make_node_info(2048)),
    NodeDownloadProgress: NodeDownloadProgress(
        node_id=NODE_A, model_id=SMOLLM2, status=DownloadOngoing(message="3/10 files")
    ),
    CommandRejected: CommandRejected(
        command_id=CommandId("c-2"), origin=NODE_A, reason="no", status_code=404
    ),
    ClusterHistoryStarted: ClusterHistoryStarted(history_id="history-2", master=NODE_B),
    NodeTimedOut: NodeTimedOut(node_id=NODE_A),
    TopologyEdgeMeasured: TopologyEdgeMeasured(edge=edge(NODE_A, NODE_B, latency_ms=9.0)),
    TopologyEdgeRemoved: TopologyEdgeRemoved(source=NODE_A, sink=NODE_B),
    CustomModelAdded: CustomModelAdded(card=CUSTOM_CARD, command_id=CommandId("c-3")),
    CustomModelDeleted: CustomModelDeleted(model_id=CUSTOM_CARD.model_id),
    DownloadControlled: DownloadControlled(node_id=NODE_A, card=CUSTOM_CARD, action="start"),
    NodeLost: NodeLost(node_id=NODE_A),
    NodeRejoined: NodeRejoined(node_id=NODE_A),
    InstanceReplaced: InstanceReplaced(
        instance=make_instance(NODE_B, instance_id="instance-1", runner_tag="r5"),
        reason="node node-a left; re-placed on node-b",
    ),
    InstanceUnplaced: InstanceUnplaced(
        instance_id=INSTANCE.instance_id, reason="node node-a left; waiting for room"
    ),
    StateSnapshot: StateSnapshot(
        state=make_state(nodes={NODE_C: make_node_info(512)}, last_event_applied_idx=5)
    ),
    InstanceReported: InstanceReported(
        node_id=NODE_C,
        instance=make_instance(NODE_C, instance_id="instance-3"),
        runners={RunnerId("instance-3-rank0"): RunnerReady()},
    ),
}


def populated_state(last_event_applied_idx: int = 4) -> State:
    return make_state(
        nodes={NODE_A: make_node_info(1024)},
        instances=[INSTANCE],
        tasks=[
            make_text_generation_task(task_id="task-1"),
            make_text_generation_task(task_id="task-2"),
        ],
        runners={RUNNER: (NODE_A, RunnerIdle())},
        downloads={NODE_A: {SMOLLM2: DownloadOngoing()}},
        last_event_applied_idx=last_event_applied_idx,
    ).model_copy(
        update={
            "topology": {
                NODE_A: {NODE_B: edge(NODE_A, NODE_B)},
                NODE_B: {NODE_A: edge(NODE_B, NODE_A)},
            },
            "history_id": "history-1",
        }
    )


def apply_one(state: State, event: Event) -> State:
    return apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))


def test_every_event_type_has_a_sample() -> None:
    members = set(get_args(get_args(Event)[0]))
    assert members == set(SAMPLE_EVENTS)


@pytest.mark.parametrize("event", SAMPLE_EVENTS.values(), ids=lambda e: type(e).__name__)
def test_apply_never_mutates_its_input(event: Event) -> None:
    state = populated_state()
    before = state.model_dump()
    new_state = apply_one(state, event)
    assert state.model_dump() == before
    assert new_state.last_event_applied_idx == 5


def test_instance_created_adds_the_instance() -> None:
    event = SAMPLE_EVENTS[InstanceCreated]
    state = apply_one(populated_state(), event)
    assert state.instances == {
        INSTANCE.instance_id: INSTANCE,
        OTHER_INSTANCE.instance_id: OTHER_INSTANCE,
    }


def test_instance_used_records_the_use_and_the_keep_alive_until_the_instance_goes() -> None:
    used = apply_one(populated_state(), SAMPLE_EVENTS[InstanceUsed])
    assert used.instance_usage == {
        INSTANCE.instance_id: InstanceUsage(last_used_at=1_700_000_000.0, keep_alive_seconds=300.0)
    }
    forever = InstanceUsed(instance_id=INSTANCE.instance_id, used_at=5.0, keep_alive_seconds=None)
    assert apply_one(used, forever).instance_usage[INSTANCE.instance_id].keep_alive_seconds is None
    # A use of an instance the state no longer holds changes nothing.
    gone = InstanceUsed(instance_id=InstanceId("gone"), used_at=5.0, keep_alive_seconds=1.0)
    assert apply_one(used, gone).instance_usage == used.instance_usage
    deleted = apply_one(used, InstanceDeleted(instance_id=INSTANCE.instance_id))
    assert deleted.instance_usage == {}
    timed_out = apply_one(used, NodeTimedOut(node_id=NODE_A))
    assert timed_out.instance_usage == {}


def test_instance_deleted_removes_the_instance_and_only_its_tasks() -> None:
    other_task = make_text_generation_task(instance_id="instance-2", task_id="task-3")
    state = populated_state().model_copy(
        update={
            "instances": {**populated_state().instances, OTHER_INSTANCE.instance_id: OTHER_INSTANCE}
        }
    )
    state = apply_one(state, TaskCreated(task=other_task))
    state = apply_one(state, InstanceDeleted(instance_id=INSTANCE.instance_id))
    assert list(state.instances) == [InstanceId("instance-2")]
    assert list(state.tasks) == [TaskId("task-3")]
    # The runners' statuses go with the instance; their later reports are ignored.
    assert state.runners == {} and state.runner_nodes == {}
    shutdown = RunnerStatusUpdated(runner_id=RUNNER, node_id=NODE_A, status=RunnerShutdown())
    assert apply_one(state, shutdown).runners == {}


def test_deleting_an_unknown_instance_changes_nothing_but_the_index() -> None:
    state = populated_state()
    new_state = apply_one(state, InstanceDeleted(instance_id=InstanceId("nope")))
    assert new_state == state.model_copy(update={"last_event_applied_idx": 5})


def test_task_created_keeps_creation_order() -> None:
    state = apply_one(populated_state(), SAMPLE_EVENTS[TaskCreated])
    assert list(state.tasks) == [TaskId("task-1"), TaskId("task-2"), TaskId("task-new")]
    assert state.tasks[TaskId("task-new")].status == TaskPending()


@pytest.mark.parametrize("status", [TaskRunning(), TaskPending()], ids=lambda s: s.kind)
def test_non_terminal_task_status_updates_the_task(status: TaskStatus) -> None:
    state = apply_one(populated_state(), TaskStatusUpdated(task_id=TaskId("task-1"), status=status))
    assert state.tasks[TaskId("task-1")].status == status
    assert state.tasks[TaskId("task-2")].status == TaskPending()
    assert list(state.tasks) == [TaskId("task-1"), TaskId("task-2")]


@pytest.mark.parametrize(
    "status",
    [TaskComplete(), TaskFailed(error_message="out of memory"), TaskCancelled()],
    ids=lambda s: s.kind,
)
def test_terminal_task_status_removes_the_task(status: TaskStatus) -> None:
    state = apply_one(populated_state(), TaskStatusUpdated(task_id=TaskId("task-1"), status=status))
    assert list(state.tasks) == [TaskId("task-2")]


def test_status_of_an_unknown_task_is_a_no_op() -> None:
    state = populated_state()
    event = TaskStatusUpdated(task_id=TaskId("gone"), status=TaskRunning())
    assert apply_one(state, event) == state.model_copy(update={"last_event_applied_idx": 5})


def test_runner_status_updated_records_status_and_node() -> None:
    new_runner = RunnerId("instance-2-rank0")
    both = populated_state().model_copy(
        update={"instances": {INSTANCE.instance_id: INSTANCE, "instance-2": OTHER_INSTANCE}}
    )
    state = apply_one(
        both, RunnerStatusUpdated(runner_id=new_runner, node_id=NODE_B, status=RunnerReady())
    )
    assert state.runners == {RUNNER: RunnerIdle(), new_runner: RunnerReady()}
    assert state.runner_nodes == {RUNNER: NODE_A, new_runner: NODE_B}
    state = apply_one(
        state, RunnerStatusUpdated(runner_id=RUNNER, node_id=NODE_A, status=RunnerReady())
    )
    assert state.runners[RUNNER] == RunnerReady()


def test_runner_deleted_removes_status_and_node() -> None:
    state = apply_one(populated_state(), RunnerDeleted(runner_id=RUNNER))
    assert state.runners == {}
    assert state.runner_nodes == {}
    unchanged = apply_one(state, RunnerDeleted(runner_id=RunnerId("unknown")))
    assert unchanged == state.model_copy(update={"last_event_applied_idx": 6})


def test_node_gathered_info_adds_or_replaces_the_node() -> None:
    state = apply_one(populated_state(), NodeGatheredInfo(node_id=NODE_B, info=make_node_info(7)))
    assert state.node_info == {NODE_A: make_node_info(1024), NODE_B: make_node_info(7)}
    state = apply_one(state, NodeGatheredInfo(node_id=NODE_A, info=make_node_info(3)))
    assert state.node_info[NODE_A].memory.available_bytes == 3 * 2**20


def test_node_download_progress_is_per_node_and_model() -> None:
    other_model = ModelId("other/model")
    state = populated_state()
    state = apply_one(
        state,
        NodeDownloadProgress(node_id=NODE_A, model_id=SMOLLM2, status=DownloadCompleted(path="/m")),
    )
    state = apply_one(
        state, NodeDownloadProgress(node_id=NODE_A, model_id=other_model, status=DownloadOngoing())
    )
    state = apply_one(
        state, NodeDownloadProgress(node_id=NODE_B, model_id=SMOLLM2, status=DownloadOngoing())
    )
    assert state.downloads == {
        NODE_A: {SMOLLM2: DownloadCompleted(path="/m"), other_model: DownloadOngoing()},
        NODE_B: {SMOLLM2: DownloadOngoing()},
    }


def test_command_rejected_changes_nothing_but_the_index_and_its_outcome() -> None:
    state = populated_state()
    rejection = SAMPLE_EVENTS[CommandRejected]
    assert isinstance(rejection, CommandRejected)
    new_state = apply_one(state, rejection)
    outcome = CommandOutcome(
        event_idx=5,
        kind="CommandRejected",
        origin=rejection.origin,
        reason=rejection.reason,
        status_code=rejection.status_code,
    )
    assert new_state == state.model_copy(
        update={"last_event_applied_idx": 5, "command_outcomes": {rejection.command_id: outcome}}
    )


def test_apply_all_from_empty_sets_last_index() -> None:
    events: list[Event] = [
        NodeGatheredInfo(node_id=NODE_A, info=make_node_info(1024)),
        InstanceCreated(instance=INSTANCE),
        TaskCreated(task=make_text_generation_task()),
    ]
    state = apply_all(State(), indexed(events))
    assert state.last_event_applied_idx == 2
    assert list(state.instances) == [INSTANCE.instance_id]
    assert list(state.tasks) == [TaskId("task-1")]


@pytest.mark.parametrize("idx", [0, 4, 6, 100])
def test_out_of_order_index_raises(idx: int) -> None:
    state = populated_state(last_event_applied_idx=4)
    with pytest.raises(EventOutOfOrderError, match=f"expected event 5, got {idx}"):
        apply(state, IndexedEvent(idx=idx, event=SAMPLE_EVENTS[CommandRejected]))


def test_first_event_must_have_index_zero() -> None:
    with pytest.raises(EventOutOfOrderError):
        apply(State(), IndexedEvent(idx=1, event=SAMPLE_EVENTS[CommandRejected]))
    first = apply(State(), IndexedEvent(idx=0, event=SAMPLE_EVENTS[CommandRejected]))
    assert first.last_event_applied_idx == 0


def test_cluster_history_started_names_the_history() -> None:
    state = apply(State(), IndexedEvent(idx=0, event=SAMPLE_EVENTS[ClusterHistoryStarted]))
    assert state == State(history_id="history-2", last_event_applied_idx=0)


def test_node_timed_out_removes_everything_of_the_node_only() -> None:
    instance_b = make_instance(NODE_B, instance_id="instance-b")
    shared = make_instance([NODE_B, NODE_C], instance_id="instance-bc")
    instance_c = make_instance(NODE_C, instance_id="instance-c")
    runner_b = RunnerId("instance-b-rank0")
    runner_c = RunnerId("instance-c-rank0")
    state = make_state(
        nodes={NODE_A: make_node_info(1), NODE_B: make_node_info(2), NODE_C: make_node_info(3)},
        instances=[instance_b, shared, instance_c],
        tasks=[
            make_text_generation_task(instance_id="instance-b", task_id="task-b"),
            make_text_generation_task(instance_id="instance-bc", task_id="task-bc"),
            make_text_generation_task(instance_id="instance-c", task_id="task-c"),
        ],
        runners={runner_b: (NODE_B, RunnerReady()), runner_c: (NODE_C, RunnerReady())},
        downloads={NODE_B: {SMOLLM2: DownloadOngoing()}, NODE_C: {SMOLLM2: DownloadOngoing()}},
    ).model_copy(
        update={
            "topology": {
                NODE_A: {NODE_B: edge(NODE_A, NODE_B), NODE_C: edge(NODE_A, NODE_C)},
                NODE_B: {NODE_A: edge(NODE_B, NODE_A), NODE_C: edge(NODE_B, NODE_C)},
                NODE_C: {NODE_B: edge(NODE_C, NODE_B)},
            }
        }
    )
    after = apply_one(state, NodeTimedOut(node_id=NODE_B))
    assert list(after.node_info) == [NODE_A, NODE_C]
    assert list(after.downloads) == [NODE_C]
    # Edges from and to B go; C's only edge was to B, so C has no entry left.
    assert after.topology == {NODE_A: {NODE_C: edge(NODE_A, NODE_C)}}
    assert list(after.instances) == [InstanceId("instance-c")]
    assert list(after.tasks) == [TaskId("task-c")]
    assert after.runners == {runner_c: RunnerReady()}
    assert after.runner_nodes == {runner_c: NODE_C}


def test_timing_out_an_unknown_node_changes_nothing_but_the_index() -> None:
    state = populated_state()
    new_state = apply_one(state, NodeTimedOut(node_id=NODE_C))
    assert new_state == state.model_copy(update={"last_event_applied_idx": 5})


def test_topology_edge_measured_adds_or_replaces_one_direction() -> None:
    state = apply_one(populated_state(), TopologyEdgeMeasured(edge=edge(NODE_A, NODE_C)))
    state = apply_one(state, SAMPLE_EVENTS[TopologyEdgeMeasured])
    assert state.topology == {
        NODE_A: {NODE_B: edge(NODE_A, NODE_B, latency_ms=9.0), NODE_C: edge(NODE_A, NODE_C)},
        NODE_B: {NODE_A: edge(NODE_B, NODE_A)},
    }


def test_topology_edge_removed_drops_one_direction_and_empty_sources() -> None:
    state = apply_one(populated_state(), SAMPLE_EVENTS[TopologyEdgeRemoved])
    assert state.topology == {NODE_B: {NODE_A: edge(NODE_B, NODE_A)}}
    unchanged = apply_one(state, TopologyEdgeRemoved(source=NODE_A, sink=NODE_B))
    assert unchanged == state.model_copy(update={"last_event_applied_idx": 6})


def test_local_event_progress_follows_the_origin_of_each_session() -> None:
    event = SAMPLE_EVENTS[CommandRejected]
    state = apply(State(), IndexedEvent(idx=0, event=event))
    assert state.local_event_progress == {}
    steps = [("session-1", 0), ("session-1", 1), ("session-2", 0), ("session-1", 2)]
    for idx, (session, origin_idx) in enumerate(steps, start=1):
        state = apply(
            state,
            IndexedEvent(
                idx=idx, event=event, origin=NODE_A, origin_session=session, origin_idx=origin_idx
            ),
        )
    state = apply(
        state, IndexedEvent(idx=5, event=event, origin=NODE_B, origin_session="s", origin_idx=7)
    )
    assert state.local_event_progress == {
        origin_key(NODE_A, "session-1"): 2,
        origin_key(NODE_A, "session-2"): 0,
        origin_key(NODE_B, "s"): 7,
    }


def test_runner_failures_count_against_their_instance_until_it_is_ready() -> None:
    two_ranks = make_instance([NodeId("n0"), NodeId("n1")], instance_id="pair")
    rank0, rank1 = RunnerId("pair-rank0"), RunnerId("pair-rank1")
    state = apply_all(State(), indexed([InstanceCreated(instance=two_ranks)]))

    def report(state: State, runner: RunnerId, status: RunnerStatus) -> State:
        event = RunnerStatusUpdated(runner_id=runner, node_id=NodeId("n0"), status=status)
        return apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))

    state = report(state, rank0, RunnerFailed(error_message="x"))
    state = report(state, rank1, RunnerFailed(error_message="x"))
    assert state.instance_failures == {two_ranks.instance_id: 2}
    assert failed_instances(state, 0.0) == []
    state = report(state, rank0, RunnerReady())  # one rank ready is not the instance ready
    assert state.instance_failures == {two_ranks.instance_id: 2}
    state = report(state, rank1, RunnerReady())
    assert state.instance_failures == {}
    for _ in range(MAX_INSTANCE_FAILURES):
        state = report(state, rank1, RunnerFailed(error_message="x"))
    [deleted] = failed_instances(state, 0.0)
    assert isinstance(deleted, InstanceDeleted) and deleted.instance_id == two_ranks.instance_id
    state = apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=deleted))
    assert state.instance_failures == {}


def test_custom_model_added_joins_the_state_and_replaces_an_earlier_card() -> None:
    state = apply_one(populated_state(), SAMPLE_EVENTS[CustomModelAdded])
    assert state.custom_cards == {CUSTOM_CARD.model_id: CUSTOM_CARD}
    newer = CUSTOM_CARD.model_copy(update={"context_length": 4096})
    state = apply_one(state, CustomModelAdded(card=newer))
    assert state.custom_cards == {CUSTOM_CARD.model_id: newer}


def test_custom_model_deleted_leaves_other_custom_models() -> None:
    other = make_card(model_id="someone/other")
    state = apply_one(populated_state(), SAMPLE_EVENTS[CustomModelAdded])
    state = apply_one(state, CustomModelAdded(card=other))
    state = apply_one(state, SAMPLE_EVENTS[CustomModelDeleted])
    assert state.custom_cards == {other.model_id: other}
    # Deleting an unknown custom model changes nothing but the index.
    again = apply_one(state, SAMPLE_EVENTS[CustomModelDeleted])
    assert again.custom_cards == state.custom_cards


def test_a_runner_of_no_instance_leaves_no_status() -> None:
    stray = RunnerStatusUpdated(
        runner_id=RunnerId("gone-rank0"), node_id=NODE_A, status=RunnerShutdown()
    )
    state = apply_one(populated_state(), stray)
    assert state.runners == populated_state().runners


def test_a_lost_node_makes_its_instances_unavailable_until_their_new_runners_are_ready() -> None:
    pair = make_instance([NODE_A, NODE_B], instance_id="pair")
    state = make_state(
        nodes={NODE_A: make_node_info(1024), NODE_B: make_node_info(1024)},
        instances=[pair, OTHER_INSTANCE],
        runners={
            RunnerId("pair-rank0"): (NODE_A, RunnerReady()),
            RunnerId("pair-rank1"): (NODE_B, RunnerReady()),
            RunnerId("instance-2-rank0"): (NODE_B, RunnerReady()),
        },
    )
    state = apply_one(state, NodeLost(node_id=NODE_A))
    assert state.lost_nodes == (NODE_A,)
    assert set(state.unavailable_instances) == {"pair"}
    assert "node-a left" in state.unavailable_instances[InstanceId("pair")].reason
    assert RunnerId("pair-rank0") not in state.runners  # a lost rank is no rank
    assert NODE_A in state.node_info  # kept until it returns or times out

    moved = make_instance(NODE_B, instance_id="pair", runner_tag="r9")
    state = apply_one(state, InstanceReplaced(instance=moved, reason="re-placed on node-b"))
    assert state.instances[InstanceId("pair")] == moved
    assert state.unavailable_instances[InstanceId("pair")].reason == "re-placed on node-b"
    # The old runners' statuses are gone, and so are their later reports.
    assert set(state.runners) == {"instance-2-rank0"}
    late = RunnerStatusUpdated(
        runner_id=RunnerId("pair-rank1"), node_id=NODE_B, status=RunnerShutdown()
    )
    assert set(apply_one(state, late).runners) == {"instance-2-rank0"}
    new_runner = moved.shard_assignments.rank_zero_runner()
    state = apply_one(
        state, RunnerStatusUpdated(runner_id=new_runner, node_id=NODE_B, status=RunnerReady())
    )
    assert state.unavailable_instances == {}

    state = apply_one(state, NodeRejoined(node_id=NODE_A))
    assert state.lost_nodes == ()


def test_an_unplaced_instance_outlives_its_lost_node_and_a_deleted_one_leaves_no_trace() -> None:
    state = make_state(
        nodes={NODE_A: make_node_info(1024), NODE_B: make_node_info(1024)},
        instances=[INSTANCE, OTHER_INSTANCE],
        runners={RUNNER: (NODE_A, RunnerReady())},
    ).model_copy(update={"instance_failures": {INSTANCE.instance_id: 2}})
    state = apply_one(state, NodeLost(node_id=NODE_A))
    state = apply_one(
        state, InstanceUnplaced(instance_id=INSTANCE.instance_id, reason="waiting for room")
    )
    assert state.unavailable_instances[INSTANCE.instance_id].waiting_for_room
    state = apply_one(state, NodeTimedOut(node_id=NODE_A))
    assert NODE_A not in state.node_info and state.lost_nodes == ()
    assert INSTANCE.instance_id in state.instances  # the wish stays
    state = apply_one(state, InstanceDeleted(instance_id=INSTANCE.instance_id))
    assert state.unavailable_instances == {} and state.instance_failures == {}
    assert list(state.instances) == [OTHER_INSTANCE.instance_id]
