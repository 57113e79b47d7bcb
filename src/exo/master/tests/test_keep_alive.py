"""Load on request and keep-alive, as pure decisions of the master: one on-request
placement per model, a 503 that says how much memory is missing, uses recorded for
instances with a keep-alive, and idle instances unloaded."""

from __future__ import annotations

from exo.master.decisions import events_for_command
from exo.master.keep_alive import (
    idle_instances,
    usage_after_command,
    usage_after_local_event,
)
from exo.master.placement_memory import required_memory_bytes
from exo.shared.apply import apply_event
from exo.shared.types.commands import (
    Command,
    GenerateText,
    KeepAlive,
    PlaceInstance,
    SetKeepAlive,
)
from exo.shared.types.common import CommandId, InstanceId, NodeId, RunnerId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceUsed,
    RunnerStatusUpdated,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.runners import RunnerLoaded, RunnerReady, RunnerStatus
from exo.shared.types.state import InstanceUsage, State
from exo.shared.types.tasks import TaskComplete, TaskRunning
from exo.testing.builders import (
    MIB,
    SMOLLM2,
    make_card,
    make_instance,
    make_node_info,
    make_params,
    make_state,
    make_text_generation_task,
)

NODE = NodeId("node-a")
API_NODE = NodeId("api-node")
COMMAND = CommandId("command-1")
CARD = make_card()
INSTANCE = make_instance(NODE, instance_id="instance-1")
RUNNER = RunnerId("instance-1-rank0")
READY = RunnerReady()
NOW = 1_000.0


def decide(state: State, command: Command) -> list[Event]:
    return events_for_command(
        state,
        API_NODE,
        command,
        {CARD.model_id: CARD},
        new_instance_id=lambda: InstanceId("new-instance"),
        new_task_id=lambda: TaskId("new-task"),
        now=NOW,
    )


def placed(
    runner: RunnerStatus = READY, usage: InstanceUsage | None = None, busy: bool = False
) -> State:
    """One node running INSTANCE (its runner in `runner`), with `usage` and, when `busy`,
    one generation task on it."""
    state = make_state(
        nodes={NODE: make_node_info(4096)},
        instances=[INSTANCE],
        runners={RUNNER: (NODE, runner)},
        tasks=[make_text_generation_task(instance_id="instance-1")] if busy else [],
    )
    if usage is None:
        return state
    return state.model_copy(update={"instance_usage": {INSTANCE.instance_id: usage}})


def on_request(keep_alive: KeepAlive | None = None) -> PlaceInstance:
    return PlaceInstance(
        command_id=COMMAND, model_id=SMOLLM2, on_request=True, keep_alive=keep_alive
    )


# ---------------------------------------------------------------- placing on request


def test_an_on_request_placement_places_on_an_empty_cluster() -> None:
    [event] = decide(make_state(nodes={NODE: make_node_info(4096)}), on_request())
    assert isinstance(event, InstanceCreated) and event.command_id == COMMAND


def test_a_second_on_request_placement_of_a_placed_model_is_refused_with_409() -> None:
    # Whether the first instance is ready or still loading: two API nodes racing place once.
    for runner in (RunnerReady(), RunnerLoaded()):
        [event] = decide(placed(runner), on_request())
        assert isinstance(event, CommandRejected)
        assert (event.status_code, event.origin) == (409, API_NODE)
        assert "already placed" in event.reason
    # An explicit placement of a second instance is still allowed.
    explicit = PlaceInstance(command_id=COMMAND, model_id=SMOLLM2)
    [created] = decide(
        placed().model_copy(update={"node_info": {NODE: make_node_info(8192)}}), explicit
    )
    assert isinstance(created, InstanceCreated)


def test_an_on_request_placement_without_room_is_a_503_saying_how_much_is_missing() -> None:
    needed_mib = required_memory_bytes(CARD) / MIB
    state = make_state(nodes={NODE: make_node_info(100)})
    [event] = decide(state, on_request())
    assert isinstance(event, CommandRejected)
    assert event.status_code == 503
    missing = round(needed_mib - 100)
    assert f"{missing} MiB missing" in event.reason
    assert f"needs {needed_mib:.0f} MiB" in event.reason and "100 MiB available" in event.reason
    # The same placement asked for explicitly stays a 400 (a request that cannot be done).
    [explicit] = decide(state, PlaceInstance(command_id=COMMAND, model_id=SMOLLM2))
    assert isinstance(explicit, CommandRejected) and explicit.status_code == 400


# ---------------------------------------------------------------- recording uses


def test_a_placement_with_a_keep_alive_records_its_first_use() -> None:
    state = make_state(nodes={NODE: make_node_info(4096)})
    command = on_request(KeepAlive(seconds=30.0))
    events = decide(state, command)
    assert usage_after_command(state, command, events, NOW) == [
        InstanceUsed(instance_id=InstanceId("new-instance"), used_at=NOW, keep_alive_seconds=30.0)
    ]
    # Without a keep-alive the instance stays until deleted: nothing to record.
    plain = on_request()
    assert usage_after_command(state, plain, decide(state, plain), NOW) == []


def test_a_generation_sets_the_keep_alive_or_keeps_the_instances() -> None:
    state = placed(usage=InstanceUsage(last_used_at=1.0, keep_alive_seconds=60.0))
    for keep_alive, expected in ((KeepAlive(seconds=0.0), 0.0), (None, 60.0)):
        command = GenerateText(command_id=COMMAND, params=make_params(), keep_alive=keep_alive)
        events = decide(state, command)
        assert isinstance(events[0], TaskCreated)
        assert usage_after_command(state, command, events, NOW) == [
            InstanceUsed(instance_id=INSTANCE.instance_id, used_at=NOW, keep_alive_seconds=expected)
        ]
    # Kept forever (a negative Ollama keep_alive) after a keep-alive: recorded, so it stops.
    forever = GenerateText(
        command_id=COMMAND, params=make_params(), keep_alive=KeepAlive(seconds=None)
    )
    [used] = usage_after_command(state, forever, decide(state, forever), NOW)
    assert isinstance(used, InstanceUsed) and used.keep_alive_seconds is None
    # An instance without a keep-alive, used without one: no event at all.
    plain = GenerateText(command_id=COMMAND, params=make_params())
    assert usage_after_command(placed(), plain, decide(placed(), plain), NOW) == []


def test_set_keep_alive_answers_the_command_or_404_without_an_instance() -> None:
    command = SetKeepAlive(command_id=COMMAND, model_id=SMOLLM2, keep_alive=KeepAlive(seconds=0))
    assert decide(placed(), command) == [
        InstanceUsed(
            instance_id=INSTANCE.instance_id,
            used_at=NOW,
            keep_alive_seconds=0.0,
            command_id=COMMAND,
        )
    ]
    [rejected] = decide(make_state(nodes={NODE: make_node_info(4096)}), command)
    assert isinstance(rejected, CommandRejected) and rejected.status_code == 404


def test_the_end_of_a_generation_and_becoming_ready_are_uses() -> None:
    usage = InstanceUsage(last_used_at=1.0, keep_alive_seconds=5.0)
    busy = placed(RunnerReady(), usage, busy=True)
    finished = TaskStatusUpdated(task_id=TaskId("task-1"), status=TaskComplete())
    after = apply_event(busy, finished)
    assert usage_after_local_event(busy, after, finished, NOW) == [
        InstanceUsed(instance_id=INSTANCE.instance_id, used_at=NOW, keep_alive_seconds=5.0)
    ]
    running = TaskStatusUpdated(task_id=TaskId("task-1"), status=TaskRunning())
    assert usage_after_local_event(busy, apply_event(busy, running), running, NOW) == []

    loading = placed(RunnerLoaded(), usage)
    ready = RunnerStatusUpdated(runner_id=RUNNER, node_id=NODE, status=RunnerReady())
    assert usage_after_local_event(loading, apply_event(loading, ready), ready, NOW) == [
        InstanceUsed(instance_id=INSTANCE.instance_id, used_at=NOW, keep_alive_seconds=5.0)
    ]
    # Ready again after a generation is not a new readiness.
    already = placed(RunnerReady(), usage)
    assert usage_after_local_event(already, apply_event(already, ready), ready, NOW) == []


# ---------------------------------------------------------------- unloading idle instances


def test_an_instance_idle_at_least_its_keep_alive_is_unloaded() -> None:
    usage = InstanceUsage(last_used_at=NOW - 30.0, keep_alive_seconds=30.0)
    assert idle_instances(placed(usage=usage), NOW) == [
        InstanceDeleted(instance_id=INSTANCE.instance_id)
    ]
    assert idle_instances(placed(usage=usage), NOW - 0.5) == []


def test_busy_loading_and_kept_instances_are_not_unloaded() -> None:
    long_ago = InstanceUsage(last_used_at=0.0, keep_alive_seconds=0.0)
    assert idle_instances(placed(usage=long_ago, busy=True), NOW) == []
    assert idle_instances(placed(RunnerLoaded(), long_ago), NOW) == []
    forever = InstanceUsage(last_used_at=0.0, keep_alive_seconds=None)
    assert idle_instances(placed(usage=forever), NOW) == []
    assert idle_instances(placed(), NOW) == []  # no keep-alive ever set


def test_idle_unloading_survives_a_master_change() -> None:
    """The decision reads only the state: a new master that replayed the same events
    decides the same."""
    state = placed(RunnerLoaded(), InstanceUsage(last_used_at=0.0, keep_alive_seconds=10.0))
    for event in (
        RunnerStatusUpdated(runner_id=RUNNER, node_id=NODE, status=RunnerReady()),
        InstanceUsed(instance_id=INSTANCE.instance_id, used_at=NOW, keep_alive_seconds=10.0),
    ):
        state = apply_event(state, event)
    replica = State.model_validate_json(state.model_dump_json())
    for master_state in (state, replica):
        assert idle_instances(master_state, NOW + 9.0) == []
        assert idle_instances(master_state, NOW + 10.0) == [
            InstanceDeleted(instance_id=INSTANCE.instance_id)
        ]
