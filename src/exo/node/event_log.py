"""The node's persisted cluster history: a snapshot of the state plus the events after it.

Two files in the node's data directory (`event_log.jsonl` and `event_log.snapshot`):
- the log: one record per line, `<CRC-32 of the JSON, 8 hex digits> <IndexedEvent JSON>`
  (lines that start with `{` are records of older versions, without a checksum); every
  append is flushed and fsynced before it returns;
- the snapshot: one header line (JSON: `format`, `idx`, `last_event_digest`, `sha256` and
  `bytes` of the body) then the `State` after event `idx` as JSON.

Compaction (`maybe_compact`): once `SNAPSHOT_EVERY_EVENTS` events follow the snapshot, or
the log file reaches `SNAPSHOT_LOG_BYTES`, the state is written as the new snapshot
(temp file, fsync, rename, directory fsync) and only then is the log rewritten with the
events after it (the same way). A crash in between leaves a log whose first records the
snapshot already covers; loading skips them. Disk use is thus about one state plus at most
`SNAPSHOT_EVERY_EVENTS` events (or `SNAPSHOT_LOG_BYTES`).

Older versions (`load`): records of protocol 0.1, which tagged shards and instances by
class, are converted to today's shapes as they are read (`event_log_upgrade`) and the files
rewritten in them.

Recovery (`load`): a snapshot whose header, checksum or body is bad, and a log with a bad
record (checksum, JSON, a torn last line) or an index out of sequence, are set aside
(renamed `<name>.corrupt-<UTC time>`; the `KEPT_CORRUPT_FILES` newest of each file are
kept, older ones removed, so repeated damage cannot fill the disk) with a WARNING saying
what was found;
the log is rewritten with its good prefix. The node then continues from the snapshot plus
that prefix; a follower fetches the rest from the master (`exo.node.replica`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from loguru import logger
from pydantic import ValidationError

from exo.node.data_directory import DataDirectoryFullError, DiskSpace, is_disk_full
from exo.node.event_log_upgrade import needs_upgrade, upgrade_json
from exo.shared.apply import apply_all, command_outcome
from exo.shared.types.common import CommandId
from exo.shared.types.events import IndexedEvent
from exo.shared.types.state import State

SNAPSHOT_EVERY_EVENTS = 10_000
SNAPSHOT_LOG_BYTES = 64 * 1024 * 1024
SNAPSHOT_FORMAT = 1
# Logs of histories this node dropped (`reset`) that are kept; older ones are removed.
KEPT_OLD_LOGS = 3
# Damaged files set aside (`set_aside`) kept per file name, for a post-mortem; older ones go.
KEPT_CORRUPT_FILES = 3


# Which master sent a copy of an event is not part of the history.
NOT_HISTORY = frozenset({"published_by"})


def event_digest(indexed_event: IndexedEvent) -> str:
    """A short fingerprint of one indexed event; two nodes whose events at the same index
    differ hold different histories (whoever published their copies)."""
    return _body_digest(indexed_event.model_dump_json(exclude=set(NOT_HISTORY)).encode())


def _body_digest(body: bytes) -> str:
    """`event_digest` of the event whose history JSON (`encode_record`'s body) is `body`."""
    return hashlib.sha256(body).hexdigest()[:16]


def history_summary(events_after_snapshot: int, snapshot_idx: int, last_idx: int) -> str:
    """The start-up log line that says what history a node found on disk.

    Args:
        events_after_snapshot: events in the log after the snapshot.
        snapshot_idx: the last event the snapshot holds; -1 when there is no snapshot (the
            log then holds the history from its first event).
        last_idx: the last event of the history.
    """
    if snapshot_idx < 0:
        return (
            f"history: {events_after_snapshot} events in the log and no snapshot yet "
            f"(events 0 to {last_idx})"
        )
    return (
        f"history: a snapshot of the state after event {snapshot_idx} and "
        f"{events_after_snapshot} events after it (up to event {last_idx})"
    )


class EventLogCorruptError(RuntimeError):
    """An append would leave a gap in the indexes."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state after event `idx`, and that event's digest (None when unknown)."""

    idx: int
    last_event_digest: str | None
    state: State


def encode_record(event: IndexedEvent) -> bytes:
    """One log line (with its newline) for `event`."""
    body = event.model_dump_json(exclude=set(NOT_HISTORY)).encode()
    return f"{zlib.crc32(body):08x} ".encode() + body + b"\n"


def decode_record(line: bytes) -> IndexedEvent:
    """The event of one log line (without its newline).

    Raises:
        ValueError: the checksum does not match or the JSON is not an indexed event.
    """
    if line.startswith(b"{"):
        body = line
    else:
        checksum, _, body = line.partition(b" ")
        if len(checksum) != 8 or f"{zlib.crc32(body):08x}".encode() != checksum:
            raise ValueError("checksum mismatch")
    if needs_upgrade(body):
        body = upgrade_json(body)
    try:
        return IndexedEvent.model_validate_json(body)
    except ValidationError as error:
        raise ValueError(f"not a valid event: {error.errors()[0]['msg']}") from error


def set_aside(path: Path, found: str) -> Path:
    """Rename a damaged file beside itself with a timestamp and say so at WARNING; only
    the `KEPT_CORRUPT_FILES` newest set-aside copies of `path` stay."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}-{time.time_ns() % 10**9:09d}")
    path.replace(target)
    logger.warning(f"{path}: {found}; set aside as {target.name}")
    # The names sort by time: the UTC second, then its nanoseconds.
    copies = sorted(path.parent.glob(f"{path.name}.corrupt-*"))
    for old in copies[:-KEPT_CORRUPT_FILES]:
        logger.info(f"event log: removing {old.name} (keeping {KEPT_CORRUPT_FILES} damaged copies)")
        old.unlink(missing_ok=True)
    return target


def write_atomically(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.tmp")
    with temporary.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    temporary.replace(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class EventLog:
    """A node's history on disk: the latest snapshot and the events after it (`events`).

    The events after the snapshot are also held in memory, to replay them (`events_from`):
    as their log records (`encode_record`'s bytes), not as event objects. Measured on 1,925
    events of a node serving chats (2026-12-07, docs/testing.md): 4.4 KB an event as
    objects, 0.7 KB as records; the log holds up to `SNAPSHOT_EVERY_EVENTS` of them (a
    request makes about six), so a node's memory grew by up to ~44 MB between compactions,
    now ~7 MB. Replaying decodes the records asked for.
    """

    def __init__(
        self,
        path: Path,
        snapshot_every: int = SNAPSHOT_EVERY_EVENTS,
        max_log_bytes: int = SNAPSHOT_LOG_BYTES,
    ) -> None:
        self.path = path
        self.snapshot_path = path.with_suffix(".snapshot")
        self.snapshot_every = snapshot_every
        self.max_log_bytes = max_log_bytes
        self._file: IO[bytes] | None = None
        self._log_bytes = 0
        self.snapshot: Snapshot | None = None
        self._records: list[bytes] = []
        """The events after the snapshot, in index order, as their log records."""
        self._command_ids: list[CommandId | None] = []
        """Per record, the command its event answers (`command_outcome`), if any."""
        self._last_digest: tuple[int, str] | None = None
        self._loaded = False
        self._snapshot_upgraded = False
        self.space = DiskSpace(path.parent)
        """Whether the data directory has room (`exo.node.data_directory`)."""

    # -- loading -----------------------------------------------------------------------

    def load(self) -> State:
        """Read the snapshot and the log, set aside what is damaged, and return the state
        they hold (the empty `State` when nothing usable is left). Compacts at once when
        the log is past the thresholds (a long log of an older version)."""
        self.close()
        self._loaded = True
        self._snapshot_upgraded = False
        self.snapshot = self._read_snapshot()
        events = self._read_log()
        self._hold(events, [encode_record(event) for event in events], replace=True)
        state = apply_all(self.snapshot.state if self.snapshot else State(), events)
        if self._snapshot_upgraded and state.last_event_applied_idx >= 0:
            logger.info(f"{self.snapshot_path}: protocol 0.1 snapshot converted to today's shapes")
            self.write_snapshot(state)
        else:
            self.maybe_compact(state)
        return state

    def read_all(self) -> list[IndexedEvent]:
        """`load`, then the events after the snapshot."""
        self.load()
        return self.events

    def _hold(
        self, events: list[IndexedEvent], records: list[bytes], replace: bool = False
    ) -> None:
        """Keep `records` (those of `events`) in memory after the ones held, or instead of
        them."""
        command_ids = [
            answered[0] if (answered := command_outcome(event)) is not None else None
            for event in events
        ]
        if replace:
            self._records, self._command_ids = records, command_ids
            self._last_digest = None
        else:
            self._records.extend(records)
            self._command_ids.extend(command_ids)

    def _read_snapshot(self) -> Snapshot | None:
        if not self.snapshot_path.exists():
            return None
        raw = self.snapshot_path.read_bytes()
        header_line, _, body = raw.partition(b"\n")
        try:
            header = json.loads(header_line)
            if header.get("format") != SNAPSHOT_FORMAT:
                raise ValueError(f"unknown format {header.get('format')!r}")
            if header["bytes"] != len(body):
                raise ValueError(f"truncated: {len(body)} of {header['bytes']} bytes")
            if hashlib.sha256(body).hexdigest() != header["sha256"]:
                raise ValueError("checksum mismatch")
            self._snapshot_upgraded = needs_upgrade(body)
            state = State.model_validate_json(
                upgrade_json(body) if self._snapshot_upgraded else body
            )
            if state.last_event_applied_idx != header["idx"]:
                raise ValueError(f"holds event {state.last_event_applied_idx}, not {header['idx']}")
        except (ValueError, KeyError, TypeError, ValidationError) as error:
            set_aside(self.snapshot_path, f"snapshot unreadable ({error})")
            return None
        return Snapshot(
            idx=header["idx"], last_event_digest=header["last_event_digest"], state=state
        )

    def _read_log(self) -> list[IndexedEvent]:
        if not self.path.exists():
            self._log_bytes = 0
            return []
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        events: list[IndexedEvent] = []
        kept: list[bytes] = []
        upgraded = 0
        problem: str | None = None
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                event = decode_record(line)
            except ValueError as error:
                torn = number == len(lines)  # no newline after it: cut mid-write
                problem = f"{'torn last' if torn else 'bad'} record at line {number} ({error})"
                break
            if event.idx <= self.base_idx:
                continue  # the snapshot holds it (a crash between snapshot and rewrite)
            expected = self.base_idx + 1 + len(events)
            if event.idx != expected:
                problem = f"line {number} has index {event.idx}, expected {expected}"
                break
            events.append(event)
            # A record of this version is kept byte for byte; an older one is written anew
            # (with its checksum, in today's shapes).
            old_record = line.startswith(b"{") or needs_upgrade(line)
            upgraded += needs_upgrade(line)
            kept.append(encode_record(event) if old_record else line + b"\n")
        good = b"".join(kept)
        if upgraded:
            logger.info(
                f"{self.path}: {upgraded} records of protocol 0.1 converted to today's shapes"
            )
        if problem is not None:
            set_aside(self.path, f"{problem}; keeping the {len(events)} events before it")
            write_atomically(self.path, good)
        elif good != raw:
            write_atomically(self.path, good)  # legacy records or a missing last newline
        self._log_bytes = len(good)
        return events

    # -- reading -----------------------------------------------------------------------

    def _ensure_loaded(self) -> None:
        if not self._loaded:
            self.load()

    @property
    def base_idx(self) -> int:
        """The index the snapshot holds the state after (-1: no snapshot)."""
        return self.snapshot.idx if self.snapshot is not None else -1

    @property
    def last_idx(self) -> int:
        self._ensure_loaded()
        return self.base_idx + len(self._records)

    @property
    def held(self) -> int:
        """How many events follow the snapshot."""
        self._ensure_loaded()
        return len(self._records)

    @property
    def events(self) -> list[IndexedEvent]:
        """The events after the snapshot, in index order (decoded: for tests and start-up;
        `events_from` replays a part)."""
        return self.events_from(self.base_idx + 1, self.held)

    def command_ids(self) -> set[CommandId]:
        """The commands the held events answer."""
        self._ensure_loaded()
        return {command_id for command_id in self._command_ids if command_id is not None}

    def digest_at(self, idx: int) -> str | None:
        """`event_digest` of the event at `idx`, None when this node does not hold it
        (compacted away, or beyond the log)."""
        self._ensure_loaded()
        if self.snapshot is not None and idx == self.snapshot.idx:
            return self.snapshot.last_event_digest
        offset = idx - self.base_idx - 1
        if not 0 <= offset < len(self._records):
            return None
        # Every election heartbeat asks for the last event's digest (twice a second): it
        # is computed once per index. A record's body is the JSON `event_digest` hashes.
        if self._last_digest is None or self._last_digest[0] != idx:
            self._last_digest = (idx, _body_digest(self._records[offset][9:-1]))
        return self._last_digest[1]

    def events_from(self, first_idx: int, limit: int) -> list[IndexedEvent]:
        """Up to `limit` held events from index `first_idx` on (compacted ones are not)."""
        self._ensure_loaded()
        offset = max(0, first_idx - self.base_idx - 1)
        return [decode_record(record[:-1]) for record in self._records[offset : offset + limit]]

    # -- writing -----------------------------------------------------------------------

    def append(self, events: Iterable[IndexedEvent]) -> None:
        """Persist `events`; those already held (index <= `last_idx`) are skipped, so the
        master and the node's replica can both hand it the same event.

        Raises:
            EventLogCorruptError: an event would leave a gap in the indexes.
            DataDirectoryFullError: the disk is full; none of `events` is held or kept
                on disk (`exo.node.data_directory`).
        """
        self._ensure_loaded()
        new = [event for event in events if event.idx > self.last_idx]
        if not new:
            return
        last = self.last_idx
        gap: EventLogCorruptError | None = None
        for count, event in enumerate(new):
            if event.idx != last + 1:
                # What comes before the gap is written; nothing from it on.
                gap = EventLogCorruptError(
                    f"appending event {event.idx} after {last} would leave a gap"
                )
                new = new[:count]
                break
            last = event.idx
        if new:
            self._write(new)
        if gap is not None:
            raise gap

    def _write(self, new: list[IndexedEvent]) -> None:
        """Append the records of `new` (contiguous after `last_idx`), flushed and fsynced,
        then hold them; on a full disk, neither."""
        records = [encode_record(event) for event in new]
        data = b"".join(records)
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("ab")
            self._file.write(data)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            if not is_disk_full(error):
                raise
            self._cut_back()
            self.space.mark_full()
            raise DataDirectoryFullError(self.path.parent, error) from None
        self._log_bytes += len(data)
        self._hold(new, records)

    def _cut_back(self) -> None:
        """After a failed append: drop what the file buffered and cut the log back to its
        last whole record (`_log_bytes`), so no torn record is left."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # flushing the buffer fails again
                self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.path, self._log_bytes)

    def maybe_compact(self, state: State) -> bool:
        """Snapshot `state` and drop the events it holds from the log when past the
        thresholds (see the module docstring). Returns whether it did."""
        held = state.last_event_applied_idx - self.base_idx
        if held <= 0 or (held < self.snapshot_every and self._log_bytes < self.max_log_bytes):
            return False
        started = time.perf_counter()
        self.write_snapshot(state)
        logger.info(
            f"event log: snapshot at event {state.last_event_applied_idx} "
            f"({held} events compacted, {time.perf_counter() - started:.2f} s)"
        )
        return True

    def write_snapshot(self, state: State, last_event_digest: str | None = None) -> None:
        """Make `state` the snapshot (durable before the log is touched) and keep only the
        events after it. `last_event_digest` defaults to this log's digest of that event.
        A log that does not continue right after the snapshot is emptied."""
        self._ensure_loaded()
        idx = state.last_event_applied_idx
        if idx < 0:
            return
        digest = last_event_digest or self.digest_at(idx)
        body = state.model_dump_json().encode()
        header = {
            "format": SNAPSHOT_FORMAT,
            "idx": idx,
            "last_event_digest": digest,
            "sha256": hashlib.sha256(body).hexdigest(),
            "bytes": len(body),
        }
        try:
            write_atomically(self.snapshot_path, json.dumps(header).encode() + b"\n" + body)
        except OSError as error:  # nothing changed: the old snapshot and log stand
            if not is_disk_full(error):
                raise
            self.snapshot_path.with_name(f"{self.snapshot_path.name}.tmp").unlink(missing_ok=True)
            self.space.mark_full()
            raise DataDirectoryFullError(self.path.parent, error) from None
        # The held records run from index base_idx + 1 without a gap: the tail after idx
        # starts idx - base_idx records in (none when the snapshot is older than them).
        start = idx - self.base_idx
        self._records = self._records[start:] if start >= 0 else []
        self._command_ids = self._command_ids[start:] if start >= 0 else []
        self.snapshot = Snapshot(idx=idx, last_event_digest=digest, state=state)
        self.close()
        data = b"".join(self._records)
        try:
            write_atomically(self.path, data)
        except OSError as error:
            if not is_disk_full(error):
                raise
            # The snapshot is durable; the old log, whose first records it covers, stays
            # (loading skips them) and later appends continue it.
            self.path.with_name(f"{self.path.name}.tmp").unlink(missing_ok=True)
            self._log_bytes = self.path.stat().st_size if self.path.exists() else 0
            self.space.mark_full()
            raise DataDirectoryFullError(self.path.parent, error) from None
        self._log_bytes = len(data)

    def reset(self) -> Path | None:
        """Start an empty history, keeping the old log (and snapshot) beside it, for a
        node that joins a cluster with another history. Returns where the old log went."""
        self.close()
        self._records, self._command_ids = [], []
        self._last_digest = None
        self.snapshot = None
        self._log_bytes = 0
        self._loaded = True
        stamp = time.time_ns()
        if self.snapshot_path.exists():
            self.snapshot_path.replace(
                self.snapshot_path.with_name(f"{self.snapshot_path.name}.{stamp}.old")
            )
        if not self.path.exists():
            return None
        archive = self.path.with_name(f"{self.path.name}.{stamp}.old")
        self.path.replace(archive)
        self._prune_old()
        return archive

    def _prune_old(self) -> None:
        for pattern in (f"{self.path.name}.*.old", f"{self.snapshot_path.name}.*.old"):
            old = sorted(self.path.parent.glob(pattern))
            for path in old[:-KEPT_OLD_LOGS]:
                logger.info(f"event log: removing {path.name} (keeping {KEPT_OLD_LOGS} old logs)")
                path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
