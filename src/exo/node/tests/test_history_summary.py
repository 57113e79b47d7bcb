"""The start-up line about the history on disk says what it found in words."""

from exo.node.event_log import history_summary


def test_a_log_without_a_snapshot_says_so_instead_of_naming_event_minus_one() -> None:
    line = history_summary(events_after_snapshot=12, snapshot_idx=-1, last_idx=11)
    assert line == "history: 12 events in the log and no snapshot yet (events 0 to 11)"
    assert "-1" not in line


def test_a_snapshot_and_the_events_after_it() -> None:
    line = history_summary(events_after_snapshot=5, snapshot_idx=9999, last_idx=10004)
    assert line == (
        "history: a snapshot of the state after event 9999 and 5 events after it "
        "(up to event 10004)"
    )
