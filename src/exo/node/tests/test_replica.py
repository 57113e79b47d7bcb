"""The replica of one node, fed indexed events by hand, with a fake clock."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from exo.node.election import Election, ElectionMessage
from exo.node.event_log import EventLog, event_digest
from exo.node.replica import REPLAY_RETRY_SECONDS, Replica
from exo.routing.connections import ConnectionMessage
from exo.shared.apply import apply_all
from exo.shared.local_events import LocalEventSender
from exo.shared.types.commands import REPLAY_BATCH, Command, RequestEventReplay
from exo.shared.types.common import NodeId, RunnerId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    Event,
    ForwarderEvent,
    IndexedEvent,
    RunnerDeleted,
)
from exo.shared.types.state import State
from exo.utils.channels import Subscription, Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("node-a")
MASTER = NodeId("node-m")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def history(count: int, history_id: str = "history-1") -> list[IndexedEvent]:
    """Event 0 names the history; the rest are distinct runner deletions."""
    events: list[Event] = [ClusterHistoryStarted(history_id=history_id, master=MASTER)]
    events += [RunnerDeleted(runner_id=RunnerId(f"{history_id}-r{i}")) for i in range(1, count)]
    return [IndexedEvent(idx=i, event=event) for i, event in enumerate(events)]


@dataclass
class Harness:
    replica: Replica
    election: Election
    log: EventLog
    local_events: LocalEventSender
    forwarded: Subscription[ForwarderEvent]
    applied: Subscription[IndexedEvent]
    commands: list[Command]
    clock: FakeClock

    def follow(
        self,
        last_event_idx: int = -1,
        history_id: str | None = "history-1",
        last_event_digest: str | None = None,
    ) -> None:
        """What the election reports once `MASTER` won."""
        self.election.master = MASTER
        self.election.master_message = ElectionMessage(
            node_id=MASTER,
            clock=3,
            seniority=1,
            last_event_idx=last_event_idx,
            last_event_digest=last_event_digest,
            history_id=history_id,
            master=MASTER,
        )

    def receive(self, *events: IndexedEvent) -> None:
        """Deliver `events`; a copy not stamped by a master comes from `MASTER`."""
        for event in events:
            if event.published_by is None:
                event = event.model_copy(update={"published_by": MASTER})
            self.replica.receive(event)

    def replays(self) -> list[int]:
        return [c.from_idx for c in self.commands if isinstance(c, RequestEventReplay)]

    def drain_applied(self) -> list[IndexedEvent]:
        applied = []
        while True:
            try:
                applied.append(self.applied.receive_nowait())
            except anyio.WouldBlock:
                return applied


def make_harness(tmp_path: Path, held: list[IndexedEvent] | None = None) -> Harness:
    """A replica of a node that holds `held` (in its log and its state)."""
    clock = FakeClock()
    log = EventLog(tmp_path / "events.jsonl")
    log.append(held or [])
    state = apply_all(State(), log.events)
    replica_holder: list[Replica] = []
    election = Election(
        node_id=NODE,
        election_publisher=Topic[ElectionMessage]("election").sender(),
        election_subscription=Topic[ElectionMessage]("election").subscribe(),
        connections=Topic[ConnectionMessage]("connections").subscribe(),
        current_peers=frozenset,
        current_state=lambda: replica_holder[0].state,
        clock=clock,
    )
    forwarded: Topic[ForwarderEvent] = Topic("local_events")
    forwarded_subscription = forwarded.subscribe()
    local_events = LocalEventSender(NODE, forwarded.sender(), clock=clock)
    commands: list[Command] = []
    replica = Replica(
        node_id=NODE,
        state=state,
        event_log=log,
        global_events=Topic[IndexedEvent]("global_events").subscribe(),
        send_command=commands.append,
        election=election,
        local_events=local_events,
        clock=clock,
    )
    replica_holder.append(replica)
    return Harness(
        replica,
        election,
        log,
        local_events,
        forwarded_subscription,
        replica.applied.subscribe(),
        commands,
        clock,
    )


async def test_events_in_order_are_applied_persisted_and_announced(tmp_path: Path) -> None:
    harness = make_harness(tmp_path)
    harness.follow(last_event_idx=2)
    events = history(3)
    changed = harness.replica.changed
    harness.receive(*events)
    assert harness.replica.state == apply_all(State(), events)
    assert harness.replica.state.history_id == "history-1"
    assert harness.drain_applied() == events
    assert changed.is_set()
    assert harness.replays() == []
    assert not harness.replica.behind_master()
    harness.log.close()
    assert EventLog(harness.log.path).read_all() == events


async def test_out_of_order_events_wait_for_the_gap_then_apply_in_order(tmp_path: Path) -> None:
    harness = make_harness(tmp_path)
    harness.follow(last_event_idx=3)
    events = history(4)
    harness.receive(events[0], events[3], events[2])
    assert harness.replica.state.last_event_applied_idx == 0
    assert harness.drain_applied() == events[:1]
    assert harness.log.events == events[:1]
    harness.receive(events[1])
    assert harness.replica.state == apply_all(State(), events)
    assert harness.drain_applied() == events[1:]
    assert harness.log.events == events


async def test_duplicate_events_are_ignored(tmp_path: Path) -> None:
    harness = make_harness(tmp_path)
    harness.follow()
    events = history(2)
    harness.receive(events[0], events[0], events[1], events[0], events[1])
    assert harness.drain_applied() == events
    assert harness.log.events == events
    assert harness.replays() == []
    # Another event at an index we hold means our history forked: start over from 0.
    forked = IndexedEvent(idx=1, event=RunnerDeleted(runner_id=RunnerId("other")))
    session = harness.local_events.session
    harness.receive(forked)
    assert harness.replica.state.last_event_applied_idx == -1
    assert harness.replays() == [0]
    assert harness.local_events.session != session  # our events are sent again


async def test_a_gap_asks_for_one_replay_until_the_retry_delay(tmp_path: Path) -> None:
    harness = make_harness(tmp_path)
    harness.follow(last_event_idx=9)
    events = history(10)
    harness.receive(events[0], events[2])
    assert harness.replays() == [0]
    harness.receive(events[3])
    harness.clock.now += REPLAY_RETRY_SECONDS * 0.9
    harness.receive(events[4])
    harness.replica.check()
    assert harness.replays() == [0]
    harness.clock.now += REPLAY_RETRY_SECONDS * 0.2
    harness.replica.check()
    assert harness.replays() == [0, 0]
    # Filling the gap applies what was buffered; the next gap lies inside what the last
    # request asked for (a batch from 0), so it is asked for again only once that reply
    # stalls.
    harness.receive(events[1], events[7])
    assert harness.replica.state.last_event_applied_idx == 4
    assert harness.replays() == [0, 0]
    harness.clock.now += REPLAY_RETRY_SECONDS
    harness.replica.check()
    assert harness.replays() == [0, 0, 4]


async def test_a_replay_batch_being_applied_asks_for_no_other(tmp_path: Path) -> None:
    # A node joining a long history asked again after every event it applied while the
    # master's live events waited ahead: one request per event, each answered by up to a
    # batch (a new-user trial: 1,366 requests, 3-4 minutes to catch up with 1,580 events).
    harness = make_harness(tmp_path)
    events = history(2 * REPLAY_BATCH + 10)
    last = len(events) - 1
    harness.follow(last_event_idx=last)
    harness.receive(events[last])  # a live event: the rest is a gap to replay
    assert harness.replays() == [0]
    for _ in range(4):  # the master's replies: a batch from each request, in order
        asked = harness.replays()[-1]
        harness.receive(*events[asked : min(asked + REPLAY_BATCH, last)])
        if harness.replica.state.last_event_applied_idx == last:
            break
    assert harness.replica.state.last_event_applied_idx == last
    # One request per batch: each asked once the previous batch was applied.
    assert harness.replays() == [0, REPLAY_BATCH - 1, 2 * REPLAY_BATCH - 2]
    harness.clock.now += 2 * REPLAY_RETRY_SECONDS
    harness.replica.check()
    assert len(harness.replays()) == 3  # caught up: nothing more to ask


async def test_no_replay_is_asked_without_a_master(tmp_path: Path) -> None:
    harness = make_harness(tmp_path)
    events = history(3)
    harness.receive(events[0], events[2])
    harness.replica.check()
    assert harness.replays() == []
    harness.follow(last_event_idx=2)
    harness.replica.check()
    assert harness.replays() == [0]


async def test_a_replica_behind_the_master_asks_for_what_it_lacks(tmp_path: Path) -> None:
    held = history(2)
    harness = make_harness(tmp_path, held=held)
    harness.follow(last_event_idx=1, last_event_digest=event_digest(held[1]))
    harness.replica.check()
    assert harness.replays() == []
    harness.follow(last_event_idx=6)
    assert harness.replica.behind_master()
    harness.replica.check()
    harness.replica.check()
    assert harness.replays() == [1]  # from the last held event, which the reply confirms
    # The master's own replica has nobody to ask.
    harness.election.master_message = harness.election.own_message()
    harness.clock.now += 2 * REPLAY_RETRY_SECONDS
    harness.replica.check()
    assert harness.replays() == [1]


async def test_another_history_archives_the_log_and_starts_from_empty(tmp_path: Path) -> None:
    old = history(4, "old-history")
    harness = make_harness(tmp_path, held=old)
    changed = harness.replica.changed
    harness.follow(last_event_idx=1, history_id="new-history")
    harness.replica.check()
    assert harness.replica.state == State()
    assert changed.is_set()
    assert harness.log.events == []
    [archive] = [path for path in tmp_path.iterdir() if path != harness.log.path]
    assert EventLog(archive).read_all() == old
    # It asks for the new history from its start and persists it in a fresh log.
    assert harness.replays() == [0]
    new = history(2, "new-history")
    harness.receive(*new)
    assert harness.replica.state == apply_all(State(), new)
    harness.log.close()
    assert EventLog(harness.log.path).read_all() == new


async def test_same_or_unknown_history_is_kept(tmp_path: Path) -> None:
    held = history(3)
    harness = make_harness(tmp_path, held=held)
    harness.follow(last_event_idx=2, history_id="history-1")
    harness.replica.check()
    harness.follow(last_event_idx=2, history_id=None)
    harness.replica.check()
    assert harness.replica.state == apply_all(State(), held)
    assert [path.name for path in tmp_path.iterdir()] == [harness.log.path.name]


async def test_a_diverged_event_at_the_masters_index_starts_over(tmp_path: Path) -> None:
    # Same history, but after a split this node holds other events than the master.
    held = history(4)
    harness = make_harness(tmp_path, held=held)
    masters_event = IndexedEvent(idx=2, event=RunnerDeleted(runner_id=RunnerId("other-side")))
    harness.follow(
        last_event_idx=2, history_id="history-1", last_event_digest=event_digest(masters_event)
    )
    harness.replica.check()
    assert harness.replica.state == State()
    assert harness.replays() == [0]


async def test_a_matching_event_at_the_masters_index_is_kept(tmp_path: Path) -> None:
    held = history(4)
    harness = make_harness(tmp_path, held=held)
    harness.follow(
        last_event_idx=2, history_id="history-1", last_event_digest=event_digest(held[2])
    )
    harness.replica.check()
    assert harness.replica.state == apply_all(State(), held)
    assert harness.replica.last_event_digest() == event_digest(held[3])


async def test_own_local_events_are_acknowledged_when_applied(tmp_path: Path) -> None:
    held = history(1)
    harness = make_harness(tmp_path, held=held)
    harness.follow()
    harness.receive(held[0])  # a replay's first event: the master continues this history
    sender = harness.local_events
    sender.emit(RunnerDeleted(runner_id=RunnerId("mine-0")))
    sender.emit(RunnerDeleted(runner_id=RunnerId("mine-1")))
    first, second = harness.forwarded.receive_nowait(), harness.forwarded.receive_nowait()
    assert sender.unacknowledged == 2

    def indexed_from(idx: int, forwarded: ForwarderEvent) -> IndexedEvent:
        return IndexedEvent(
            idx=idx,
            event=forwarded.event,
            origin=forwarded.origin,
            origin_session=forwarded.origin_session,
            origin_idx=forwarded.origin_idx,
        )

    # Buffered (out of order) is not applied, so not acknowledged yet.
    harness.receive(indexed_from(2, second))
    assert sender.unacknowledged == 2
    harness.receive(indexed_from(1, first))
    assert sender.unacknowledged == 0
    harness.clock.now += 10
    assert sender.resend_overdue() == 0


async def test_a_node_is_caught_up_only_once_it_holds_the_masters_history(tmp_path: Path) -> None:
    held = history(5)
    harness = make_harness(tmp_path, held=held[:4])
    # No master yet: a node restarting from its own log knows nothing current.
    assert not harness.replica.caught_up()
    harness.follow(last_event_idx=4, last_event_digest=event_digest(held[4]))
    assert not harness.replica.caught_up()  # behind: event 4 is missing
    harness.receive(held[3], held[4])  # the replay from the last event it holds
    assert harness.replica.caught_up()
    # Same index, another event there: a history that forked is not the master's.
    harness.follow(last_event_idx=4, last_event_digest="another event")
    assert not harness.replica.caught_up()
    harness.follow(last_event_idx=4, history_id="history-2")
    assert not harness.replica.caught_up()


async def test_copies_from_a_master_this_node_does_not_follow_are_dropped(tmp_path: Path) -> None:
    harness = make_harness(tmp_path)
    events = history(3)
    # During a round (no master) and from another master: nothing is applied.
    harness.receive(events[0])
    harness.follow(last_event_idx=2)
    other = NodeId("node-other")
    harness.receive(*[event.model_copy(update={"published_by": other}) for event in events])
    assert harness.replica.state == State()
    harness.receive(*events)  # the followed master's copies
    assert harness.replica.state == apply_all(State(), events)
    # What was applied and persisted carries no sender: it is history.
    assert [event.published_by for event in harness.drain_applied()] == [None] * 3
    assert harness.log.events == events


async def test_a_new_master_s_next_event_waits_until_its_history_is_known_to_continue(
    tmp_path: Path,
) -> None:
    held = history(3)
    harness = make_harness(tmp_path, held=held)
    harness.follow(last_event_idx=3)
    # The master's next event: not applied on faith (a fork's next index looks the
    # same); the master is asked from our last event.
    next_event = history(4)[3]
    harness.receive(next_event)
    assert harness.replica.state == apply_all(State(), held)
    assert harness.replays() == [2]
    # The replay's first event is ours: the master continues this history.
    harness.receive(held[2])
    assert harness.replica.state == apply_all(State(), [*held, next_event])


async def test_a_new_master_s_replay_that_differs_at_our_last_event_starts_over(
    tmp_path: Path,
) -> None:
    held = history(3)
    harness = make_harness(tmp_path, held=held)
    harness.follow(last_event_idx=3)
    theirs = [*held[:2], IndexedEvent(idx=2, event=RunnerDeleted(runner_id=RunnerId("theirs")))]
    harness.receive(history(4)[3])
    harness.receive(theirs[2])
    assert harness.replica.state == State()
    assert harness.replica.resyncing


async def test_the_master_s_own_node_applies_from_its_log_what_it_missed(tmp_path: Path) -> None:
    events = history(4)
    harness = make_harness(tmp_path, held=events[:2])
    # This node's master wrote events 2 and 3 while its copies were dropped (a round).
    harness.log.append(events[2:])
    harness.election.master = NODE
    harness.election.master_message = harness.election.own_message()
    harness.replica.check()
    assert harness.replica.state == apply_all(State(), events)
    assert harness.replays() == []
