"""The node's data directory (`EXO_HOME`) when its disk is full or it cannot be written.

A full disk (ENOSPC, or a quota: EDQUOT) must not take the node down. The cluster history
is event-sourced: an event is persisted before it is applied and published (DESIGN.md,
Master), so a master that cannot write its log must not publish the event either, or a
later master continuing from its own log would lack what every node applied. What the
node does instead:
- the event log raises `DataDirectoryFullError` having written nothing (a partly written
  record is cut off again), and marks the directory full (`DiskSpace.mark_full`);
- the master drops the events it could not persist (their command stays unanswered and is
  sent again by its API node); a follower's replica keeps applying the master's events in
  memory (the master holds them; after a restart it fetches what its log lacks);
- the API refuses every request that would change the cluster (placing a model, a
  generation, a download) with a 503 naming the directory (`DiskSpace.problem`), and
  keeps answering what only reads the state;
- the error is logged once per episode, with no traceback; once `MIN_FREE_BYTES` are free
  again the node goes on by itself.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from loguru import logger

MIN_FREE_BYTES = 1024 * 1024
"""Below this much free space the directory counts as full: room for ~1,400 event
records (~0.7 KB each, `exo.node.event_log`), so a request is refused before its events
fail to be written rather than after."""

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
NOT_WRITABLE_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


class DataDirectoryFullError(OSError):
    """The data directory's disk has no space left: nothing of the write was kept."""

    def __init__(self, directory: Path, cause: OSError) -> None:
        super().__init__(cause.errno, full_message(directory))
        self.directory = directory


def full_message(directory: Path) -> str:
    """The one line that says the data directory's disk is full and what the node does."""
    return (
        f"the data directory {directory} is full (no space left on its disk): the cluster "
        "history cannot be written, so this node refuses requests that change the cluster "
        "until space is freed there (EXO_HOME)"
    )


def is_disk_full(error: OSError) -> bool:
    return error.errno in FULL_ERRNOS


def not_writable_message(error: OSError, home: Path) -> str | None:
    """The start-up error for an `OSError` about a file in `home` that cannot be written
    (read-only file system, permissions) or has no room; None for another error (a port
    that cannot be listened on)."""
    if error.filename is None or error.errno not in NOT_WRITABLE_ERRNOS | FULL_ERRNOS:
        return None
    path = Path(os.fsdecode(error.filename)).absolute()
    home = home.absolute()
    if path != home and home not in path.parents:
        return None
    if is_disk_full(error):
        return full_message(home)
    return (
        f"the data directory {home} is not writable ({error.strerror}: {path}); give the "
        "node a writable one with EXO_HOME"
    )


class DiskSpace:
    """Whether the data directory has room, as the API asks before each state-changing
    command: full once a write failed for want of space (`mark_full`) or while less than
    `MIN_FREE_BYTES` are free; room again once that much is free."""

    def __init__(self, directory: Path, min_free_bytes: int = MIN_FREE_BYTES) -> None:
        self.directory = directory
        self.min_free_bytes = min_free_bytes
        self._marked = False

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.directory).free

    def mark_full(self) -> None:
        """A write ran out of space: log it (once until space is back)."""
        if not self._marked:
            logger.error(full_message(self.directory))
        self._marked = True

    def problem(self) -> str | None:
        """The 503's message while the directory is full, else None (one `statvfs`)."""
        try:
            room = self.free_bytes() >= self.min_free_bytes
        except OSError:
            return None  # the directory vanished or cannot be read: writes will say why
        if room:
            if self._marked:
                logger.info(f"the data directory {self.directory} has room again")
            self._marked = False
            return None
        self.mark_full()
        return full_message(self.directory)
