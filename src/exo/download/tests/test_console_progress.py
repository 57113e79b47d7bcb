"""The console's download bars: one per model, showing bytes, gone when it ends."""

from __future__ import annotations

import io

from rich.console import Console

from exo.download.console import ConsoleProgress
from exo.shared.types.downloads import DownloadProgress


def progress(done: int, complete: bool = False) -> DownloadProgress:
    return DownloadProgress(
        downloaded_bytes=done,
        total_bytes=4_000_000,
        speed_bytes_per_second=1e6,
        eta_seconds=None if complete else 2.0,
        complete=complete,
    )


def test_a_bar_per_model_shows_its_bytes_and_ends() -> None:
    output = io.StringIO()
    bars = ConsoleProgress(Console(file=output, force_terminal=True, width=120))
    bars.update("org/model-a", progress(1_000_000))
    bars.update("org/model-b", progress(3_000_000))
    bars.update("org/model-a", progress(4_000_000, complete=True))
    bars.end("org/model-b")
    bars.end("org/model-b")  # ending twice is harmless
    text = output.getvalue()
    assert "org/model-a" in text and "org/model-b" in text
    assert "4.0/4.0 MB" in text
    assert bars._tasks == {}
