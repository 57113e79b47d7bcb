"""Master election: every node that sees the same peers elects the same master.

Each node broadcasts an `ElectionMessage` on the election topic twice a second (which
doubles as its heartbeat) and at once when something changes. A round (the election clock
goes up; a node that hears a higher clock joins that round) starts only when a node
starts, when the master is lost, or when two nodes follow different masters in the same
round. A round is decided once it has been quiet for `SETTLE_SECONDS` and every connected
peer has spoken in it (or `ROUND_MAX_SECONDS` passed): the winner is the candidate with
the highest `(force_master, seniority, last_event_idx, node_id)`.

A healthy master is never unseated by other nodes joining or leaving: peers that come
and go start no round, and a node in a round that hears a connected master announce
itself adopts it at once, unless it outranks that master (a `--force-master` node), in
which case its round ends in a new election that it wins.

Seniority counts the rounds a node has won in a row; after the master dies the survivors
(seniority 0) prefer the one holding the most of the history, and the node id breaks
ties — the same answer on every node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import anyio
from loguru import logger
from pydantic import Field

from exo.routing.connections import ConnectionMessage, PeerConnected, PeerDisconnected
from exo.shared.types.common import FrozenModel, NodeId
from exo.shared.types.state import State
from exo.utils.channels import Publisher, Subscription

BROADCAST_INTERVAL_SECONDS = 0.5
# A node that just started decides nothing before this: peers it has known (bootstrap
# peers, multicast neighbours) need a moment to connect, and a node that elects itself
# alone would write a history of its own that the cluster then discards.
STARTUP_GRACE_SECONDS = 3.0
TICK_SECONDS = 0.1
SETTLE_SECONDS = 1.5
ROUND_MAX_SECONDS = 5.0


class ElectionMessage(FrozenModel):
    """A node's candidacy and view, sent on the election topic."""

    node_id: NodeId
    clock: int = Field(ge=0)
    seniority: int = Field(ge=0)
    force_master: bool = False
    last_event_idx: int = Field(ge=-1)
    last_event_digest: str | None = None
    """Fingerprint of this node's event at `last_event_idx` (see `event_digest`)."""
    history_id: str | None = None
    master: NodeId | None = None
    """Who this node follows now; None while a round is open."""


def election_rank(message: ElectionMessage) -> tuple[bool, int, int, str]:
    return (message.force_master, message.seniority, message.last_event_idx, message.node_id)


def elect(candidates: Iterable[ElectionMessage]) -> NodeId:
    """The winner among `candidates` (never empty: a node always stands itself).

    Raises:
        ValueError: no candidates.
    """
    return max(candidates, key=election_rank).node_id


class Election:
    """Runs the election of one node and tells who the master is (`master`, None during a
    round; `master_changed` fires on every change)."""

    def __init__(
        self,
        node_id: NodeId,
        election_publisher: Publisher[ElectionMessage],
        election_subscription: Subscription[ElectionMessage],
        connections: Subscription[ConnectionMessage],
        current_peers: Callable[[], frozenset[NodeId]],
        current_state: Callable[[], State],
        force_master: bool = False,
        clock: Callable[[], float] = time.monotonic,
        last_event_digest: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.node_id = node_id
        self.force_master = force_master
        self._publisher = election_publisher
        self._messages = election_subscription
        self._connections = connections
        self._current_peers = current_peers
        self._current_state = current_state
        self._last_event_digest = last_event_digest
        self._now = clock
        self.election_clock = 0
        self.seniority = 0
        self.master: NodeId | None = None
        self.master_message: ElectionMessage | None = None
        self.master_changed = anyio.Event()
        self.latest: dict[NodeId, ElectionMessage] = {}
        self.last_heard: dict[NodeId, float] = {}
        """Monotonic time of the last message from each peer (heartbeats)."""
        self._round_started: float | None = None
        self._last_activity = 0.0
        self._started_at: float | None = None
        self._round_opened: anyio.Event | None = None
        """Set when a round opens, to wake `run` from its wait between rounds."""

    # -- messages ----------------------------------------------------------------------

    def own_message(self) -> ElectionMessage:
        state = self._current_state()
        return ElectionMessage(
            node_id=self.node_id,
            clock=self.election_clock,
            seniority=self.seniority,
            force_master=self.force_master,
            last_event_idx=state.last_event_applied_idx,
            last_event_digest=self._last_event_digest(),
            history_id=state.history_id,
            master=self.master,
        )

    def _broadcast(self) -> None:
        self._publisher.publish(self.own_message())

    def _set_master(self, master: NodeId | None) -> None:
        if master == self.master:
            return
        self.master = master
        if master is None:
            self.master_message = None
        self.master_changed.set()
        self.master_changed = anyio.Event()

    def start_round(self, election_clock: int, reason: str) -> None:
        logger.debug(f"election: round {election_clock} ({reason})")
        self.election_clock = election_clock
        self._round_started = self._now()
        self._last_activity = self._round_started
        self._set_master(None)
        self._broadcast()
        if self._round_opened is not None:
            self._round_opened.set()

    def on_connection(self, message: ConnectionMessage) -> None:
        match message:
            case PeerConnected(node_id=node_id):
                # The newcomer learns who leads from this node's next message: say it now.
                self.last_heard[node_id] = self._now()
                self._broadcast()
            case PeerDisconnected(node_id=node_id):
                self.latest.pop(node_id, None)
                if node_id == self.master:
                    self.start_round(self.election_clock + 1, f"master {node_id} was lost")

    def _adopts(self, message: ElectionMessage) -> bool:
        """Whether this node, in a round, follows the master that `message` announces
        (sent by that master itself) instead of electing: it is connected, speaks in this
        round or a later one, and this node does not outrank it."""
        return (
            self._round_started is not None
            and message.master == message.node_id
            and message.node_id in self._current_peers()
            and message.clock >= self.election_clock
            and election_rank(message) > election_rank(self.own_message())
        )

    def on_message(self, message: ElectionMessage) -> None:
        if message.node_id == self.node_id:
            return
        now = self._now()
        self.last_heard[message.node_id] = now
        previous = self.latest.get(message.node_id)
        if previous is not None and message.clock < previous.clock:
            return  # a late message from an earlier round
        self.latest[message.node_id] = message
        if self._adopts(message):
            self.election_clock = message.clock
            self._round_started = None
            self.seniority = 0
            self.master_message = message
            logger.info(f"election: following master {message.node_id} (round {message.clock})")
            self._set_master(message.node_id)
            self._broadcast()
            return
        if message.clock > self.election_clock:
            self.start_round(message.clock, f"{message.node_id} is in round {message.clock}")
            return
        if message.clock < self.election_clock:
            return
        if self._round_started is not None:
            if previous is None or previous.clock != message.clock:
                self._last_activity = now
            return
        if message.master is not None and message.master != self.master:
            # Same round, different winner: someone decided on other information.
            self.start_round(self.election_clock + 1, f"{message.node_id} follows another master")
        elif self.master is not None and message.node_id == self.master:
            self.master_message = message

    def tick(self) -> None:
        """Decide the open round when it has settled."""
        if self._round_started is None:
            return
        now = self._now()
        peers = self._current_peers()
        in_round = {
            node_id: message
            for node_id, message in self.latest.items()
            if node_id in peers and message.clock == self.election_clock
        }
        everyone_spoke = set(in_round) >= peers
        settled = now - self._last_activity >= SETTLE_SECONDS
        overdue = now - self._round_started >= ROUND_MAX_SECONDS
        if not ((settled and everyone_spoke) or overdue):
            return
        if self._started_at is not None and now - self._started_at < STARTUP_GRACE_SECONDS:
            return
        candidates = [self.own_message(), *in_round.values()]
        winner = elect(candidates)
        self._round_started = None
        self.seniority = self.seniority + 1 if winner == self.node_id else 0
        self.master_message = next(c for c in candidates if c.node_id == winner)
        logger.info(
            f"election: round {self.election_clock} -> master {winner}"
            + (" (this node)" if winner == self.node_id else "")
        )
        self._set_master(winner)
        self._broadcast()

    # -- loops -------------------------------------------------------------------------

    async def run(self) -> None:
        """Tick every `TICK_SECONDS` while a round is open; between rounds (`tick` has
        nothing to decide) wake only for the next heartbeat or when a round opens."""
        self._started_at = self._now()
        self._round_opened = anyio.Event()
        self.start_round(self.election_clock + 1, "node started")
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._connection_loop)
            task_group.start_soon(self._message_loop)
            last_broadcast = self._now()
            while True:
                self.tick()
                if self._now() - last_broadcast >= BROADCAST_INTERVAL_SECONDS:
                    self._broadcast()
                    last_broadcast = self._now()
                if self._round_started is not None:
                    await anyio.sleep(TICK_SECONDS)
                    continue
                self._round_opened = anyio.Event()
                next_broadcast = last_broadcast + BROADCAST_INTERVAL_SECONDS - self._now()
                with anyio.move_on_after(max(0.0, next_broadcast)):
                    await self._round_opened.wait()

    async def _connection_loop(self) -> None:
        async for message in self._connections:
            self.on_connection(message)

    async def _message_loop(self) -> None:
        async for message in self._messages:
            self.on_message(message)
