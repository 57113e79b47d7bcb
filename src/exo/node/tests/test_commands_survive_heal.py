"""An acknowledged command survives an election and a split: applied exactly once.

Node B's API deletes an instance while B is its own master (cut off from A, or after A
stopped), and is answered: B's history holds the deletion. Then A comes back and wins
(forced master, or the split's winner) with a history that lacks it. B drops its history
for A's and sends its acknowledged commands again; A's master carries the deletion out
once, however often it is sent. Real masters, replicas, event logs and B's cluster client;
the link is driven by hand (`test_split_heal_convergence.Link`).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from exo.api.serving.cluster_client import ClusterClient
from exo.master.main import command_id_of
from exo.node.event_log import EventLog
from exo.node.tests.test_split_heal_convergence import (
    MAX_ROUNDS,
    A,
    B,
    FakeClock,
    Link,
    Node,
    make_node,
)
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import DeleteInstance, ForwarderCommand
from exo.shared.types.common import CommandId, InstanceId
from exo.shared.types.events import IndexedEvent, InstanceCreated, InstanceDeleted
from exo.testing.builders import make_instance
from exo.utils.channels import Subscription, Topic

INSTANCE = InstanceId("instance-x")
EARLIER = InstanceId("instance-y")


class ApiOfB:
    """B's `ClusterClient`, its commands handed to B's link and its applied events fed
    to it as `ClusterClient._event_loop` feeds them."""

    def __init__(self, node: Node, clock: FakeClock) -> None:
        commands: Topic[ForwarderCommand] = Topic("commands")
        self.node = node
        self.sent: Subscription[ForwarderCommand] = commands.subscribe()
        self.applied = node.replica.applied.subscribe()
        self.sent_ids: list[CommandId] = []
        """Every command id the client sent (and sent again), in order."""
        self.client = ClusterClient(
            node_id=node.node_id,
            current_state=lambda: node.replica.state,
            applied_events=self.applied,
            chunk_subscription=Topic[Chunk]("chunks").subscribe(),
            command_publisher=commands.sender(),
            cards={},
            election=node.election,
            current_peers=lambda: frozenset({A}),
            clock=clock,
        )

    def pump(self) -> None:
        self.client.commands.resend_due()
        while True:
            try:
                forwarded = self.sent.receive_nowait()
            except anyio.WouldBlock:
                break
            self.node.commands.append(forwarded.command)
            self.sent_ids.append(forwarded.command.command_id)
        while True:
            try:
                indexed_event: IndexedEvent = self.applied.receive_nowait()
            except anyio.WouldBlock:
                return
            self.client._on_event(indexed_event.event)
            self.client.commands.forget_answered_cancels()


def deletions(node: Node, command_id: CommandId) -> int:
    """Events of `node`'s log (as it would load) that carry out `command_id`."""
    log = EventLog(node.log.path)
    log.load()
    return sum(command_id_of(e.event) == command_id for e in log.events)


@pytest.mark.parametrize("fault", ["split", "forced election"])
def test_an_acknowledged_command_is_applied_exactly_once_after_the_heal(
    tmp_path: Path, fault: str
) -> None:
    clock = FakeClock()
    api: list[ApiOfB] = []
    a = make_node(tmp_path, A, clock)
    b = make_node(
        tmp_path, B, clock, history_dropped=lambda lost: api[0].client.history_dropped(lost)
    )
    api.append(ApiOfB(b, clock))
    link = Link([a, b], clock)

    def second() -> None:
        link.second(api[0].pump)
        api[0].pump()

    # One cluster, A master, with an instance on A.
    a.follow(a, round_number=1)
    b.follow(a, round_number=1)
    assert a.master._check_active()
    for instance_id in (INSTANCE, EARLIER):
        a.master.emit([InstanceCreated(instance=make_instance(A, instance_id=instance_id))])
    a.report(8192)
    # Acknowledged before the split: in both sides' history, never sent again.
    earlier = DeleteInstance(command_id=CommandId("delete-y"), instance_id=EARLIER)
    api[0].client.send_and_forget(earlier)
    for _ in range(3):
        second()
    assert INSTANCE in b.replica.state.instances and EARLIER not in b.replica.state.instances
    assert api[0].client.commands.unanswered_command_ids == []

    link.up = False
    if fault == "split":
        # Each side elects its own master; A's side goes on writing its history.
        b.follow(b, round_number=2)
        a.report(4096)
        second()
    else:
        # A stops; B's API is asked while the round is still open (no master).
        b.election.master = None
        b.election.master_message = None
    delete = DeleteInstance(command_id=CommandId("delete-x"), instance_id=INSTANCE)
    api[0].client.send_and_forget(delete)
    if fault == "forced election":
        second()
        b.follow(b, round_number=2)
    for _ in range(3):
        second()
    # Acknowledged: B's history carried it out, B's API holds no unanswered command.
    assert INSTANCE not in b.replica.state.instances
    assert api[0].client.commands.unanswered_command_ids == []
    assert deletions(b, delete.command_id) == 1
    assert deletions(a, delete.command_id) == 0

    # A is back and wins (forced); B's history is not the one the cluster keeps. A's
    # node reports as it does on every start (its first event after B's last).
    link.up = True
    a.follow(a, round_number=3)
    a.report(2048)
    sent_before_heal = len(api[0].sent_ids)
    for _ in range(MAX_ROUNDS):
        second()
        b.follow(a, round_number=3)
        if (
            b.replica.state == a.master.state
            and not api[0].client.commands.unanswered_command_ids
            and not b.replica.resyncing
        ):
            break
    assert INSTANCE not in a.master.state.instances
    assert b.replica.state == a.replica.state == a.master.state
    assert api[0].client.commands.unanswered_command_ids == []
    # Sent again after the drop (and resent until B saw the outcome), carried out once.
    assert deletions(a, delete.command_id) == 1
    assert deletions(b, delete.command_id) == 1
    # Only what the kept history lacked went again.
    assert set(api[0].sent_ids[sent_before_heal:]) == {delete.command_id}
    assert deletions(a, earlier.command_id) == 1
    assert isinstance(
        next(e.event for e in a.log.events if command_id_of(e.event) == delete.command_id),
        InstanceDeleted,
    )
    # Nothing is sent again afterwards.
    for _ in range(5):
        second()
    assert deletions(a, delete.command_id) == 1
