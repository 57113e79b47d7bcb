"""The master's append-only, persisted event log (one JSON `IndexedEvent` per line)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from loguru import logger
from pydantic import ValidationError

from exo.shared.types.events import IndexedEvent


def event_digest(indexed_event: IndexedEvent) -> str:
    """A short fingerprint of one indexed event; two nodes whose events at the same index
    differ hold different histories."""
    return hashlib.sha256(indexed_event.model_dump_json().encode()).hexdigest()[:16]


class EventLogCorruptError(RuntimeError):
    """A line other than the last one is unreadable, or indexes are not 0, 1, 2, ..."""


class EventLog:
    """Append-only JSON-lines log of indexed events.

    Every append is flushed and fsynced before it returns, so an event that was
    published survives a crash. A torn last line (power loss mid-write) is dropped on
    open, with a warning; corruption anywhere else is an error, never silently skipped.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self.events: list[IndexedEvent] = []
        """Every event of the log, in index order."""
        self._loaded = False

    def read_all(self) -> list[IndexedEvent]:
        """Every event in the log, in index order.

        Raises:
            EventLogCorruptError: a line before the last is invalid or indexes skip.
        """
        self._loaded = True
        if not self.path.exists():
            self.events = []
            return []
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        events: list[IndexedEvent] = []
        valid_bytes = 0
        for line_number, line in enumerate(lines):
            is_last = line_number == len(lines) - 1
            if not line.strip():
                if not is_last:
                    valid_bytes += len(line) + 1
                continue
            try:
                event = IndexedEvent.model_validate_json(line)
            except ValidationError as error:
                if is_last:
                    logger.warning(f"dropping torn last line of {self.path}")
                    break
                raise EventLogCorruptError(
                    f"{self.path}:{line_number + 1} is not a valid event: {error}"
                ) from error
            if event.idx != len(events):
                raise EventLogCorruptError(
                    f"{self.path}:{line_number + 1} has index {event.idx}, expected {len(events)}"
                )
            events.append(event)
            valid_bytes += len(line) + (0 if is_last else 1)
        if valid_bytes < len(raw):
            # Cut the torn tail so the next append starts on a clean line.
            with self.path.open("r+b") as file:
                file.truncate(valid_bytes)
                if valid_bytes and not raw[:valid_bytes].endswith(b"\n"):
                    file.seek(valid_bytes)
                    file.write(b"\n")
        elif raw and not raw.endswith(b"\n"):
            with self.path.open("ab") as file:
                file.write(b"\n")
        self.events = list(events)
        return events

    @property
    def last_idx(self) -> int:
        if not self._loaded:
            self.read_all()
        return len(self.events) - 1

    def digest_at(self, idx: int) -> str | None:
        """`event_digest` of the event at `idx`, None when the log does not reach it."""
        if not self._loaded:
            self.read_all()
        if not 0 <= idx < len(self.events):
            return None
        return event_digest(self.events[idx])

    def append(self, events: Iterable[IndexedEvent]) -> None:
        """Persist `events`; those already in the log (index <= `last_idx`) are skipped,
        so the master and the node's replica can both hand it the same event.

        Raises:
            EventLogCorruptError: an event would leave a gap in the indexes.
        """
        if not self._loaded:
            self.read_all()
        new = [event for event in events if event.idx > self.last_idx]
        if not new:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        for event in new:
            if event.idx != len(self.events):
                raise EventLogCorruptError(
                    f"appending event {event.idx} after {self.last_idx} would leave a gap"
                )
            self._file.write(event.model_dump_json() + "\n")
            self.events.append(event)
        self._file.flush()
        os.fsync(self._file.fileno())

    def reset(self) -> Path | None:
        """Start an empty log, keeping the old one beside it (for a node that joins a
        cluster with another history). Returns where the old log went."""
        self.close()
        self.events = []
        self._loaded = True
        if not self.path.exists():
            return None
        archive = self.path.with_name(f"{self.path.name}.{time.time_ns()}.old")
        self.path.replace(archive)
        return archive

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
