"""Elections of several nodes, driven step by step: one shared topic, a fake clock, and
peer sets the test controls (what the router would report)."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import pytest

from exo.node.election import (
    BROADCAST_INTERVAL_SECONDS,
    ROUND_MAX_SECONDS,
    SETTLE_SECONDS,
    TICK_SECONDS,
    Election,
    ElectionMessage,
    elect,
)
from exo.routing.connections import ConnectionMessage, PeerConnected, PeerDisconnected
from exo.shared.types.common import NodeId
from exo.shared.types.state import State
from exo.utils.channels import Subscription, Topic

pytestmark = pytest.mark.anyio

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
# Enough for any round among live peers to settle, with margin.
DECIDE_WITHIN_SECONDS = ROUND_MAX_SECONDS + 1


START = 1000.0


class FakeClock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    election: Election
    inbox: Subscription[ElectionMessage]
    peers: set[NodeId] = field(default_factory=set)
    state: State = field(default_factory=State)


class Network:
    """Nodes on one election topic, run the way `Election.run` would run them."""

    def __init__(self) -> None:
        self.topic: Topic[ElectionMessage] = Topic("election")
        self.clock = FakeClock()
        self.nodes: dict[NodeId, Node] = {}
        self._last_broadcast = self.clock.now

    def add(self, node_id: NodeId, last_event_idx: int = -1, force_master: bool = False) -> Node:
        node: Node
        election = Election(
            node_id=node_id,
            election_publisher=self.topic.sender(),
            election_subscription=self.topic.subscribe(),
            connections=Topic[ConnectionMessage]("connections").subscribe(),
            current_peers=lambda: frozenset(node.peers),
            current_state=lambda: node.state,
            force_master=force_master,
            clock=self.clock,
        )
        node = Node(election, self.topic.subscribe(), state=_state(last_event_idx))
        self.nodes[node_id] = node
        election.start_round(election.election_clock + 1, "node started")
        return node

    def connect(self, *node_ids: NodeId) -> None:
        """Mesh `node_ids` with every other live node, as the router reports it."""
        for node_id in node_ids:
            for other_id, other in self.nodes.items():
                if other_id == node_id or other_id in self.nodes[node_id].peers:
                    continue
                self.nodes[node_id].peers.add(other_id)
                self.nodes[node_id].election.on_connection(PeerConnected(node_id=other_id))
                other.peers.add(node_id)
                other.election.on_connection(PeerConnected(node_id=node_id))
        self.deliver()

    def kill(self, node_id: NodeId) -> None:
        dead = self.nodes.pop(node_id)
        dead.inbox.close()
        for node in self.nodes.values():
            if node_id in node.peers:
                node.peers.discard(node_id)
                node.election.on_connection(PeerDisconnected(node_id=node_id))
        self.deliver()

    def deliver(self) -> None:
        """Hand every published message to every live node until nobody has more to say."""
        for _ in range(1000):
            delivered = False
            for node in self.nodes.values():
                while True:
                    try:
                        message = node.inbox.receive_nowait()
                    except anyio.WouldBlock:
                        break
                    node.election.on_message(message)
                    delivered = True
            if not delivered:
                return
        raise AssertionError("elections never stopped talking")

    def step(self) -> None:
        self.clock.now += TICK_SECONDS
        if self.clock.now - self._last_broadcast >= BROADCAST_INTERVAL_SECONDS:
            for node in self.nodes.values():
                self.topic.publish(node.election.own_message())
            self._last_broadcast = self.clock.now
        self.deliver()
        for node in self.nodes.values():
            node.election.tick()
        self.deliver()

    def run_until_decided(self, within: float = DECIDE_WITHIN_SECONDS) -> float:
        """Step until every live node follows a master; returns the seconds it took."""
        started = self.clock.now
        while any(node.election.master is None for node in self.nodes.values()):
            assert self.clock.now - started <= within, self.masters()
            self.step()
        return self.clock.now - started

    def masters(self) -> dict[NodeId, NodeId | None]:
        return {node_id: node.election.master for node_id, node in self.nodes.items()}


def _state(last_event_idx: int) -> State:
    return State(last_event_applied_idx=last_event_idx)


def three_nodes(idx_a: int = 5, idx_b: int = 3, idx_c: int = 9) -> Network:
    network = Network()
    network.add(NODE_A, idx_a)
    network.add(NODE_B, idx_b)
    network.add(NODE_C, idx_c)
    network.connect(NODE_A, NODE_B, NODE_C)
    return network


def message(node_id: str, **fields: object) -> ElectionMessage:
    values: dict[str, object] = {"clock": 0, "seniority": 0, "last_event_idx": -1, **fields}
    return ElectionMessage.model_validate({"node_id": node_id, **values})


def test_elect_ranks_force_then_seniority_then_history_then_node_id() -> None:
    assert elect([message("a"), message("b"), message("c", last_event_idx=-1)]) == "c"
    assert elect([message("c"), message("a", last_event_idx=0)]) == "a"
    assert elect([message("c", last_event_idx=9), message("a", seniority=1)]) == "a"
    assert elect([message("c", seniority=5), message("a", force_master=True)]) == "a"
    with pytest.raises(ValueError):
        elect([])


async def test_three_nodes_elect_the_same_master() -> None:
    network = three_nodes()
    changed = [node.election.master_changed for node in network.nodes.values()]
    network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_C, NODE_B: NODE_C, NODE_C: NODE_C}
    assert all(event.is_set() for event in changed)
    clocks = {node.election.election_clock for node in network.nodes.values()}
    assert len(clocks) == 1
    for node in network.nodes.values():
        assert node.election.master_message is not None
        assert node.election.master_message.node_id == NODE_C
        assert node.election.master_message.last_event_idx == 9
    assert network.nodes[NODE_C].election.seniority == 1
    assert network.nodes[NODE_A].election.seniority == 0
    # A settled election stays settled: heartbeats do not start rounds.
    for _ in range(int(3 * ROUND_MAX_SECONDS / TICK_SECONDS)):
        network.step()
    assert network.masters() == {NODE_A: NODE_C, NODE_B: NODE_C, NODE_C: NODE_C}
    assert {node.election.election_clock for node in network.nodes.values()} == clocks


async def test_master_is_none_during_a_round() -> None:
    network = three_nodes()
    assert network.masters() == {NODE_A: None, NODE_B: None, NODE_C: None}
    network.step()
    assert network.masters() == {NODE_A: None, NODE_B: None, NODE_C: None}
    assert all(node.election.own_message().master is None for node in network.nodes.values())
    network.run_until_decided()
    # Every peer spoke at once, so the round ends when it has been quiet long enough.
    assert SETTLE_SECONDS <= network.clock.now - START < ROUND_MAX_SECONDS
    # A node joining starts no round: the others keep their master, the newcomer adopts it.
    network.add(NodeId("node-d"))
    network.connect(NodeId("node-d"))
    assert set(network.masters().values()) == {NODE_C}


async def test_incumbent_keeps_mastership_when_a_node_joins() -> None:
    network = Network()
    network.add(NODE_A, last_event_idx=5)
    network.add(NODE_B, last_event_idx=3)
    network.connect(NODE_A, NODE_B)
    network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A}
    # C holds more history and a higher id, but A has won before.
    network.add(NODE_C, last_event_idx=9)
    network.connect(NODE_C)
    # A and B never leave A: the newcomer adopts A as soon as A speaks.
    assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A, NODE_C: NODE_A}
    for _ in range(int(2 * ROUND_MAX_SECONDS / TICK_SECONDS)):
        network.step()
        assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A, NODE_C: NODE_A}
    assert network.nodes[NODE_A].election.seniority == 1
    assert network.nodes[NODE_C].election.election_clock == (
        network.nodes[NODE_A].election.election_clock
    )


async def test_a_non_master_leaving_or_returning_never_unseats_the_master() -> None:
    network = three_nodes(idx_a=5, idx_b=3, idx_c=9)
    network.run_until_decided()
    clock = network.nodes[NODE_C].election.election_clock
    network.kill(NODE_A)
    assert network.masters() == {NODE_B: NODE_C, NODE_C: NODE_C}
    for _ in range(int(2 * ROUND_MAX_SECONDS / TICK_SECONDS)):
        network.step()
        assert network.masters() == {NODE_B: NODE_C, NODE_C: NODE_C}
    # A restarts holding more history than anyone: it follows C, it does not take over.
    network.add(NODE_A, last_event_idx=50)
    network.connect(NODE_A)
    assert network.masters() == {NODE_A: NODE_C, NODE_B: NODE_C, NODE_C: NODE_C}
    for _ in range(int(2 * ROUND_MAX_SECONDS / TICK_SECONDS)):
        network.step()
        assert network.masters() == {NODE_A: NODE_C, NODE_B: NODE_C, NODE_C: NODE_C}
    assert {n.election.election_clock for n in network.nodes.values()} == {clock}


async def test_only_the_loss_of_the_master_starts_a_round() -> None:
    network = three_nodes(idx_a=5, idx_b=3, idx_c=9)
    network.run_until_decided()
    clock = network.nodes[NODE_A].election.election_clock
    network.kill(NODE_C)
    assert network.masters() == {NODE_A: None, NODE_B: None}
    assert network.nodes[NODE_A].election.election_clock == clock + 1
    elapsed = network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A}
    assert elapsed < ROUND_MAX_SECONDS


async def test_survivors_elect_the_node_with_the_most_history() -> None:
    network = three_nodes(idx_a=5, idx_b=3, idx_c=9)
    network.run_until_decided()
    network.kill(NODE_C)
    assert network.masters() == {NODE_A: None, NODE_B: None}
    network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A}


async def test_survivors_with_equal_history_elect_the_highest_node_id() -> None:
    network = three_nodes(idx_a=5, idx_b=5, idx_c=9)
    network.run_until_decided()
    network.kill(NODE_C)
    network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_B, NODE_B: NODE_B}


async def test_force_master_wins_over_history_and_seniority() -> None:
    network = Network()
    network.add(NODE_B, last_event_idx=9)
    network.add(NODE_C, last_event_idx=9)
    network.connect(NODE_B, NODE_C)
    network.run_until_decided()
    assert network.masters() == {NODE_B: NODE_C, NODE_C: NODE_C}
    network.add(NODE_A, last_event_idx=-1, force_master=True)
    network.connect(NODE_A)
    network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A, NODE_C: NODE_A}
    assert network.nodes[NODE_C].election.seniority == 0


async def test_a_higher_clock_from_a_peer_is_adopted() -> None:
    network = Network()
    node = network.add(NODE_A)
    node.peers.add(NODE_B)
    network.deliver()
    assert node.election.election_clock == 1
    node.election.on_message(message(NODE_B, clock=7, last_event_idx=3))
    assert node.election.election_clock == 7
    assert node.election.master is None
    # A message from an older round changes nothing.
    node.election.on_message(message(NODE_C, clock=2, last_event_idx=30))
    assert node.election.election_clock == 7
    # B spoke in round 7, so A decides as soon as the round is quiet, for B.
    elapsed = network.run_until_decided()
    assert elapsed < ROUND_MAX_SECONDS
    assert node.election.master == NODE_B
    assert node.election.election_clock == 7


async def test_disagreement_in_the_same_round_starts_a_new_round() -> None:
    network = Network()
    network.add(NODE_A, last_event_idx=5)
    network.add(NODE_B, last_event_idx=3)
    network.connect(NODE_A, NODE_B)
    network.run_until_decided()
    node = network.nodes[NODE_A]
    decided_clock = node.election.election_clock
    assert node.election.master == NODE_A
    # B claims to follow someone else in the round A decided.
    claim = message(NODE_B, clock=decided_clock, last_event_idx=3, master=NODE_C)
    node.election.on_message(claim)
    assert node.election.election_clock == decided_clock + 1
    assert node.election.master is None
    network.deliver()
    assert network.nodes[NODE_B].election.election_clock == decided_clock + 1
    network.run_until_decided()
    assert network.masters() == {NODE_A: NODE_A, NODE_B: NODE_A}
    # Agreement in the same round is no reason for a new one.
    agreed_clock = node.election.election_clock
    node.election.on_message(message(NODE_B, clock=agreed_clock, last_event_idx=3, master=NODE_A))
    assert (node.election.election_clock, node.election.master) == (agreed_clock, NODE_A)


async def test_a_silent_connected_peer_delays_the_decision_to_the_round_limit() -> None:
    network = Network()
    network.add(NODE_A, last_event_idx=1)
    network.add(NODE_B, last_event_idx=2)
    network.connect(NODE_A, NODE_B)
    # The router reports C on both nodes, but C never speaks on the election topic.
    for node in network.nodes.values():
        node.peers.add(NODE_C)
        node.election.on_connection(PeerConnected(node_id=NODE_C))
    network.deliver()
    while network.clock.now - START < ROUND_MAX_SECONDS - 2 * TICK_SECONDS:
        network.step()
        assert network.masters() == {NODE_A: None, NODE_B: None}
    elapsed = network.run_until_decided(within=ROUND_MAX_SECONDS)
    assert network.clock.now - START >= ROUND_MAX_SECONDS
    assert elapsed <= 3 * TICK_SECONDS
    assert network.masters() == {NODE_A: NODE_B, NODE_B: NODE_B}


async def test_messages_are_heartbeats() -> None:
    network = Network()
    network.add(NODE_A)
    network.add(NODE_B)
    network.connect(NODE_A, NODE_B)
    network.run_until_decided()
    network.clock.now += 10
    network.step()
    # Each node heard the other's periodic broadcast at the current time; never itself.
    assert network.nodes[NODE_A].election.last_heard == {NODE_B: network.clock.now}
    assert network.nodes[NODE_B].election.last_heard == {NODE_A: network.clock.now}


async def test_a_late_message_from_an_earlier_round_does_not_hide_the_peer() -> None:
    network = Network()
    node = network.add(NODE_A)
    node.peers.add(NODE_B)
    node.election.on_message(message(NODE_B, clock=7, last_event_idx=3))
    # B's round-6 message arrives after its round-7 one (another path, a resend).
    node.election.on_message(message(NODE_B, clock=6, last_event_idx=3))
    assert node.election.latest[NODE_B].clock == 7
    elapsed = network.run_until_decided()
    assert elapsed < ROUND_MAX_SECONDS
    assert node.election.master == NODE_B
