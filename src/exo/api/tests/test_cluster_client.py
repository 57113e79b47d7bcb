"""The API's cluster client holds commands while there is no master and sends the
unanswered ones again — to a new master at once, and with backoff while unanswered — so
that each is carried out exactly once."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import anyio
import pytest

from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.master.recovery import events_after_node_lost
from exo.node.election import Election
from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk
from exo.shared.types.commands import (
    CancelGeneration,
    DeleteInstance,
    ForwarderCommand,
    GenerateText,
    PlaceInstance,
)
from exo.shared.types.common import CommandId, InstanceId, NodeId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    Event,
    IndexedEvent,
    InstanceCreated,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskCancelled, TextGeneration
from exo.testing.builders import SMOLLM2, make_instance, make_params, make_state
from exo.testing.in_process import in_process_cluster
from exo.utils.channels import Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("api-node")
DEADLINE_SECONDS = 5


class FakeElection:
    def __init__(self) -> None:
        self.master: NodeId | None = None
        self.master_changed = anyio.Event()

    def elect(self, master: NodeId | None) -> None:
        self.master = master
        self.master_changed.set()
        self.master_changed = anyio.Event()


async def test_commands_wait_for_a_master_and_are_resent_to_a_new_one() -> None:
    commands: Topic[ForwarderCommand] = Topic("commands")
    sent = commands.subscribe()
    applied: Topic[IndexedEvent] = Topic("applied")
    election = FakeElection()
    client = ClusterClient(
        node_id=NODE,
        current_state=State,
        applied_events=applied.subscribe(),
        chunk_subscription=Topic[Chunk]("chunks").subscribe(),
        command_publisher=commands.sender(),
        cards={},
        election=cast(Election, election),
        resend_first_seconds=3600,  # only master changes resend here
    )
    command = DeleteInstance(command_id=CommandId("delete-1"), instance_id=InstanceId("i"))
    outcome: list[BaseException] = []

    async def submit() -> None:
        try:
            await client.submit(command, timeout=5)
        except CommandRejectedError as error:
            outcome.append(error)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(client.run)
            task_group.start_soon(submit)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.WouldBlock):
                sent.receive_nowait()  # held: nobody to send it to

            election.elect(NodeId("master-1"))
            await anyio.wait_all_tasks_blocked()
            assert sent.receive_nowait().command == command

            election.elect(None)  # the master died before answering
            election.elect(NodeId("master-2"))
            await anyio.wait_all_tasks_blocked()
            assert sent.receive_nowait().command == command

            rejection = CommandRejected(
                command_id=command.command_id,
                origin=NODE,
                reason="no instance 'i'",
                status_code=404,
            )
            applied.publish(IndexedEvent(idx=0, event=rejection))
            await anyio.wait_all_tasks_blocked()
            assert len(outcome) == 1
            # Answered: not resent to later masters.
            election.elect(NodeId("master-3"))
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.WouldBlock):
                sent.receive_nowait()
            task_group.cancel_scope.cancel()
    [error] = outcome
    assert isinstance(error, CommandRejectedError) and error.status_code == 404


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_unanswered_command_is_sent_again_with_backoff_until_answered() -> None:
    commands: Topic[ForwarderCommand] = Topic("commands")
    sent = commands.subscribe()
    applied: Topic[IndexedEvent] = Topic("applied")
    clock = FakeClock()
    election = FakeElection()
    election.elect(NodeId("master-1"))
    client = ClusterClient(
        node_id=NODE,
        current_state=State,
        applied_events=applied.subscribe(),
        chunk_subscription=Topic[Chunk]("chunks").subscribe(),
        command_publisher=commands.sender(),
        cards={},
        election=cast(Election, election),
        resend_first_seconds=1.0,
        clock=clock,
    )
    command = DeleteInstance(command_id=CommandId("delete-1"), instance_id=InstanceId("i"))

    rejections: list[CommandRejectedError] = []

    async def submit() -> None:
        with pytest.raises(CommandRejectedError) as raised:
            await client.submit(command, timeout=5)
        rejections.append(raised.value)

    def sent_count() -> int:
        count = 0
        while True:
            try:
                forwarded = sent.receive_nowait()
            except anyio.WouldBlock:
                return count
            assert forwarded.command == command
            count += 1

    with anyio.fail_after(5):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(client.run)
            task_group.start_soon(submit)
            await anyio.wait_all_tasks_blocked()
            assert sent_count() == 1
            # Resent after 1 s, then 2 s, 4 s, 4 s (the clock only moves when told).
            sends_at = {0.5: 0, 1.0: 1, 2.9: 0, 3.0: 1, 6.9: 0, 7.0: 1, 11.0: 1, 14.9: 0}
            for now, expected in sends_at.items():
                clock.now = now
                client.commands.resend_due()
                assert sent_count() == expected, f"at {now} s"

            # A new master gets it at once, and the backoff starts over.
            election.elect(NodeId("master-2"))
            await anyio.wait_all_tasks_blocked()
            assert sent_count() == 1
            clock.now = 15.9
            client.commands.resend_due()
            assert sent_count() == 1

            rejection = CommandRejected(
                command_id=command.command_id, origin=NODE, reason="gone", status_code=404
            )
            applied.publish(IndexedEvent(idx=0, event=rejection))
            await anyio.wait_all_tasks_blocked()
            assert client.commands.unanswered_command_ids == []
            assert [r.status_code for r in rejections] == [404]
            clock.now = 100.0
            client.commands.resend_due()
            assert sent_count() == 0
            task_group.cancel_scope.cancel()


async def test_command_sent_before_the_master_acts_is_carried_out_exactly_once(
    tmp_path: Path,
) -> None:
    """The case of a node that won the election but has not started acting as master:
    the first sends are dropped, a later one is carried out, the rest ignored."""
    async with in_process_cluster(tmp_path, active=False, resend_first_seconds=0.01) as cluster:
        sent = cluster.commands.subscribe()
        place = PlaceInstance(command_id=CommandId("place-1"), model_id=SMOLLM2)
        answers: list[Event] = []

        async def submit() -> None:
            answers.append(await cluster.client.submit(place, timeout=10))

        with anyio.fail_after(DEADLINE_SECONDS):
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(submit)
                for _ in range(3):  # sent, dropped by the inactive master, sent again
                    assert (await sent.receive()).command == place
                assert cluster.logged_events() == []
                cluster.active = True
                cluster.report_node()
            # A marker behind every copy still on its way: the master has seen them all.
            marker = DeleteInstance(command_id=CommandId("marker"), instance_id=InstanceId("x"))
            with pytest.raises(CommandRejectedError):
                await cluster.client.submit(marker)

        [answer] = answers
        assert isinstance(answer, InstanceCreated)
        created = [e for e in cluster.logged_events() if isinstance(e, InstanceCreated)]
        assert created == [answer]
        assert answer.command_id == place.command_id
        assert list(cluster.state.instances) == [answer.instance.instance_id]
        assert cluster.client.commands.unanswered_command_ids == []


async def test_cancel_is_sent_again_until_its_generation_is_gone(tmp_path: Path) -> None:
    async with in_process_cluster(tmp_path, resend_first_seconds=0.01) as cluster:
        cluster.report_node()
        with anyio.fail_after(DEADLINE_SECONDS):
            assert await cluster.client.wait_for_node_reports()
            await cluster.client.submit(
                PlaceInstance(command_id=CommandId("place-1"), model_id=SMOLLM2)
            )
            generate = GenerateText(command_id=CommandId("generate-1"), params=make_params())
            created = await cluster.client.submit(generate)
            assert isinstance(created, TaskCreated)

            cluster.active = False  # an election round: the cancel is dropped
            sent = cluster.commands.subscribe()
            cancel = CancelGeneration(
                command_id=CommandId("cancel-1"), target_command_id=generate.command_id
            )
            cluster.client.send_and_forget(cancel)
            for _ in range(2):
                assert (await sent.receive()).command == cancel
            assert created.task.task_id in cluster.state.tasks
            cluster.active = True
            while cluster.client.commands.unanswered_command_ids:
                await cluster.client.state_changed.wait()

        assert cluster.state.tasks == {}
        cancelled = [
            e
            for e in cluster.logged_events()
            if isinstance(e, TaskStatusUpdated) and isinstance(e.status, TaskCancelled)
        ]
        assert cancelled == [
            TaskStatusUpdated(task_id=created.task.task_id, status=TaskCancelled())
        ]


async def test_a_stream_whose_node_is_lost_ends_with_a_503_that_can_be_sent_again(
    tmp_path: Path,
) -> None:
    other = NodeId("node-2")
    async with in_process_cluster(tmp_path) as cluster:
        cluster.report_node()
        cluster.report_node(node_id=other)
        with anyio.fail_after(DEADLINE_SECONDS):
            assert await cluster.client.wait_for_node_reports()
            await cluster.client.submit(
                PlaceInstance(command_id=CommandId("place-1"), model_id=SMOLLM2, node_ids=(other,))
            )
            generate = GenerateText(command_id=CommandId("generate-1"), params=make_params())
            with cluster.client.chunk_stream(generate.command_id) as chunks:
                await cluster.client.submit(generate)
                # The master's links say node-2 is gone.
                cluster.master.emit(events_after_node_lost(cluster.master.state, other))
                [chunk] = [chunk async for chunk in chunks]
        assert isinstance(chunk, ErrorChunk)
        assert (chunk.status_code, chunk.error_code) == (503, INSTANCE_UNAVAILABLE)
        assert chunk.error_message.endswith(f"is unavailable: node {other} left; re-placing")
        assert cluster.state.tasks == {}


async def test_a_stream_ends_when_this_nodes_links_lose_a_node_of_its_instance() -> None:
    """Without a request the watcher sleeps; a routed request wakes it, and it sees the
    links drop the instance's other node before any event says so."""
    other = NodeId("node-2")
    instance = make_instance([NODE, other])
    state = make_state(instances=[instance])
    peers = {other}
    applied: Topic[IndexedEvent] = Topic("applied")
    election = FakeElection()
    election.elect(NODE)
    client = ClusterClient(
        node_id=NODE,
        current_state=lambda: state,
        applied_events=applied.subscribe(),
        chunk_subscription=Topic[Chunk]("chunks").subscribe(),
        command_publisher=Topic[ForwarderCommand]("commands").sender(),
        cards={},
        election=cast(Election, election),
        current_peers=lambda: frozenset(peers),
    )
    command_id = CommandId("generate-1")
    task = TextGeneration(
        task_id=TaskId("task-1"),
        command_id=command_id,
        instance_id=instance.instance_id,
        origin_node_id=NODE,
        params=make_params(),
    )
    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(client.run)
            with client.chunk_stream(command_id) as chunks:
                applied.publish(IndexedEvent(idx=0, event=TaskCreated(task=task)))
                await anyio.wait_all_tasks_blocked()
                peers.clear()  # the links lose node-2; no event says so yet
                [chunk] = [chunk async for chunk in chunks]
                # Still known after the loss: a mid-stream failover avoids that instance.
                assert client.routed_placement(command_id) == instance
            assert client.routed_placement(command_id) is None
            task_group.cancel_scope.cancel()
    assert isinstance(chunk, ErrorChunk)
    assert (chunk.status_code, chunk.error_code) == (503, INSTANCE_UNAVAILABLE)
