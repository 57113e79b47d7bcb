"""One node per data directory.

Two `exo` processes started with the same `EXO_HOME` would both append to its event log and
both claim its node id: the log interleaves two histories (seen: a node that then could not
replay it) and the cluster sees one node twice. The first node holds an exclusive `flock`
on `<EXO_HOME>/node.lock` for its whole life; a second one is refused at start with the
first's process id. The system releases the lock when its holder dies, however it dies, so
a killed node never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_FILE_NAME = "node.lock"


class HomeInUseError(RuntimeError):
    """Another live process holds the data directory."""


class HomeLock:
    """Holds `<home>/node.lock` until `release` (or the process's end).

    Raises:
        HomeInUseError: another process (or another `HomeLock` in this one) holds it; the
            message names the directory and the holder's process id where it is known.
    """

    def __init__(self, home: Path) -> None:
        self.path = home / LOCK_FILE_NAME
        handle: IO[str] = open(self.path, "a+")  # noqa: SIM115 - held for the node's life
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise HomeInUseError(
                f"{home.resolve()} is in use by another exo node"
                + (f" (pid {holder})" if holder.isdigit() else "")
                + "; give each node on one machine its own data directory (EXO_HOME)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        """Give the directory up (idempotent)."""
        if self._handle is not None:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
