from pathlib import Path

import pytest

from exo.node import event_log
from exo.node.event_log import (
    KEPT_CORRUPT_FILES,
    EventLog,
    EventLogCorruptError,
    encode_record,
    event_digest,
)
from exo.shared.apply import apply_all
from exo.shared.types.common import CommandId, NodeId, RunnerId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    IndexedEvent,
    NodeGatheredInfo,
    RunnerDeleted,
    TaskCreated,
)
from exo.shared.types.state import State
from exo.testing.builders import indexed, make_node_info, make_params, make_text_generation_task

EVENTS = indexed(
    [
        NodeGatheredInfo(node_id=NodeId("node-a"), info=make_node_info(1024, name="café 日本")),
        RunnerDeleted(runner_id=RunnerId("runner-1")),
        RunnerDeleted(runner_id=RunnerId("runner-2")),
    ]
)


def line(event: IndexedEvent) -> bytes:
    return encode_record(event)


def set_aside_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.corrupt-*"))


def test_missing_file_reads_as_empty(tmp_path: Path) -> None:
    assert EventLog(tmp_path / "events.jsonl").read_all() == []


def test_append_then_read_back(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "nested" / "events.jsonl")
    log.append(EVENTS[:2])
    log.append(EVENTS[2:])
    assert log.read_all() == EVENTS
    log.close()
    assert (tmp_path / "nested" / "events.jsonl").read_bytes() == b"".join(map(line, EVENTS))


def test_reopen_reads_the_same_events_and_appends_after_them(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = EventLog(path)
    first.append(EVENTS[:2])
    first.close()
    second = EventLog(path)
    assert second.read_all() == EVENTS[:2]
    second.append(EVENTS[2:])
    second.close()
    assert EventLog(path).read_all() == EVENTS


@pytest.mark.parametrize(
    "torn",
    [
        b'{"idx": 3, "event": {"kind": "Runner',
        b"{",
        # Power loss in the middle of a two-byte UTF-8 character.
        '{"idx": 3, "event": {"kind": "NodeGatheredInfo", "node_id": "caf\u00e9'.encode()[:-1],
    ],
    ids=["cut-json", "one-brace", "cut-utf8"],
)
def test_torn_last_line_is_dropped_and_the_file_repaired(tmp_path: Path, torn: bytes) -> None:
    path = tmp_path / "events.jsonl"
    valid = b"".join(map(line, EVENTS))
    path.write_bytes(valid + torn)
    log = EventLog(path)
    assert log.read_all() == EVENTS
    assert path.read_bytes() == valid
    next_event = IndexedEvent(idx=3, event=RunnerDeleted(runner_id=RunnerId("runner-3")))
    log.append([next_event])
    log.close()
    assert EventLog(path).read_all() == [*EVENTS, next_event]


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(map(line, EVENTS)).rstrip(b"\n"))
    log = EventLog(path)
    assert log.read_all() == EVENTS
    assert path.read_bytes().endswith(b"}\n")
    next_event = IndexedEvent(idx=3, event=RunnerDeleted(runner_id=RunnerId("runner-3")))
    log.append([next_event])
    log.close()
    assert EventLog(path).read_all() == [*EVENTS, next_event]


def test_torn_only_line_leaves_an_empty_log(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"idx": 0, "ev')
    log = EventLog(path)
    assert log.read_all() == []
    assert path.read_bytes() == b""
    log.append(EVENTS[:1])
    log.close()
    assert EventLog(path).read_all() == EVENTS[:1]


def test_corrupt_middle_line_is_set_aside_and_the_good_prefix_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    original = line(EVENTS[0]) + b'{"idx": 1, "ev\n' + line(EVENTS[2])
    path.write_bytes(original)
    assert EventLog(path).read_all() == EVENTS[:1]
    assert path.read_bytes() == line(EVENTS[0])
    # The damaged file is kept as it was, beside the log.
    [aside] = set_aside_files(path)
    assert aside.read_bytes() == original


def test_only_the_newest_damaged_copies_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    damaged = [line(EVENTS[0]) + f'{{"torn {number}'.encode() + b"\n" for number in range(5)]
    for body in damaged:
        path.write_bytes(body)
        assert EventLog(path).read_all() == EVENTS[:1]
    kept = set_aside_files(path)
    assert len(kept) == KEPT_CORRUPT_FILES
    # The newest ones, in the order they were set aside.
    assert [copy.read_bytes() for copy in kept] == damaged[-KEPT_CORRUPT_FILES:]


def test_index_gap_keeps_the_events_before_it(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(line(EVENTS[0]) + line(EVENTS[2]))
    assert EventLog(path).read_all() == EVENTS[:1]
    assert len(set_aside_files(path)) == 1


def test_log_not_starting_at_zero_without_a_snapshot_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(line(EVENTS[1]))
    log = EventLog(path)
    assert log.read_all() == []
    assert path.read_bytes() == b""
    assert len(set_aside_files(path)) == 1
    log.append(EVENTS[:1])
    log.close()
    assert EventLog(path).read_all() == EVENTS[:1]


def test_records_of_older_versions_without_checksums_are_read(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"".join(event.model_dump_json().encode() + b"\n" for event in EVENTS))
    assert EventLog(path).read_all() == EVENTS
    assert path.read_bytes() == b"".join(map(line, EVENTS))
    assert set_aside_files(path) == []


def test_long_prompt_survives_the_log(tmp_path: Path) -> None:
    task = make_text_generation_task(params=make_params("word " * 20_000 + "\n\u2028end"))
    event = IndexedEvent(idx=0, event=TaskCreated(task=task))
    log = EventLog(tmp_path / "events.jsonl")
    log.append([event])
    log.close()
    assert EventLog(tmp_path / "events.jsonl").read_all() == [event]


def test_append_skips_events_already_written(tmp_path: Path) -> None:
    # The master and the node's replica both hand the log the same events.
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.append(EVENTS[:2])
    log.append(EVENTS[:2])
    log.append(EVENTS[1:])
    assert log.last_idx == 2
    assert log.events == EVENTS
    log.close()
    assert path.read_bytes() == b"".join(map(line, EVENTS))


def test_append_after_reading_continues_and_skips_what_the_file_holds(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    first = EventLog(path)
    first.append(EVENTS[:2])
    first.close()
    second = EventLog(path)
    second.read_all()
    assert second.last_idx == 1
    second.append(EVENTS)
    second.close()
    assert path.read_bytes() == b"".join(map(line, EVENTS))


@pytest.mark.parametrize("gap", [[EVENTS[1]], [EVENTS[0], EVENTS[2]]], ids=["first", "middle"])
def test_append_that_would_leave_a_gap_raises(tmp_path: Path, gap: list[IndexedEvent]) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    with pytest.raises(EventLogCorruptError, match="would leave a gap"):
        log.append(gap)
    log.close()
    # Whatever came before the gap is kept; nothing from the gap on is written.
    kept = [event for event in gap if event.idx == 0]
    assert log.events == kept
    assert EventLog(tmp_path / "events.jsonl").read_all() == kept


def test_reset_archives_the_old_log_and_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    log.append(EVENTS)
    archive = log.reset()
    assert archive is not None
    assert archive.parent == tmp_path
    assert archive != path
    assert archive.read_bytes() == b"".join(map(line, EVENTS))
    assert not path.exists()
    assert log.events == []
    assert log.last_idx == -1
    log.append(EVENTS[:1])
    log.close()
    assert EventLog(path).read_all() == EVENTS[:1]
    assert EventLog(archive).read_all() == EVENTS


def test_reset_without_a_file_archives_nothing(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    assert log.reset() is None
    assert log.events == []


def test_the_digest_of_an_event_is_computed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Election heartbeats ask for the last event's digest twice a second: hashed once per
    index, from the held record, equal to `event_digest` of the event."""
    log = EventLog(tmp_path / "events.jsonl")
    log.append(EVENTS)
    later = indexed([RunnerDeleted(runner_id=RunnerId("runner-3"))], start=3)
    expected = {event.idx: event_digest(event) for event in [*EVENTS, *later]}
    hashed: list[bytes] = []
    hash_body = event_log._body_digest

    def counting_digest(body: bytes) -> str:
        hashed.append(body)
        return hash_body(body)

    monkeypatch.setattr(event_log, "_body_digest", counting_digest)
    assert [log.digest_at(2) for _ in range(5)] == [expected[2]] * 5
    assert len(hashed) == 1
    assert log.digest_at(1) == expected[1]
    log.append(later)
    assert log.digest_at(3) == expected[3]
    assert len(hashed) == 3
    log.close()


def test_held_events_replay_and_name_their_commands(tmp_path: Path) -> None:
    """The log holds its events as records: replaying them (`events_from`, `events`) gives
    the events appended, before and after a reload and a compaction, and `command_ids` the
    commands they answer."""
    events = indexed(
        [
            *(event.event for event in EVENTS),
            TaskCreated(task=make_text_generation_task(task_id="task-7")),
            TaskCreated(task=make_text_generation_task(task_id="task-8")),
        ]
    )
    log = EventLog(tmp_path / "events.jsonl")
    log.append(events)
    assert log.events == events
    assert log.events_from(1, 2) == events[1:3]
    assert log.command_ids() == {CommandId("command-task-7"), CommandId("command-task-8")}
    log.close()
    reloaded = EventLog(tmp_path / "events.jsonl")
    state = reloaded.load()
    assert reloaded.events == events and reloaded.held == len(events)
    assert reloaded.command_ids() == {CommandId("command-task-7"), CommandId("command-task-8")}
    reloaded.write_snapshot(apply_all(State(), events[:4]))  # task-7's event compacted
    assert reloaded.events == events[4:] and reloaded.base_idx == 3
    assert reloaded.last_idx == state.last_event_applied_idx
    assert reloaded.command_ids() == {CommandId("command-task-8")}
    reloaded.close()


def test_the_publishing_master_is_not_part_of_the_history(tmp_path: Path) -> None:
    # Copies of one event sent by two masters (live, then replayed) are the same event.
    event = IndexedEvent(idx=0, event=ClusterHistoryStarted(history_id="h", master=NodeId("m")))
    copy = event.model_copy(update={"published_by": NodeId("another-master")})
    assert event_digest(copy) == event_digest(event)
    log = EventLog(tmp_path / "events.jsonl")
    log.append([copy])
    log.close()
    assert b"published_by" not in log.path.read_bytes()
    assert EventLog(log.path).read_all() == [event]
