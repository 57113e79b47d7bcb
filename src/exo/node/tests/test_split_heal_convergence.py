"""A healed split converges to one state while the losing side's master still acts.

Two nodes, each with its real master, replica, event log and local event sender, joined by
a link the test delivers messages over by hand. The sequence is the one the chaos
scenario (`tests/chaos/partition.py`) logged when its two sides never converged: A is
master; the link is cut and B elects itself; on the heal both masters still act for a
moment (B has not heard of the new election round yet), so B's copies reach A. Before the
fix A's replica took B's events and snapshot into its state (and log) while A's master
kept its own history, and the sides differed in `local_event_progress` for ever.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio

from exo.master.main import Master
from exo.node.election import Election, ElectionMessage
from exo.node.event_log import EventLog
from exo.node.replica import Replica
from exo.routing.connections import ConnectionMessage
from exo.shared.local_events import LocalEventSender
from exo.shared.types.commands import Command, ForwarderCommand
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import ForwarderEvent, IndexedEvent, NodeGatheredInfo
from exo.testing.builders import make_node_info
from exo.utils.channels import Subscription, Topic

T = TypeVar("T")
A = NodeId("node-a")
B = NodeId("node-b")
# Bounds the rounds of delivery until the states agree (each round one simulated second).
MAX_ROUNDS = 30


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _drain(subscription: Subscription[T]) -> list[T]:
    items: list[T] = []
    while True:
        try:
            items.append(subscription.receive_nowait())
        except anyio.WouldBlock:
            return items


@dataclass
class Node:
    """One node's history components, wired as `exo.main.Node` wires them."""

    node_id: NodeId
    log: EventLog
    election: Election
    replica: Replica
    master: Master
    sender: LocalEventSender
    published: Subscription[IndexedEvent]
    forwarded: Subscription[ForwarderEvent]
    commands: list[Command]

    def follow(self, master: Node, round_number: int) -> None:
        """The election of this node decided for `master` (its latest heartbeat)."""
        self.election.master = master.node_id
        self.election.election_clock = round_number
        self.election.master_message = master.heartbeat(round_number)

    def heartbeat(self, round_number: int) -> ElectionMessage:
        state = self.replica.state
        return ElectionMessage(
            node_id=self.node_id,
            clock=round_number,
            seniority=1,
            last_event_idx=state.last_event_applied_idx,
            last_event_digest=self.replica.last_event_digest(),
            history_id=state.history_id,
            master=self.node_id,
        )

    def report(self, memory_mib: int) -> None:
        """A local event (the node's gathered info), as the info gatherer sends it."""
        self.sender.emit(NodeGatheredInfo(node_id=self.node_id, info=make_node_info(memory_mib)))


def make_node(
    tmp_path: Path,
    node_id: NodeId,
    clock: FakeClock,
    history_dropped: Callable[[Collection[CommandId]], None] = lambda lost: None,
) -> Node:
    log = EventLog(tmp_path / node_id / "event_log.jsonl")
    state = log.load()
    holder: list[Replica] = []
    election = Election(
        node_id=node_id,
        election_publisher=Topic[ElectionMessage]("election").sender(),
        election_subscription=Topic[ElectionMessage]("election").subscribe(),
        connections=Topic[ConnectionMessage]("connections").subscribe(),
        current_peers=frozenset,
        current_state=lambda: holder[0].state,
        clock=clock,
    )
    local_events: Topic[ForwarderEvent] = Topic("local_events")
    forwarded = local_events.subscribe()
    sender = LocalEventSender(node_id, local_events.sender(), clock=clock)
    commands: list[Command] = []
    replica = Replica(
        node_id=node_id,
        state=state,
        event_log=log,
        global_events=Topic[IndexedEvent]("unused").subscribe(),
        send_command=commands.append,
        election=election,
        local_events=sender,
        clock=clock,
        history_dropped=history_dropped,
    )
    holder.append(replica)
    global_events: Topic[IndexedEvent] = Topic("global_events")
    published = global_events.subscribe()
    master = Master(
        node_id=node_id,
        state=state,
        event_log=log,
        command_subscription=Topic[ForwarderCommand]("commands").subscribe(),
        local_event_subscription=Topic[ForwarderEvent]("local_events").subscribe(),
        global_event_publisher=global_events.sender(),
        cards={},
        is_active=lambda: election.master == node_id,
        current_state=lambda: replica.state,
        clock=clock,
        wall_clock=clock,
    )
    return Node(node_id, log, election, replica, master, sender, published, forwarded, commands)


class Link:
    """Delivers each node's messages to the nodes it reaches, in a fixed order: the
    masters' copies to the replicas, then local events and commands to the masters
    (which act only while their node's election says they are master, as in
    `Master._command_loop`)."""

    def __init__(self, nodes: list[Node], clock: FakeClock) -> None:
        self.nodes = nodes
        self.clock = clock
        self.up = True

    def reached_from(self, node: Node) -> list[Node]:
        return self.nodes if self.up else [node]

    def deliver(self) -> None:
        for node in self.nodes:
            for copy in _drain(node.published):
                for target in self.reached_from(node):
                    target.replica.receive(copy)
        for node in self.nodes:
            for forwarded in _drain(node.forwarded):
                for target in self.reached_from(node):
                    if target.master._check_active():
                        target.master.handle_local_event(forwarded)
            commands, node.commands[:] = list(node.commands), []
            for command in commands:
                for target in self.reached_from(node):
                    if target.master._check_active():
                        target.master.handle_command(
                            ForwarderCommand(origin=node.node_id, command=command)
                        )

    def second(self, refresh: Callable[[], None] = lambda: None) -> None:
        """One simulated second: replicas check, overdue local events go again, and
        everything in flight is delivered (three hops: copy, request, reply)."""
        self.clock.now += 1.0
        refresh()
        for node in self.nodes:
            node.replica.check()
            node.sender.resend_overdue()
        for _ in range(3):
            self.deliver()


def test_a_healed_split_converges_while_the_losing_master_still_acts(tmp_path: Path) -> None:
    clock = FakeClock()
    a, b = make_node(tmp_path, A, clock), make_node(tmp_path, B, clock)
    link = Link([a, b], clock)

    # One cluster: A is master, both nodes report.
    a.follow(a, round_number=1)
    b.follow(a, round_number=1)
    assert a.master._check_active()
    a.report(8192)
    b.report(8192)
    for _ in range(3):
        link.second(lambda: b.follow(a, round_number=1))
    assert a.replica.state == b.replica.state == a.master.state
    assert a.replica.state.last_event_applied_idx == 2

    # The link is cut: B elects itself; each side indexes its own node's events.
    link.up = False
    b.follow(b, round_number=2)
    a.report(4096)
    for memory in (1024, 2048, 3072, 5120):
        b.report(memory)
    for _ in range(3):
        link.second()
    assert b.master.state.last_event_applied_idx > a.master.state.last_event_applied_idx

    # The link is back; for a moment both masters act (B's election has not heard of
    # the round that A wins) and each node's events reach both.
    link.up = True
    a.report(6144)
    link.deliver()
    b.report(7168)
    for _ in range(2):
        link.second()

    # The round is decided: A (forced) wins, B follows.
    a.follow(a, round_number=3)
    for _ in range(MAX_ROUNDS):
        link.second(lambda: b.follow(a, round_number=3))
        if (
            a.replica.state == a.master.state == b.replica.state
            and not a.sender.unacknowledged
            and not b.sender.unacknowledged
            and not b.replica.resyncing
        ):
            break
    winner = a.master.state
    assert a.replica.state == winner, "the winner's node applied another master's copies"
    assert b.replica.state == winner
    assert a.replica.state.local_event_progress == b.replica.state.local_event_progress
    # Both logs hold the winner's history, and the losing side's events made it into it.
    assert EventLog(a.log.path).load() == winner
    assert EventLog(b.log.path).load() == winner
    assert winner.node_info[B] == make_node_info(7168)
    assert not b.replica.resyncing
