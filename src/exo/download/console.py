"""A rich progress bar per model download on the node's console: bytes, speed and time
left, from the same `DownloadProgress` reports the state gets."""

from __future__ import annotations

import threading

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from exo.shared.types.downloads import DownloadProgress


class ConsoleProgress:
    """One bar per model while it downloads; the display stops when none is left.
    Safe to call from download threads."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console or Console(stderr=True),
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}
        self._lock = threading.Lock()

    def update(self, model_id: str, progress: DownloadProgress) -> None:
        with self._lock:
            task = self._tasks.get(model_id)
            if task is None:
                if not self._tasks:
                    self._progress.start()
                task = self._progress.add_task(model_id, total=progress.total_bytes)
                self._tasks[model_id] = task
            self._progress.update(
                task, completed=progress.downloaded_bytes, total=progress.total_bytes
            )
            self._progress.refresh()  # reports come at most twice a second: show each
            if progress.complete:
                self._end(model_id)

    def end(self, model_id: str) -> None:
        """The download ended (complete, failed or cancelled): drop its bar."""
        with self._lock:
            self._end(model_id)

    def _end(self, model_id: str) -> None:
        task = self._tasks.pop(model_id, None)
        if task is None:
            return
        self._progress.remove_task(task)
        if not self._tasks:
            self._progress.stop()
