"""A node joining a compacted history takes the master's snapshot and the tail."""

from __future__ import annotations

from pathlib import Path

from exo.master.main import Master
from exo.master.tests.test_snapshots import make_events, run_history
from exo.node.event_log import EventLog, event_digest
from exo.node.tests.test_partition import drain
from exo.node.tests.test_replica import MASTER, make_harness
from exo.shared.apply import apply_all
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import RunnerId
from exo.shared.types.events import (
    ForwarderEvent,
    IndexedEvent,
    RunnerDeleted,
    StateSnapshot,
)
from exo.shared.types.state import State
from exo.utils.channels import Topic


def compacted_master(tmp_path: Path, count: int) -> tuple[Master, list[IndexedEvent], Topic]:
    events = make_events(count)
    log = EventLog(tmp_path / "master" / "events.jsonl", snapshot_every=100)
    state = run_history(log, events)
    published: Topic[IndexedEvent] = Topic("global_events")
    master = Master(
        node_id=MASTER,
        state=state,
        event_log=log,
        command_subscription=Topic[ForwarderCommand]("commands").subscribe(),
        local_event_subscription=Topic[ForwarderEvent]("local_events").subscribe(),
        global_event_publisher=published.sender(),
        cards={},
    )
    return master, events, published


def test_a_joining_node_takes_the_snapshot_then_the_tail(tmp_path: Path) -> None:
    master, events, published = compacted_master(tmp_path, 250)
    replies = published.subscribe()
    (tmp_path / "node").mkdir()
    harness = make_harness(tmp_path / "node")
    harness.follow(last_event_idx=249, last_event_digest=event_digest(events[-1]))
    harness.replica.check()
    assert harness.replays() == [0]
    master.replay(0)
    harness.receive(*drain(replies))
    assert harness.replica.state == apply_all(State(), events)
    assert harness.replica.caught_up()
    # The node's own log starts from the same snapshot.
    assert harness.log.base_idx == 199
    assert [e.idx for e in harness.log.events] == list(range(200, 250))
    applied = harness.drain_applied()
    assert isinstance(applied[0].event, StateSnapshot)
    assert [e.idx for e in applied[1:]] == list(range(200, 250))
    # Restarting the node reads back the same state.
    harness.log.close()
    assert EventLog(harness.log.path).load() == harness.replica.state


def test_a_snapshot_acknowledges_this_node_s_indexed_events(tmp_path: Path) -> None:
    master, _, published = compacted_master(tmp_path, 5)
    replies = published.subscribe()
    (tmp_path / "node").mkdir()
    harness = make_harness(tmp_path / "node")
    harness.local_events.emit(RunnerDeleted(runner_id=RunnerId("runner-1")))
    [forwarded] = drain(harness.forwarded)
    master.handle_local_event(forwarded)
    master._event_log.write_snapshot(master.state)
    master.replay(0)
    [snapshot] = drain(replies)[-1:]
    assert isinstance(snapshot.event, StateSnapshot)
    harness.follow(last_event_idx=snapshot.idx)
    harness.receive(snapshot)
    assert harness.local_events.pending() == []


def test_a_snapshot_of_another_history_at_an_index_held_resets(tmp_path: Path) -> None:
    master, events, published = compacted_master(tmp_path, 250)
    replies = published.subscribe()
    (tmp_path / "node").mkdir()
    other = make_events(230)
    other[210] = IndexedEvent(idx=210, event=RunnerDeleted(runner_id=RunnerId("elsewhere")))
    harness = make_harness(tmp_path / "node", held=other)
    harness.follow(last_event_idx=249, last_event_digest=event_digest(events[-1]))
    master.replay(0)
    harness.receive(*drain(replies))
    # The snapshot at 199 agrees with this node's event 199; event 210 does not: the node
    # drops its history (kept beside) and asks again from the start.
    assert list(tmp_path.joinpath("node").glob("events.jsonl.*.old"))
    assert harness.replays() == [0]
    master.replay(0)
    harness.receive(*drain(replies))
    assert harness.replica.state == apply_all(State(), events)
    assert harness.log.base_idx == 199
