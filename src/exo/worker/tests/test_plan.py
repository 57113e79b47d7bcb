"""The worker's `plan`, stepped through a runner's whole life."""

from collections.abc import Mapping

import pytest

from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.nodes import (
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
    DownloadStatus,
)
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.state import InstanceUnavailable, State
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    CreateRunner,
    DownloadModel,
    LoadModel,
    Shutdown,
    StartWarmup,
    Task,
    TaskRunning,
    TextGeneration,
)
from exo.testing.builders import (
    SMOLLM2,
    make_instance,
    make_state,
    make_text_generation_task,
)
from exo.worker.plan import LocalRunner, plan

NODE = NodeId("node-a")
OTHER_NODE = NodeId("node-b")
INSTANCE = make_instance(NODE, instance_id="instance-1")
INSTANCE_ID = INSTANCE.instance_id
RUNNER = RunnerId("instance-1-rank0")
NOW = 1000.0
MODEL_DIR = "/models/smollm2"


def run_plan(
    state: State,
    runners: Mapping[RunnerId, LocalRunner] | None = None,
    downloads: Mapping[ModelId, DownloadStatus] | None = None,
    retry_after: Mapping[str, float] | None = None,
    node_id: NodeId = NODE,
) -> Task | None:
    return plan(node_id, state, runners or {}, downloads or {}, retry_after or {}, NOW)


def local(
    status: RunnerStatus,
    in_flight: tuple[str, ...] = (),
    loading: bool = False,
    instance_id: InstanceId = INSTANCE_ID,
) -> LocalRunner:
    return LocalRunner(
        instance_id=instance_id,
        status=status,
        in_flight=frozenset(TaskId(task_id) for task_id in in_flight),
        loading=loading,
    )


def task(task_id: str, instance_id: str = "instance-1") -> TextGeneration:
    return make_text_generation_task(instance_id=instance_id, task_id=task_id)


COMPLETED = {SMOLLM2: DownloadCompleted(path=MODEL_DIR)}


def test_full_lifecycle_step_by_step() -> None:
    state = make_state(instances=[INSTANCE])
    shard = INSTANCE.shard_assignments.runner_to_shard[RUNNER]

    assert run_plan(state) == CreateRunner(instance_id=INSTANCE_ID, runner_id=RUNNER)
    idle = {RUNNER: local(RunnerIdle())}
    assert run_plan(state, idle) == DownloadModel(instance_id=INSTANCE_ID, shard=shard)
    assert run_plan(state, idle, {SMOLLM2: DownloadPending()}) is None
    assert run_plan(state, idle, {SMOLLM2: DownloadOngoing(message="2/5")}) is None
    assert run_plan(state, idle, COMPLETED) == LoadModel(
        instance_id=INSTANCE_ID, runner_id=RUNNER, model_dir=MODEL_DIR
    )
    # LoadModel sent, the runner has not reported yet.
    assert run_plan(state, {RUNNER: local(RunnerIdle(), loading=True)}, COMPLETED) is None
    loading = {RUNNER: local(RunnerLoading(layers_loaded=3, total_layers=30))}
    assert run_plan(state, loading, COMPLETED) is None
    assert run_plan(state, {RUNNER: local(RunnerLoaded())}, COMPLETED) == StartWarmup(
        instance_id=INSTANCE_ID, runner_id=RUNNER
    )
    assert run_plan(state, {RUNNER: local(RunnerLoaded(), loading=True)}, COMPLETED) is None
    assert run_plan(state, {RUNNER: local(RunnerWarmingUp())}, COMPLETED) is None
    assert run_plan(state, {RUNNER: local(RunnerReady())}, COMPLETED) is None

    # Tasks are forwarded first created, first served (not by id).
    state = make_state(instances=[INSTANCE], tasks=[task("task-b"), task("task-a")])
    assert run_plan(state, {RUNNER: local(RunnerReady())}, COMPLETED) == task("task-b")
    running = {RUNNER: local(RunnerRunning(), in_flight=("task-b",))}
    assert run_plan(state, running, COMPLETED) == task("task-a")
    both = {RUNNER: local(RunnerRunning(), in_flight=("task-a", "task-b"))}
    assert run_plan(state, both, COMPLETED) is None

    # task-b finished (removed from state) but the runner still holds it.
    state = make_state(instances=[INSTANCE], tasks=[task("task-a")])
    assert run_plan(state, both, COMPLETED) == CancelTask(
        runner_id=RUNNER, task_id=TaskId("task-b")
    )

    # The instance is deleted: the runner goes.
    assert run_plan(make_state(), both, COMPLETED) == Shutdown(runner_id=RUNNER)


def test_task_that_is_no_longer_pending_is_not_forwarded() -> None:
    started = make_text_generation_task(task_id="task-1", status=TaskRunning())
    state = make_state(instances=[INSTANCE], tasks=[started])
    assert run_plan(state, {RUNNER: local(RunnerRunning())}, COMPLETED) is None


def test_tasks_of_other_instances_are_not_forwarded() -> None:
    other = make_instance(OTHER_NODE, instance_id="instance-2")
    state = make_state(instances=[INSTANCE, other], tasks=[task("task-x", "instance-2")])
    assert run_plan(state, {RUNNER: local(RunnerReady())}, COMPLETED) is None


@pytest.mark.parametrize("status", [RunnerIdle(), RunnerLoaded(), RunnerWarmingUp()])
def test_tasks_wait_until_the_runner_is_ready(status: RunnerStatus) -> None:
    state = make_state(instances=[INSTANCE], tasks=[task("task-1")])
    result = run_plan(state, {RUNNER: local(status, loading=True)}, COMPLETED)
    assert result is None


@pytest.mark.parametrize(
    "status", [RunnerFailed(error_message="crashed"), RunnerShutdown()], ids=lambda s: s.kind
)
def test_failed_or_stopped_runner_is_shut_down(status: RunnerStatus) -> None:
    state = make_state(instances=[INSTANCE], tasks=[task("task-1")])
    assert run_plan(state, {RUNNER: local(status)}, COMPLETED) == Shutdown(runner_id=RUNNER)


def test_shutdown_comes_before_cancelling() -> None:
    runners = {RUNNER: local(RunnerRunning(), in_flight=("gone",))}
    assert run_plan(make_state(), runners) == Shutdown(runner_id=RUNNER)


def test_runner_not_assigned_to_this_node_is_shut_down() -> None:
    # Same instance id, but the instance now puts this runner on another node.
    moved = make_instance(OTHER_NODE, instance_id="instance-1")
    state = make_state(instances=[moved])
    assert run_plan(state, {RUNNER: local(RunnerReady())}) == Shutdown(runner_id=RUNNER)


def test_runner_of_an_instance_re_placed_elsewhere_is_shut_down_not_a_crash() -> None:
    # After a healed split: the instance was re-placed on the other node under new runner
    # ids while this node's old runner still runs, its model on disk. Later plan steps
    # (downloads, loading) must not run on the stale runner before its Shutdown.
    moved = make_instance(OTHER_NODE, instance_id="instance-1", runner_tag="r100")
    state = make_state(instances=[moved])
    for status in (RunnerIdle(), RunnerReady()):
        runners = {RUNNER: local(status)}
        assert run_plan(state, runners, COMPLETED) == Shutdown(runner_id=RUNNER)
        assert run_plan(state, runners) == Shutdown(runner_id=RUNNER)


def test_create_runner_waits_for_retry_after() -> None:
    state = make_state(instances=[INSTANCE])
    assert run_plan(state, retry_after={RUNNER: NOW + 5}) is None
    assert run_plan(state, retry_after={RUNNER: NOW}) == CreateRunner(
        instance_id=INSTANCE_ID, runner_id=RUNNER
    )
    assert run_plan(state, retry_after={RUNNER: NOW - 5}) == CreateRunner(
        instance_id=INSTANCE_ID, runner_id=RUNNER
    )


def test_failed_download_is_retried_only_after_retry_after() -> None:
    state = make_state(instances=[INSTANCE])
    runners = {RUNNER: local(RunnerIdle())}
    failed = {SMOLLM2: DownloadFailed(error_message="connection reset")}
    assert run_plan(state, runners, failed, {SMOLLM2: NOW + 30}) is None
    expected = DownloadModel(
        instance_id=INSTANCE_ID, shard=INSTANCE.shard_assignments.runner_to_shard[RUNNER]
    )
    assert run_plan(state, runners, failed, {SMOLLM2: NOW - 1}) == expected
    assert run_plan(state, runners, failed) == expected


def test_runners_of_other_nodes_are_ignored() -> None:
    other = make_instance(OTHER_NODE, instance_id="instance-2")
    other_runner = RunnerId("instance-2-rank0")
    state = make_state(
        instances=[other],
        tasks=[task("task-1", "instance-2")],
        runners={other_runner: (OTHER_NODE, RunnerReady())},
    )
    assert run_plan(state) is None
    # The other node plans its own runner.
    assert run_plan(state, node_id=OTHER_NODE) == CreateRunner(
        instance_id=InstanceId("instance-2"), runner_id=other_runner
    )


def test_two_rank_instance_creates_only_this_nodes_runner_and_forwards_on_rank_zero() -> None:
    instance = make_instance([OTHER_NODE, NODE], instance_id="instance-1")
    rank_zero, rank_one = RunnerId("instance-1-rank0"), RunnerId("instance-1-rank1")
    state = make_state(
        instances=[instance],
        tasks=[task("task-1")],
        runners={rank_zero: (OTHER_NODE, RunnerReady()), rank_one: (NODE, RunnerReady())},
    )
    assert run_plan(state) == CreateRunner(instance_id=INSTANCE_ID, runner_id=rank_one)
    # The rank 1 runner is ready, but only rank 0 receives generation tasks.
    assert run_plan(state, {rank_one: local(RunnerReady())}, COMPLETED) is None
    assert run_plan(state, node_id=OTHER_NODE) == CreateRunner(
        instance_id=INSTANCE_ID, runner_id=rank_zero
    )
    assert run_plan(
        state, {rank_zero: local(RunnerReady())}, COMPLETED, node_id=OTHER_NODE
    ) == task("task-1")
    # Not before every rank is ready.
    warming = make_state(
        instances=[instance],
        tasks=[task("task-1")],
        runners={rank_zero: (OTHER_NODE, RunnerReady()), rank_one: (NODE, RunnerWarmingUp())},
    )
    assert (
        run_plan(warming, {rank_zero: local(RunnerReady())}, COMPLETED, node_id=OTHER_NODE) is None
    )


def test_a_rank_links_to_lower_ranks_where_its_node_reaches_theirs() -> None:
    # Rank 2 (this node) measured rank 1's node at 192.168.7.2: it links there, and to
    # rank 0 at the rendezvous address; rank 1 is told nothing about rank 2 (a higher
    # rank connects to it).
    third = NodeId("node-c")
    placed = make_instance([third, OTHER_NODE, NODE], instance_id="instance-1")
    assert placed.rendezvous is not None
    links = {NODE: {OTHER_NODE: "192.168.7.2", third: "192.168.7.1"}}
    instance = placed.model_copy(
        update={"rendezvous": placed.rendezvous.model_copy(update={"link_addresses": links})}
    )
    runners = [RunnerId(f"instance-1-rank{rank}") for rank in range(3)]
    state = make_state(
        instances=[instance],
        runners={
            runners[0]: (third, RunnerIdle()),
            runners[1]: (OTHER_NODE, RunnerIdle()),
            runners[2]: (NODE, RunnerIdle()),
        },
        downloads={node: dict(COMPLETED) for node in (third, OTHER_NODE, NODE)},
    )
    connect = run_plan(state, {runners[2]: local(RunnerIdle())}, COMPLETED)
    assert isinstance(connect, ConnectToGroup)
    assert connect.master_addr == "10.0.0.3"
    assert connect.link_addresses == {1: "192.168.7.2"}
    rank_one = run_plan(state, {runners[1]: local(RunnerIdle())}, COMPLETED, node_id=OTHER_NODE)
    assert isinstance(rank_one, ConnectToGroup) and rank_one.link_addresses == {}


def test_ranks_connect_load_and_warm_up_in_lockstep() -> None:
    instance = make_instance([OTHER_NODE, NODE], instance_id="instance-1")
    rank_zero, rank_one = RunnerId("instance-1-rank0"), RunnerId("instance-1-rank1")

    def with_other(status: RunnerStatus, downloaded: bool = True) -> State:
        downloads = {OTHER_NODE: dict(COMPLETED)} if downloaded else {}
        return make_state(
            instances=[instance],
            runners={rank_zero: (OTHER_NODE, status), rank_one: (NODE, RunnerIdle())},
            downloads=downloads,
        )

    idle = {rank_one: local(RunnerIdle())}
    # The other rank's files are not there yet: wait.
    assert run_plan(with_other(RunnerIdle(), downloaded=False), idle, COMPLETED) is None
    connect = run_plan(with_other(RunnerIdle()), idle, COMPLETED)
    assert connect == ConnectToGroup(
        instance_id=INSTANCE_ID,
        runner_id=rank_one,
        backend="gloo",
        master_addr="10.0.0.2",  # how this node reaches rank 0
        master_port=41000,
    )
    connected = {rank_one: local(RunnerConnected())}
    assert run_plan(with_other(RunnerConnecting()), connected, COMPLETED) is None
    assert run_plan(with_other(RunnerConnected()), connected, COMPLETED) == LoadModel(
        instance_id=INSTANCE_ID, runner_id=rank_one, model_dir=MODEL_DIR
    )
    loaded = {rank_one: local(RunnerLoaded())}
    assert (
        run_plan(with_other(RunnerLoading(layers_loaded=3, total_layers=15)), loaded, COMPLETED)
        is None
    )
    assert run_plan(with_other(RunnerLoaded()), loaded, COMPLETED) == StartWarmup(
        instance_id=INSTANCE_ID, runner_id=rank_one
    )


def test_a_broken_group_shuts_every_rank_down_but_idle_ranks_wait() -> None:
    instance = make_instance([OTHER_NODE, NODE], instance_id="instance-1")
    rank_zero, rank_one = RunnerId("instance-1-rank0"), RunnerId("instance-1-rank1")
    failed = make_state(
        instances=[instance],
        runners={rank_zero: (OTHER_NODE, RunnerFailed(error_message="gone"))},
    )
    assert run_plan(failed, {rank_one: local(RunnerReady())}, COMPLETED) == Shutdown(
        runner_id=rank_one
    )
    # A freshly started rank waits for the others to come back instead.
    assert run_plan(failed, {rank_one: local(RunnerIdle())}, COMPLETED) is None
    missing = make_state(instances=[instance])
    assert run_plan(missing, {rank_one: local(RunnerLoaded())}, COMPLETED) == Shutdown(
        runner_id=rank_one
    )


def test_several_instances_are_created_in_id_order() -> None:
    second = make_instance(NODE, instance_id="instance-2")
    state = make_state(instances=[second, INSTANCE])
    assert run_plan(state) == CreateRunner(instance_id=INSTANCE_ID, runner_id=RUNNER)
    runners = {RUNNER: local(RunnerIdle())}
    assert run_plan(state, runners) == CreateRunner(
        instance_id=InstanceId("instance-2"), runner_id=RunnerId("instance-2-rank0")
    )


def test_an_instance_waiting_for_room_stops_its_runners_here_and_starts_none() -> None:
    pair = make_instance([NODE, OTHER_NODE], instance_id="pair")
    waiting = make_state(instances=[pair]).model_copy(
        update={
            "unavailable_instances": {
                pair.instance_id: InstanceUnavailable(
                    reason="node node-b left; waiting for room: no room", waiting_for_room=True
                )
            }
        }
    )
    own = RunnerId("pair-rank0")
    runner = {own: local(RunnerReady(), instance_id=pair.instance_id)}
    assert run_plan(waiting, runner, COMPLETED) == Shutdown(runner_id=own)
    assert run_plan(waiting, {}, COMPLETED) is None
    # Re-placing (not waiting) is an ordinary placement: its runners start.
    loading = waiting.model_copy(
        update={"unavailable_instances": {pair.instance_id: InstanceUnavailable(reason="x")}}
    )
    assert run_plan(loading, {}, COMPLETED) == CreateRunner(
        instance_id=pair.instance_id, runner_id=own
    )
