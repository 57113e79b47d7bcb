import pytest

from exo.master.decisions import choose_instance, events_after_restart, events_for_command
from exo.master.placement_memory import required_memory_bytes
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import (
    MAX_GENERATION_BYTES,
    CancelGeneration,
    Command,
    DeleteInstance,
    GenerateText,
    PlaceInstance,
    RequestEventReplay,
)
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    InstanceCreated,
    InstanceDeleted,
    RunnerDeleted,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.runners import (
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.state import InstanceUnavailable, State
from exo.shared.types.tasks import TaskCancelled, TaskFailed, TaskPending, TextGeneration
from exo.testing.builders import (
    SMOLLM2,
    make_card,
    make_instance,
    make_node_info,
    make_params,
    make_state,
    make_text_generation_task,
)

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
API_NODE = NodeId("api-node")
COMMAND = CommandId("command-1")
CARD = make_card()
CARDS = {CARD.model_id: CARD}
BIG_NODE = make_node_info(4096)


def fixed_instance_id() -> InstanceId:
    return InstanceId("new-instance")


def fixed_task_id() -> TaskId:
    return TaskId("new-task")


def decide(state: State, command: Command):
    return events_for_command(
        state, API_NODE, command, CARDS, new_instance_id=fixed_instance_id,
        new_task_id=fixed_task_id,
    )  # fmt: skip


def test_place_instance_creates_an_instance() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE})
    events = decide(state, PlaceInstance(command_id=COMMAND, model_id=SMOLLM2))
    assert len(events) == 1
    event = events[0]
    assert isinstance(event, InstanceCreated)
    assert event.command_id == COMMAND
    assert event.instance.sharding == "pipeline"
    assert event.instance.instance_id == InstanceId("new-instance")
    assert event.instance.model_id == SMOLLM2
    assert list(event.instance.shard_assignments.node_to_runner) == [NODE_A]


def test_place_instance_passes_sharding_and_node_ids() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE, NODE_B: make_node_info(8192)})
    command = PlaceInstance(
        command_id=COMMAND, model_id=SMOLLM2, sharding="tensor", node_ids=(NODE_A,)
    )
    [event] = decide(state, command)
    assert isinstance(event, InstanceCreated)
    assert event.instance.sharding == "tensor"
    assert list(event.instance.shard_assignments.node_to_runner) == [NODE_A]


def test_place_unknown_model_is_rejected_with_404() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE})
    command = PlaceInstance(command_id=COMMAND, model_id=ModelId("nobody/no-such-model"))
    assert decide(state, command) == [
        CommandRejected(
            command_id=COMMAND,
            origin=API_NODE,
            reason=(
                "unknown model 'nobody/no-such-model': not in the catalog, not a custom model "
                "and not an existing local model directory; GET /models lists every model"
            ),
            status_code=404,
        )
    ]


def test_place_without_enough_memory_is_rejected_with_400() -> None:
    state = make_state(nodes={NODE_A: make_node_info(100)})
    [event] = decide(state, PlaceInstance(command_id=COMMAND, model_id=SMOLLM2))
    assert isinstance(event, CommandRejected)
    assert (event.command_id, event.origin, event.status_code) == (COMMAND, API_NODE, 400)
    # The reservation is the card's int4 loading peak plus overhead (placement's own rule).
    card = load_builtin_cards()[SMOLLM2]
    assert f"needs {required_memory_bytes(card) / 2**20:.0f} MiB" in event.reason
    assert "100 MiB available" in event.reason
    assert "has 100 MiB" in event.reason


def test_place_on_unlinked_nodes_is_rejected_with_400() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE, NODE_B: BIG_NODE})
    [event] = decide(state, PlaceInstance(command_id=COMMAND, model_id=SMOLLM2, min_nodes=2))
    assert isinstance(event, CommandRejected)
    assert event.status_code == 400
    assert "no measured link" in event.reason


def test_place_with_more_nodes_than_the_cluster_is_rejected_with_400() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE})
    [event] = decide(state, PlaceInstance(command_id=COMMAND, model_id=SMOLLM2, min_nodes=2))
    assert isinstance(event, CommandRejected)
    assert event.status_code == 400
    assert "min_nodes=2 but only 1" in event.reason


def test_place_only_if_cluster_empty_places_on_an_empty_cluster() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE})
    command = PlaceInstance(command_id=COMMAND, model_id=SMOLLM2, only_if_cluster_empty=True)
    [event] = decide(state, command)
    assert isinstance(event, InstanceCreated)
    assert event.command_id == COMMAND


def test_place_only_if_cluster_empty_is_rejected_with_409_when_any_instance_runs() -> None:
    # Any instance counts, even of another model: a node's default model must not add one.
    other_model = make_instance(NODE_B, make_card(model_id="other/model"))
    state = make_state(nodes={NODE_A: BIG_NODE, NODE_B: BIG_NODE}, instances=[other_model])
    command = PlaceInstance(command_id=COMMAND, model_id=SMOLLM2, only_if_cluster_empty=True)
    assert decide(state, command) == [
        CommandRejected(
            command_id=COMMAND,
            origin=API_NODE,
            reason="the cluster already runs a model",
            status_code=409,
        )
    ]
    # Without the flag the same placement goes ahead.
    [event] = decide(state, command.model_copy(update={"only_if_cluster_empty": False}))
    assert isinstance(event, InstanceCreated)


def test_event_replay_request_produces_no_event() -> None:
    state = make_state(nodes={NODE_A: BIG_NODE}, last_event_applied_idx=9)
    assert decide(state, RequestEventReplay(command_id=COMMAND, from_idx=3)) == []


def test_delete_known_instance() -> None:
    instance = make_instance(NODE_A)
    state = make_state(instances=[instance])
    command = DeleteInstance(command_id=COMMAND, instance_id=instance.instance_id)
    assert decide(state, command) == [
        InstanceDeleted(instance_id=instance.instance_id, command_id=COMMAND)
    ]


def test_delete_unknown_instance_is_rejected_with_404() -> None:
    state = make_state(instances=[make_instance(NODE_A)])
    command = DeleteInstance(command_id=COMMAND, instance_id=InstanceId("nope"))
    assert decide(state, command) == [
        CommandRejected(
            command_id=COMMAND, origin=API_NODE, reason="no instance 'nope'", status_code=404
        )
    ]


def test_generate_without_instance_tells_how_to_place_one() -> None:
    other_model = make_instance(NODE_A, make_card(model_id="other/model"))
    state = make_state(instances=[other_model])
    [event] = decide(state, GenerateText(command_id=COMMAND, params=make_params()))
    assert isinstance(event, CommandRejected)
    assert (event.command_id, event.origin, event.status_code) == (COMMAND, API_NODE, 404)
    assert f"no instance of model '{SMOLLM2}'" in event.reason
    assert f'POST /place_instance {{"model_id": "{SMOLLM2}"}}' in event.reason


def test_generate_creates_a_task_on_the_instance() -> None:
    instance = make_instance(NODE_A)
    state = make_state(instances=[instance])
    params = make_params("Write a haiku", max_tokens=20)
    assert decide(state, GenerateText(command_id=COMMAND, params=params)) == [
        TaskCreated(
            task=TextGeneration(
                task_id=TaskId("new-task"),
                command_id=COMMAND,
                instance_id=instance.instance_id,
                origin_node_id=API_NODE,
                params=params,
                status=TaskPending(),
            )
        )
    ]


def test_generate_larger_than_the_event_bound_is_rejected_and_creates_no_task() -> None:
    state = make_state(instances=[make_instance(NODE_A)])
    params = make_params("x" * MAX_GENERATION_BYTES)
    [event] = decide(state, GenerateText(command_id=COMMAND, params=params))
    assert isinstance(event, CommandRejected)
    assert event.status_code == 413
    assert f"at most {MAX_GENERATION_BYTES} are accepted" in event.reason
    # Just under the bound still makes a task.
    small = make_params("x" * (MAX_GENERATION_BYTES - 4096))
    [created] = decide(state, GenerateText(command_id=COMMAND, params=small))
    assert isinstance(created, TaskCreated)


def runner_of(instance_id: str) -> RunnerId:
    return RunnerId(f"{instance_id}-rank0")


def two_instances_state(
    status_1: RunnerStatus, status_2: RunnerStatus, tasks_1: int, tasks_2: int
) -> State:
    instance_1 = make_instance(NODE_A, instance_id="instance-1")
    instance_2 = make_instance(NODE_B, instance_id="instance-2")
    tasks = [
        make_text_generation_task(instance_id="instance-1", task_id=f"t1-{i}")
        for i in range(tasks_1)
    ] + [
        make_text_generation_task(instance_id="instance-2", task_id=f"t2-{i}")
        for i in range(tasks_2)
    ]
    return make_state(
        instances=[instance_1, instance_2],
        tasks=tasks,
        runners={
            runner_of("instance-1"): (NODE_A, status_1),
            runner_of("instance-2"): (NODE_B, status_2),
        },
    )


@pytest.mark.parametrize(
    ("status_1", "status_2", "tasks_1", "tasks_2", "expected"),
    [
        # A ready instance beats one still loading, even with more work queued.
        (RunnerLoaded(), RunnerReady(), 0, 3, "instance-2"),
        (RunnerRunning(), RunnerLoaded(), 5, 0, "instance-1"),
        # Among ready ones, the fewest unfinished tasks.
        (RunnerRunning(), RunnerReady(), 2, 1, "instance-2"),
        (RunnerReady(), RunnerRunning(), 1, 2, "instance-1"),
        (RunnerLoaded(), RunnerLoaded(), 1, 0, "instance-2"),
    ],
)
def test_choose_instance(
    status_1: RunnerStatus, status_2: RunnerStatus, tasks_1: int, tasks_2: int, expected: str
) -> None:
    state = two_instances_state(status_1, status_2, tasks_1, tasks_2)
    chosen = choose_instance(state, SMOLLM2)
    assert chosen is not None
    assert chosen.instance_id == InstanceId(expected)
    [event] = decide(state, GenerateText(command_id=COMMAND, params=make_params()))
    assert isinstance(event, TaskCreated)
    assert event.task.instance_id == InstanceId(expected)


def test_a_generation_pinned_to_an_instance_runs_there_even_when_another_is_idler() -> None:
    # instance-1 is busier (3 tasks against 0): unpinned, instance-2 gets it.
    state = two_instances_state(RunnerReady(), RunnerReady(), 3, 0)
    pinned = GenerateText(
        command_id=COMMAND, params=make_params(), instance_id=InstanceId("instance-1")
    )
    [event] = decide(state, pinned)
    assert isinstance(event, TaskCreated)
    assert event.task.instance_id == InstanceId("instance-1")


@pytest.mark.parametrize(
    ("instance_id", "model", "status", "reason"),
    [
        ("instance-9", SMOLLM2, 404, "no instance 'instance-9'"),
        ("instance-1", "other/model", 400, f"serves {SMOLLM2}, not other/model"),
        ("instance-2", SMOLLM2, 503, "instance-2 of"),
    ],
)
def test_a_generation_pinned_to_an_instance_that_cannot_run_it_is_refused(
    instance_id: str, model: str, status: int, reason: str
) -> None:
    state = two_instances_state(RunnerReady(), RunnerReady(), 0, 0)
    state = state.model_copy(
        update={
            "unavailable_instances": {
                InstanceId("instance-2"): InstanceUnavailable(reason="node B left")
            }
        }
    )
    params = make_params().model_copy(update={"model": ModelId(model)})
    command = GenerateText(command_id=COMMAND, params=params, instance_id=InstanceId(instance_id))
    [event] = decide(state, command)
    assert isinstance(event, CommandRejected)
    assert event.status_code == status
    assert reason in event.reason


@pytest.mark.parametrize(
    ("status", "stage"),
    [
        (None, "starting"),
        (RunnerLoading(layers_loaded=3, total_layers=30), "loading"),
        (RunnerWarmingUp(), "warming up"),
    ],
)
def test_a_generation_pinned_to_an_instance_not_ready_yet_is_refused_at_once(
    status: RunnerStatus | None, stage: str
) -> None:
    state = two_instances_state(RunnerReady(), RunnerReady(), 0, 0)
    runners = dict(state.runners)
    if status is None:
        del runners[runner_of("instance-2")]
    else:
        runners[runner_of("instance-2")] = status
    state = state.model_copy(update={"runners": runners})
    command = GenerateText(
        command_id=COMMAND, params=make_params(), instance_id=InstanceId("instance-2")
    )
    [event] = decide(state, command)
    assert isinstance(event, CommandRejected)
    assert event.status_code == 503
    assert event.reason.startswith(f"instance instance-2 of {SMOLLM2} is not ready ({stage})")


def test_choose_instance_without_runner_status_counts_as_not_ready() -> None:
    state = two_instances_state(RunnerReady(), RunnerReady(), 3, 0)
    state = state.model_copy(update={"runners": {runner_of("instance-1"): RunnerReady()}})
    chosen = choose_instance(state, SMOLLM2)
    assert chosen is not None and chosen.instance_id == InstanceId("instance-1")


def test_choose_instance_ignores_other_models() -> None:
    state = make_state(instances=[make_instance(NODE_A, make_card(model_id="other/model"))])
    assert choose_instance(state, SMOLLM2) is None


def test_cancel_generation_cancels_the_matching_tasks_only() -> None:
    state = make_state(
        instances=[make_instance(NODE_A)],
        tasks=[
            make_text_generation_task(task_id="task-1", command_id="target"),
            make_text_generation_task(task_id="task-2", command_id="other"),
            make_text_generation_task(task_id="task-3", command_id="target"),
        ],
    )
    command = CancelGeneration(command_id=COMMAND, target_command_id=CommandId("target"))
    assert decide(state, command) == [
        TaskStatusUpdated(task_id=TaskId("task-1"), status=TaskCancelled()),
        TaskStatusUpdated(task_id=TaskId("task-3"), status=TaskCancelled()),
    ]


def test_cancel_of_a_finished_generation_produces_nothing() -> None:
    state = make_state(tasks=[make_text_generation_task(command_id="other")])
    command = CancelGeneration(command_id=COMMAND, target_command_id=CommandId("target"))
    assert decide(state, command) == []


def test_events_after_restart_drop_the_nodes_runners_and_fail_its_requests() -> None:
    state = make_state(
        instances=[
            make_instance(NODE_A, instance_id="i-a"),
            make_instance(NODE_B, instance_id="i-b"),
        ],
        runners={
            runner_of("i-a"): (NODE_A, RunnerReady()),
            runner_of("i-b"): (NODE_B, RunnerReady()),
        },
        tasks=[
            make_text_generation_task(instance_id="i-b", task_id="from-a", origin_node_id="node-a"),
            make_text_generation_task(instance_id="i-a", task_id="from-b", origin_node_id="node-b"),
        ],
    )
    assert events_after_restart(state, NODE_A) == [
        RunnerDeleted(runner_id=runner_of("i-a")),
        TaskStatusUpdated(
            task_id=TaskId("from-a"), status=TaskFailed(error_message="node restarted")
        ),
    ]
    assert events_after_restart(state, NodeId("node-z")) == []
