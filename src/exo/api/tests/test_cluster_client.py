"""The API's cluster client holds commands while there is no master and resends the
unanswered ones to a new master."""

from __future__ import annotations

from typing import cast

import anyio
import pytest

from exo.api.cluster import ClusterClient, CommandRejectedError
from exo.shared.election import Election
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import DeleteInstance, ForwarderCommand
from exo.shared.types.common import CommandId, InstanceId, NodeId
from exo.shared.types.events import CommandRejected, IndexedEvent
from exo.shared.types.state import State
from exo.utils.channels import Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("api-node")


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
