"""The node's allocation tracing: off without `EXO_TRACEMALLOC`; with it, `SIGUSR2` writes a
loadable snapshot and its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from exo.utils.memory_trace import (
    INDEX_FILE,
    TRACE_DIRECTORY_ENV,
    TRACE_FRAMES_ENV,
    TRACE_HOLDERS_ENV,
    start_tracing_from_environment,
)


def test_nothing_is_traced_without_the_variable() -> None:
    assert start_tracing_from_environment({}) is False
    assert start_tracing_from_environment({TRACE_DIRECTORY_ENV: ""}) is False
    assert not tracemalloc.is_tracing()


def test_a_negative_frame_count_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=TRACE_FRAMES_ENV):
        start_tracing_from_environment({TRACE_DIRECTORY_ENV: str(tmp_path), TRACE_FRAMES_ENV: "-1"})
    assert not tracemalloc.is_tracing()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGUSR2")
def test_sigusr2_writes_a_snapshot_that_holds_what_the_process_allocated(tmp_path: Path) -> None:
    # In a process of its own: tracing and the signal handler stay out of the test runner.
    script = textwrap.dedent(
        """
        import os, signal
        from exo.utils.memory_trace import start_tracing_from_environment
        assert start_tracing_from_environment()
        kept = [bytearray(1000) for _ in range(2000)]  # ~2 MB at this line
        class Held: pass
        class Box:
            def __init__(self): self.inside = {"key": Held()}
        boxes = [Box()]
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)
        """
    )
    environment = {
        **os.environ,
        TRACE_DIRECTORY_ENV: str(tmp_path),
        TRACE_FRAMES_ENV: "4",
        TRACE_HOLDERS_ENV: "__main__.Held",
    }
    subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=120)
    lines = (tmp_path / INDEX_FILE).read_text().splitlines()
    figures = [json.loads(line) for line in lines]
    assert [f["path"] for f in figures] == ["snapshot-000.tracemalloc", "snapshot-001.tracemalloc"]
    assert all(f["traced_bytes"] >= 2_000_000 and f["rss_bytes"] > 0 for f in figures)
    snapshot = tracemalloc.Snapshot.load(str(tmp_path / figures[0]["path"]))
    assert snapshot.traceback_limit == 4
    at_the_line = [s for s in snapshot.statistics("lineno") if s.traceback[0].lineno == 5]
    assert at_the_line and at_the_line[0].size >= 2_000_000
    assert figures[0]["types"]["__main__.Box"] == 1
    if sys.platform.startswith("linux"):  # glibc's heap figures
        assert figures[0]["malloc_in_use"] > 0
    # What keeps the Held alive: the dict inside the Box, in the list `boxes`.
    holders = (tmp_path / "holders-000.txt").read_text().splitlines()
    assert holders[0] == "__main__.Held: 1 sampled"
    assert holders[1].strip().split(" <- ") == [
        "builtins.dict['key']",
        "__main__.Box.inside",
        "builtins.list",
        "module __main__.boxes",
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGUSR2, glibc")
def test_zero_frames_write_figures_without_tracing(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import os, signal, tracemalloc
        from exo.utils.memory_trace import start_tracing_from_environment
        assert start_tracing_from_environment()
        assert not tracemalloc.is_tracing()
        os.kill(os.getpid(), signal.SIGUSR2)
        """
    )
    environment = {**os.environ, TRACE_DIRECTORY_ENV: str(tmp_path), TRACE_FRAMES_ENV: "0"}
    subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=120)
    [line] = (tmp_path / INDEX_FILE).read_text().splitlines()
    figures = json.loads(line)
    assert "traced_bytes" not in figures and not list(tmp_path.glob("*.tracemalloc"))
    # CPython's small-object arenas hold at least the live blocks in them.
    assert figures["pymalloc_arenas"] >= figures["pymalloc_allocated"] > 0
    assert figures["rss_bytes"] > 0 and figures["malloc_in_use"] > 0
