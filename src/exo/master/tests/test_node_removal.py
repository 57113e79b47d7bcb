"""The removal of a node (silent for `NODE_TIMEOUT_SECONDS`) ends the requests it sent.

A request's tokens go to its API node (the task's `origin_node_id`) only. Found live: node
B (API) streamed a 1,500-token request served by node A's instance and got SIGTERM 2 s
in; B was removed from `/state` 30 s later, but the task stayed `TaskRunning` on A for
~105 s more, until the generation reached its end, for nobody. Only a restart of the API
node ended such tasks (`events_after_restart`); its loss and its removal did not.
"""

from pathlib import Path

from exo.master.main import NODE_TIMEOUT_SECONDS, Master
from exo.master.recovery import events_after_node_lost, events_after_node_removed
from exo.node.event_log import EventLog
from exo.shared.apply import apply_event
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import InstanceId, NodeId, RunnerId, TaskId
from exo.shared.types.events import (
    Event,
    ForwarderEvent,
    IndexedEvent,
    InstanceReplaced,
    NodeLost,
    NodeTimedOut,
    TaskStatusUpdated,
)
from exo.shared.types.runners import RunnerRunning
from exo.shared.types.state import State
from exo.shared.types.tasks import CancelTask, TaskFailed, TaskRunning
from exo.testing.builders import (
    make_card,
    make_instance,
    make_node_info,
    make_state,
    make_text_generation_task,
)
from exo.utils.channels import Topic
from exo.worker.plan import LocalRunner, plan

SERVER = NodeId("node-a")
API_NODE = NodeId("node-b")
OTHER_API_NODE = NodeId("node-c")
ROOMY = make_node_info(4096)
CRAMPED = make_node_info(10)
REMOVED_MESSAGE = "node node-b, which sent this request, left the cluster"


def apply_events(state: State, events: list[Event]) -> State:
    for event in events:
        state = apply_event(state, event)
    return state


def serving_state() -> State:
    """A's instance runs B's request and holds another of B's and one of C's queued."""
    return make_state(
        nodes={SERVER: ROOMY, API_NODE: ROOMY, OTHER_API_NODE: ROOMY},
        instances=[make_instance(SERVER, instance_id="on-a")],
        tasks=[
            make_text_generation_task(
                instance_id="on-a",
                task_id="from-b",
                origin_node_id=API_NODE,
                status=TaskRunning(),
            ),
            make_text_generation_task(
                instance_id="on-a", task_id="from-b-queued", origin_node_id=API_NODE
            ),
            make_text_generation_task(
                instance_id="on-a", task_id="from-c", origin_node_id=OTHER_API_NODE
            ),
        ],
        runners={RunnerId("on-a-rank0"): (SERVER, RunnerRunning())},
    )


def test_a_removed_nodes_requests_stop_on_the_instances_that_serve_them() -> None:
    state = serving_state()
    events = events_after_node_removed(state, API_NODE)
    assert events[0] == NodeLost(node_id=API_NODE)
    assert events[-1] == NodeTimedOut(node_id=API_NODE)
    failed = [e for e in events if isinstance(e, TaskStatusUpdated)]
    assert [e.task_id for e in failed] == ["from-b", "from-b-queued"]
    assert all(e.status == TaskFailed(error_message=REMOVED_MESSAGE) for e in failed)

    after = apply_events(state, events)
    assert API_NODE not in after.node_info
    # Only C's request is left; A's instance was not B's and serves on.
    assert list(after.tasks) == ["from-c"]
    assert list(after.instances) == ["on-a"] and after.unavailable_instances == {}
    # A's worker cancels the generation it runs for B (its batch slot frees), then the
    # queued one, and keeps C's.
    held = LocalRunner(
        instance_id=InstanceId("on-a"),
        status=RunnerRunning(),
        in_flight=frozenset({TaskId("from-b"), TaskId("from-b-queued"), TaskId("from-c")}),
    )
    runner_id = RunnerId("on-a-rank0")
    assert plan(SERVER, after, {runner_id: held}, {}, {}, now=0.0) == CancelTask(
        runner_id=runner_id, task_id=TaskId("from-b")
    )
    held = LocalRunner(held.instance_id, held.status, frozenset({TaskId("from-b-queued")}))
    assert plan(SERVER, after, {runner_id: held}, {}, {}, now=0.0) == CancelTask(
        runner_id=runner_id, task_id=TaskId("from-b-queued")
    )


def test_a_lost_api_node_keeps_its_requests_until_it_is_removed() -> None:
    # A loss may be a dropped link that returns within the timeout (`NodeRejoined`).
    state = serving_state()
    lost = events_after_node_lost(state, API_NODE)
    assert lost == [NodeLost(node_id=API_NODE)]
    state = apply_events(state, lost)
    assert list(state.tasks) == ["from-b", "from-b-queued", "from-c"]
    # Removed later: not lost twice; its requests end then.
    events = events_after_node_removed(state, API_NODE)
    assert events == [
        TaskStatusUpdated(
            task_id=TaskId("from-b"), status=TaskFailed(error_message=REMOVED_MESSAGE)
        ),
        TaskStatusUpdated(
            task_id=TaskId("from-b-queued"), status=TaskFailed(error_message=REMOVED_MESSAGE)
        ),
        NodeTimedOut(node_id=API_NODE),
    ]


def test_a_failed_over_request_goes_on_when_the_node_that_served_it_is_removed() -> None:
    # Mid-stream failover: C (the API node) sent its request again to A's instance after
    # B's instance was lost; C is its origin and stays, so only B's own requests end.
    state = make_state(
        nodes={SERVER: ROOMY, API_NODE: ROOMY, OTHER_API_NODE: CRAMPED},
        instances=[
            make_instance(SERVER, instance_id="on-a"),
            make_instance(API_NODE, instance_id="on-b"),
        ],
        tasks=[
            make_text_generation_task(
                instance_id="on-b", task_id="first-try", origin_node_id=OTHER_API_NODE
            ),
            make_text_generation_task(
                instance_id="on-a",
                task_id="resent",
                origin_node_id=OTHER_API_NODE,
                status=TaskRunning(),
            ),
            make_text_generation_task(
                instance_id="on-a", task_id="from-b", origin_node_id=API_NODE
            ),
        ],
    )
    after = apply_events(state, events_after_node_removed(state, API_NODE))
    # The first try failed with B's loss (the API re-sends such requests); B's request
    # ended with its removal; the resent one is left running.
    assert list(after.tasks) == ["resent"]
    assert isinstance(after.tasks[TaskId("resent")].status, TaskRunning)


def make_master(tmp_path: Path, state: State, last_heard: dict[NodeId, float]) -> Master:
    """A master that is not running: `timed_out_nodes` only reads its state and clock."""
    commands: Topic[ForwarderCommand] = Topic("commands")
    local_events: Topic[ForwarderEvent] = Topic("local_events")
    global_events: Topic[IndexedEvent] = Topic("global_events")
    return Master(
        node_id=SERVER,
        state=state,
        event_log=EventLog(tmp_path / "events.jsonl"),
        command_subscription=commands.subscribe(),
        local_event_subscription=local_events.subscribe(),
        global_event_publisher=global_events.sender(),
        cards={},
        last_heard=last_heard,
        clock=lambda: 1000.0 + NODE_TIMEOUT_SECONDS + 1,
    )


def test_the_master_ends_the_requests_of_a_node_it_removes(tmp_path: Path) -> None:
    last_heard = {API_NODE: 1000.0, OTHER_API_NODE: 1000.0 + NODE_TIMEOUT_SECONDS}
    master = make_master(tmp_path, serving_state(), last_heard)
    events = master.timed_out_nodes()
    assert events == events_after_node_removed(serving_state(), API_NODE)
    assert list(apply_events(serving_state(), events).tasks) == ["from-c"]


def test_an_instance_placed_on_a_node_removed_in_the_same_pass_keeps_its_wish(
    tmp_path: Path,
) -> None:
    # B's instance is placed again on C, the only node with room; C is silent too: its
    # removal in the same pass must see the instance there and keep the wish (waiting for
    # room) rather than drop it with C.
    card = make_card()
    state = make_state(
        nodes={SERVER: CRAMPED, API_NODE: ROOMY, OTHER_API_NODE: ROOMY},
        instances=[make_instance(API_NODE, card, instance_id="on-b")],
        last_event_applied_idx=4,
    )
    master = make_master(tmp_path, state, {API_NODE: 1000.0, OTHER_API_NODE: 1000.0})
    events = master.timed_out_nodes()
    [replaced] = [e for e in events if isinstance(e, InstanceReplaced)]
    assert list(replaced.instance.shard_assignments.node_to_runner) == [OTHER_API_NODE]
    after = apply_events(state, events)
    assert sorted(after.node_info) == [SERVER]
    assert list(after.instances) == ["on-b"]
    assert after.unavailable_instances[InstanceId("on-b")].waiting_for_room
