"""Compaction into snapshots, and recovery from a damaged log or snapshot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exo.master.main import Master
from exo.node import event_log as event_log_module
from exo.node.event_log import EventLog, event_digest
from exo.shared.apply import apply, apply_all
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import NodeId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    Event,
    ForwarderEvent,
    IndexedEvent,
    NodeGatheredInfo,
    StateSnapshot,
    TopologyEdgeMeasured,
)
from exo.shared.types.nodes import TopologyEdge
from exo.shared.types.state import State
from exo.testing.builders import make_node_info
from exo.utils.channels import Topic

NODES = [NodeId(f"node-{i}") for i in range(4)]


def make_events(count: int, start: int = 0) -> list[IndexedEvent]:
    """Event 0 names the history; then node infos and edge measurements that keep
    changing the state (so a stale snapshot would show)."""
    events: list[IndexedEvent] = []
    for idx in range(start, start + count):
        event: Event
        if idx == 0:
            event = ClusterHistoryStarted(history_id="history-1", master=NODES[0])
        elif idx % 3 == 0:
            event = NodeGatheredInfo(node_id=NODES[idx % 4], info=make_node_info(1000 + idx))
        else:
            source, sink = NODES[idx % 4], NODES[(idx + 1) % 4]
            edge = TopologyEdge(
                source=source,
                sink=sink,
                address="127.0.0.1",
                latency_ms=float(idx),
                bandwidth_mbps=1000.0,
            )
            event = TopologyEdgeMeasured(edge=edge)
        events.append(IndexedEvent(idx=idx, event=event))
    return events


def run_history(log: EventLog, events: list[IndexedEvent], state: State | None = None) -> State:
    """Append and apply `events` one by one, compacting as the replica does."""
    state = state or State()
    for event in events:
        log.append([event])
        state = apply(state, event)
        log.maybe_compact(state)
    return state


def aside(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.corrupt-*"))


def test_snapshot_plus_tail_equals_a_full_replay(tmp_path: Path) -> None:
    events = make_events(175)
    log = EventLog(tmp_path / "events.jsonl", snapshot_every=50)
    state = run_history(log, events)
    log.close()
    assert state == apply_all(State(), events)
    # Three snapshots were taken (at 50, 100 and 150 events past the last one).
    assert log.base_idx == 149
    assert [event.idx for event in log.events] == list(range(150, 175))

    reopened = EventLog(tmp_path / "events.jsonl", snapshot_every=50)
    assert reopened.load() == state
    assert reopened.digest_at(149) == event_digest(events[149])
    assert reopened.digest_at(174) == event_digest(events[174])
    assert reopened.digest_at(10) is None  # compacted away
    assert reopened.events_from(0, 3) == events[150:153]
    assert aside(tmp_path / "events.jsonl") == []


def test_disk_use_stays_bounded_however_long_the_history(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, snapshot_every=50)
    state = run_history(log, make_events(400))
    after_400 = path.stat().st_size + log.snapshot_path.stat().st_size
    state = run_history(log, make_events(1_200, start=400), state)
    log.close()
    after_1600 = path.stat().st_size + log.snapshot_path.stat().st_size
    # The state does not grow with the number of events, so neither does the disk.
    assert after_1600 < after_400 * 1.2
    assert len(log.events) < 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "events.snapshot"]
    assert EventLog(path).load() == state


def test_a_log_past_the_thresholds_is_compacted_on_load(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = make_events(300)
    EventLog(path).append(events)
    log = EventLog(path, snapshot_every=100)
    assert log.load() == apply_all(State(), events)
    assert log.base_idx == 299
    assert log.events == []
    assert path.read_bytes() == b""


def test_a_crash_while_writing_a_snapshot_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "events.jsonl"
    events = make_events(260)
    log = EventLog(path, snapshot_every=100)
    state = run_history(log, events[:150])
    assert log.base_idx == 99
    previous = log.snapshot_path.read_bytes()

    def crash(self: Path, target: Path) -> None:
        raise OSError("power lost")

    monkeypatch.setattr(Path, "replace", crash)
    with pytest.raises(OSError, match="power lost"):
        run_history(log, events[150:], state)
    monkeypatch.undo()
    log.close()
    # The half-written temp file is beside it; the snapshot and the log are untouched.
    assert log.snapshot_path.read_bytes() == previous
    assert (tmp_path / "events.snapshot.tmp").exists()
    reopened = EventLog(path, snapshot_every=100)
    assert reopened.load() == apply_all(State(), events[:200])
    assert reopened.base_idx == 199  # compacted again on load, this time to the end


def test_a_crash_between_snapshot_and_log_rewrite_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = make_events(120)
    log = EventLog(path)
    log.append(events)
    full_log = path.read_bytes()
    log.write_snapshot(apply_all(State(), events[:100]))
    log.close()
    path.write_bytes(full_log)  # as if the rewrite never happened
    reopened = EventLog(path)
    assert reopened.load() == apply_all(State(), events)
    assert [event.idx for event in reopened.events] == list(range(100, 120))
    assert aside(path) == []


def test_truncated_last_record_is_set_aside_and_the_prefix_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = make_events(40)
    EventLog(path).append(events)
    original = path.read_bytes()
    path.write_bytes(original[:-17])
    log = EventLog(path)
    assert log.load() == apply_all(State(), events[:39])
    [set_aside] = aside(path)
    assert set_aside.read_bytes() == original[:-17]
    log.append(events[39:])
    log.close()
    assert path.read_bytes() == original


def test_flipped_byte_is_detected_by_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = make_events(40)
    EventLog(path).append(events)
    lines = path.read_bytes().split(b"\n")
    # Change a latency digit in record 20: still valid JSON, only the checksum tells.
    damaged = lines[20].replace(b'"latency_ms":20.0', b'"latency_ms":29.0')
    assert damaged != lines[20]
    lines[20] = damaged
    path.write_bytes(b"\n".join(lines))
    assert EventLog(path).load() == apply_all(State(), events[:20])
    assert len(aside(path)) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_snapshot_is_set_aside_and_the_node_starts_empty(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, snapshot_every=50)
    run_history(log, make_events(80))
    log.close()
    snapshot = log.snapshot_path
    data = bytearray(snapshot.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        snapshot.write_bytes(bytes(data))
    elif damage == "truncate":
        snapshot.write_bytes(bytes(data[:-100]))
    else:
        snapshot.unlink()
    reopened = EventLog(path, snapshot_every=50)
    # The log's events follow a snapshot that is gone: nothing usable is left, so the
    # node starts empty (a follower then takes the master's history).
    assert reopened.load() == State()
    assert len(aside(path)) == 1
    assert len(aside(snapshot)) == (0 if damage == "delete" else 1)
    assert path.read_bytes() == b""


def test_an_append_past_a_gap_is_refused_and_a_snapshot_mends_it(tmp_path: Path) -> None:
    # Session 4's crash: a node holding state to 563 and an empty log.
    log = EventLog(tmp_path / "events.jsonl")
    events = make_events(10)
    state = apply_all(State(), events[:6])
    log.write_snapshot(state, event_digest(events[5]))
    log.append(events[6:])
    log.close()
    assert EventLog(tmp_path / "events.jsonl").load() == apply_all(State(), events)


def unstamped(copies: list[IndexedEvent], master: NodeId) -> list[IndexedEvent]:
    """Published copies, checked to be stamped by `master`, as the log holds them."""
    assert {copy.published_by for copy in copies} == {master}
    return [copy.model_copy(update={"published_by": None}) for copy in copies]


def test_master_replays_from_its_snapshot_when_the_events_were_compacted(
    tmp_path: Path,
) -> None:
    events = make_events(250)
    log = EventLog(tmp_path / "events.jsonl", snapshot_every=100)
    state = run_history(log, events)
    published: Topic[IndexedEvent] = Topic("global_events")
    received = published.subscribe()
    master = Master(
        node_id=NODES[0],
        state=state,
        event_log=log,
        command_subscription=Topic[ForwarderCommand]("commands").subscribe(),
        local_event_subscription=Topic[ForwarderEvent]("local_events").subscribe(),
        global_event_publisher=published.sender(),
        cards={},
    )
    master.replay(0)
    first = received.receive_nowait()
    assert first.idx == 199
    assert isinstance(first.event, StateSnapshot)
    assert first.event.state == apply_all(State(), events[:200])
    assert first.event.last_event_digest == event_digest(events[199])
    tail = [received.receive_nowait() for _ in range(50)]
    assert unstamped(tail, NODES[0]) == events[200:]
    # A node holding events after the snapshot gets only what it lacks.
    master.replay(240)
    assert unstamped([received.receive_nowait()], NODES[0]) == [events[240]]
    log.close()


def test_fsync_is_called_for_the_snapshot_and_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(event_log_module.os, "fsync", recording_fsync)
    event_log_module.write_atomically(tmp_path / "file", b"data")
    assert len(synced) == 2  # the file, then the directory holding the new name
    assert (tmp_path / "file").read_bytes() == b"data"


def test_a_fresh_node_gets_a_snapshot_taken_at_the_first_event(tmp_path: Path) -> None:
    # A fresh node asks from 0, as does one holding event 0: both need the snapshot.
    events = make_events(3)
    log = EventLog(tmp_path / "events.jsonl")
    log.append(events[:1])
    log.write_snapshot(apply_all(State(), events[:1]))
    log.append(events[1:])
    published: Topic[IndexedEvent] = Topic("global_events")
    received = published.subscribe()
    master = Master(
        node_id=NODES[0],
        state=apply_all(State(), events),
        event_log=log,
        command_subscription=Topic[ForwarderCommand]("commands").subscribe(),
        local_event_subscription=Topic[ForwarderEvent]("local_events").subscribe(),
        global_event_publisher=published.sender(),
        cards={},
    )
    master.replay(0)
    first = received.receive_nowait()
    assert first.idx == 0 and isinstance(first.event, StateSnapshot)
    assert unstamped([received.receive_nowait() for _ in range(2)], NODES[0]) == events[1:]
    log.close()
