"""Heap trimming: freed holes inside glibc's heap go back to the OS; the trimmer's pacing."""

from __future__ import annotations

import sys

import psutil
import pytest

from exo.utils import heap
from exo.utils.heap import HeapTrimmer, trim_heap

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_free_holes_inside_the_heap() -> None:
    if heap._malloc_trim is None:
        pytest.skip("this C library has no malloc_trim")
    process = psutil.Process()
    # 64 KiB blocks come from the heap (below the mmap threshold); freeing every block but a
    # few at the top leaves ~190 MiB of holes glibc keeps (nothing at the top to give back).
    blocks = [bytearray(64 * 1024) for _ in range(3200)]
    keep = blocks[-16:]
    del blocks
    holding = process.memory_info().rss
    trim_heap()
    released = holding - process.memory_info().rss
    assert released > 100 * MIB, f"trim gave back {released / MIB:.0f} MiB"
    assert len(keep) == 16 and all(len(block) == 64 * 1024 for block in keep)


def test_the_trimmer_trims_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def fake_trim() -> bool:
        calls.append(1)
        return True

    monkeypatch.setattr(heap, "trim_heap", fake_trim)
    now = [100.0]
    trimmer = HeapTrimmer(30.0, clock=lambda: now[0])
    trimmer.maybe_trim()
    now[0] += 29.0
    trimmer.maybe_trim()
    assert calls == []
    now[0] += 1.5
    trimmer.maybe_trim()
    assert calls == [1]
    now[0] += 0.5
    trimmer.maybe_trim(force=True)  # forced, but less than a second after the last
    assert calls == [1]
    now[0] += 1.0
    trimmer.maybe_trim(force=True)
    assert calls == [1, 1] and trimmer.trims == 2
