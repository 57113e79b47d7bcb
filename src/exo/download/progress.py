"""Download progress: bytes, speed and ETA per file and in total, reported at most
`max_per_second` times a second (and always at the end), from any number of threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from exo.shared.types.downloads import DownloadProgress, FileProgress

ProgressCallback = Callable[[DownloadProgress], None]


class ProgressTracker:
    """Collects per-file byte counts from download threads and calls `on_progress`,
    throttled to `max_per_second` (the final report is never dropped)."""

    def __init__(
        self,
        files: Mapping[str, int],
        on_progress: ProgressCallback | None,
        max_per_second: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        sha256: Mapping[str, str] | None = None,
    ) -> None:
        self._totals = dict(files)
        self._sha256 = dict(sha256 or {})
        self._done: dict[str, int] = dict.fromkeys(files, 0)
        self._sources: dict[str, str] = dict.fromkeys(files, "hub")
        self._on_progress = on_progress
        self._interval = 1.0 / max_per_second
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._received = 0
        self._last_report: float | None = None

    def start_file(self, path: str, on_disk: int, source: str = "hub") -> None:
        """A transfer of `path` starts with `on_disk` bytes already there (not counted as
        received for the speed)."""
        with self._lock:
            self._done[path] = on_disk
            self._sources[path] = source
        self._maybe_report()

    def update(self, path: str, on_disk: int) -> None:
        """`path` now holds `on_disk` bytes."""
        with self._lock:
            self._received += max(0, on_disk - self._done.get(path, 0))
            self._done[path] = on_disk
        self._maybe_report()

    def snapshot(self, complete: bool = False) -> DownloadProgress:
        with self._lock:
            downloaded = sum(self._done.values())
            total = sum(self._totals.values())
            elapsed = max(self._clock() - self._started, 1e-6)
            speed = self._received / elapsed
            eta = (total - downloaded) / speed if speed > 0 else None
            files = tuple(
                FileProgress(
                    path=path,
                    downloaded_bytes=self._done[path],
                    total_bytes=size,
                    source=self._sources[path],
                    sha256=self._sha256.get(path),
                )
                for path, size in sorted(self._totals.items())
            )
        return DownloadProgress(
            downloaded_bytes=downloaded,
            total_bytes=total,
            speed_bytes_per_second=speed,
            eta_seconds=0.0 if complete else eta,
            files=files,
            complete=complete,
        )

    def finish(self) -> None:
        """Report completion (every file verified in place)."""
        with self._lock:
            for path, size in self._totals.items():
                self._done[path] = size
        if self._on_progress is not None:
            self._on_progress(self.snapshot(complete=True))

    def _maybe_report(self) -> None:
        if self._on_progress is None:
            return
        now = self._clock()
        with self._lock:
            if self._last_report is not None and now - self._last_report < self._interval:
                return
            self._last_report = now
        self._on_progress(self.snapshot())
