"""A command whose answering event falls inside a snapshot (the API's node fell behind
further than the master's log reaches) is still answered: the state records each recent
command's outcome, and the client rebuilds the answer from it."""

from __future__ import annotations

import anyio
import pytest

from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.shared.apply import apply_all
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import DeleteInstance, ForwarderCommand, GenerateText, PlaceInstance
from exo.shared.types.common import CommandId, InstanceId, NodeId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    Event,
    IndexedEvent,
    InstanceCreated,
    NodeGatheredInfo,
    StateSnapshot,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.state import MAX_COMMAND_OUTCOMES, State
from exo.shared.types.tasks import TaskComplete
from exo.testing.builders import (
    SMOLLM2,
    indexed,
    make_instance,
    make_node_info,
    make_params,
    make_text_generation_task,
)
from exo.utils.channels import Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("api-node")
DEADLINE_SECONDS = 5


def client_over(applied: Topic[IndexedEvent], state: list[State]) -> ClusterClient:
    return ClusterClient(
        node_id=NODE,
        current_state=lambda: state[0],
        applied_events=applied.subscribe(),
        chunk_subscription=Topic[Chunk]("chunks").subscribe(),
        command_publisher=Topic[ForwarderCommand]("commands").sender(),
        cards={},
        resend_first_seconds=3600,
    )


async def test_answers_inside_a_snapshot_reach_their_waiters() -> None:
    place = PlaceInstance(command_id=CommandId("place-1"), model_id=SMOLLM2)
    generate = GenerateText(command_id=CommandId("generate-1"), params=make_params("hi"))
    delete = DeleteInstance(command_id=CommandId("delete-1"), instance_id=InstanceId("none"))
    instance = make_instance(NODE)
    task = make_text_generation_task(
        instance.instance_id, "task-1", generate.command_id, NODE, params=generate.params
    )
    history: list[Event] = [
        InstanceCreated(instance=instance, command_id=place.command_id),
        TaskCreated(task=task),
        CommandRejected(
            command_id=delete.command_id, origin=NODE, reason="no instance 'none'", status_code=404
        ),
        NodeGatheredInfo(node_id=NODE, info=make_node_info(1024)),
    ]
    snapshot_state = apply_all(State(), indexed(history))
    applied: Topic[IndexedEvent] = Topic("applied")
    state = [State()]
    client = client_over(applied, state)
    answers: dict[str, Event | BaseException] = {}

    async def submit(name: str, command: PlaceInstance | GenerateText | DeleteInstance) -> None:
        try:
            answers[name] = await client.submit(command, timeout=DEADLINE_SECONDS)
        except CommandRejectedError as error:
            answers[name] = error

    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(client.run)
            for name, command in (("place", place), ("generate", generate), ("delete", delete)):
                task_group.start_soon(submit, name, command)
            await anyio.wait_all_tasks_blocked()
            assert answers == {}
            # The node takes the master's snapshot in place of the four events.
            state[0] = snapshot_state
            snapshot = StateSnapshot(state=snapshot_state)
            applied.publish(IndexedEvent(idx=snapshot_state.last_event_applied_idx, event=snapshot))
            while len(answers) < 3:
                await anyio.sleep(0.01)
            task_group.cancel_scope.cancel()
    assert answers["place"] == InstanceCreated(instance=instance, command_id=place.command_id)
    assert answers["generate"] == TaskCreated(task=task)
    rejected = answers["delete"]
    assert isinstance(rejected, CommandRejectedError)
    assert (rejected.status_code, rejected.reason) == (404, "no instance 'none'")
    assert client.commands.unanswered_command_ids == []


async def test_a_finished_generation_inside_a_snapshot_is_answered() -> None:
    generate = GenerateText(command_id=CommandId("generate-2"), params=make_params("hi"))
    instance = make_instance(NODE)
    task = make_text_generation_task(
        instance.instance_id, "task-2", generate.command_id, NODE, params=generate.params
    )
    finished = apply_all(
        State(),
        indexed(
            [
                InstanceCreated(instance=instance),
                TaskCreated(task=task),
                TaskStatusUpdated(task_id=TaskId("task-2"), status=TaskComplete()),
            ]
        ),
    )
    assert TaskId("task-2") not in finished.tasks
    applied: Topic[IndexedEvent] = Topic("applied")
    client = client_over(applied, [finished])
    result: list[Event] = []

    async def submit() -> None:
        result.append(await client.submit(generate, timeout=DEADLINE_SECONDS))

    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(client.run)
            task_group.start_soon(submit)
            await anyio.wait_all_tasks_blocked()
            applied.publish(IndexedEvent(idx=2, event=StateSnapshot(state=finished)))
            while not result:
                await anyio.sleep(0.01)
            task_group.cancel_scope.cancel()
    [answer] = result
    assert isinstance(answer, TaskCreated)
    assert answer.task == task.model_copy(update={"status": TaskComplete()})


def test_the_state_keeps_only_the_newest_outcomes() -> None:
    rejections = [
        CommandRejected(
            command_id=CommandId(f"command-{number}"), origin=NODE, reason="no", status_code=404
        )
        for number in range(MAX_COMMAND_OUTCOMES + 5)
    ]
    state = apply_all(State(), indexed(rejections))
    assert len(state.command_outcomes) == MAX_COMMAND_OUTCOMES
    assert next(iter(state.command_outcomes)) == CommandId("command-5")
    newest = state.command_outcomes[CommandId(f"command-{MAX_COMMAND_OUTCOMES + 4}")]
    assert (newest.kind, newest.status_code, newest.event_idx) == (
        "CommandRejected",
        404,
        MAX_COMMAND_OUTCOMES + 4,
    )
    # The order survives a snapshot's JSON round trip, so the oldest still goes first.
    assert list(State.model_validate_json(state.model_dump_json()).command_outcomes) == list(
        state.command_outcomes
    )
