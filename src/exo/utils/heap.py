"""Giving freed heap memory back to the OS in long-running processes (glibc).

glibc's allocator keeps memory freed inside its heap (`brk` arena and per-thread arenas) for
reuse; it returns only a free region at the very top of the heap. A runner allocates and
frees activations, logits and token lists of every size for hours, so free holes pile up
between live blocks and its RSS creeps up although nothing leaks: in the 30-minute soak a
runner's heap reached 671 MiB, and `malloc_trim(0)` called from outside gave back 155 MiB
(1,501 -> 1,343 MiB RSS). `malloc_trim` (glibc >= 2.8) returns the whole free pages inside
every arena too (`madvise(MADV_DONTNEED)`), without moving anything. It walks the arenas'
free lists, so it runs at most every `interval_s` (`HeapTrimmer`), and on other C libraries
it does nothing.

The allocator's dynamic mmap threshold is left alone: a fixed low threshold would map and
fault in every multi-megabyte prefill activation again on each use.

Trimming cannot return memory that is still referenced, and two caches inside torch's CPU
kernels keep one entry per distinct input shape: oneDNN's primitive cache
(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`, 1024 entries by default) and ideep's computation cache
in torch's mkldnn integration (`LRU_CACHE_CAPACITY`, 1024 by default). Every new prefill
length is a new shape, so a runner serving prompts of every length grew its heap by ~0.6 MiB
per bfloat16 linear shape and ~1.8 MiB per request (SmolLM2-135M: +470 MiB over 400 prompts
of distinct lengths, after trimming). `bound_kernel_caches` caps both for the processes a
node spawns; at 64 entries the heap stayed flat over the same 400 prompts and decode and
prefill speed did not change (bench/bench_prefill_heap.py; measured on the 2-core
reference machine).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path

_malloc_trim: Callable[[int], int] | None = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _function = _libc.malloc_trim  # absent from musl: AttributeError
        _function.argtypes = [ctypes.c_size_t]
        _function.restype = ctypes.c_int
        _malloc_trim = _function
    except (OSError, AttributeError):
        _malloc_trim = None


KERNEL_CACHE_CAPACITY = 64
"""Entries kept by each of torch's per-shape CPU kernel caches in runner processes: enough
for the shapes a serving loop repeats (decode batches of every size, common chunk lengths),
far below the default 1024 that holds ~0.6 MiB per shape."""

KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(environ: MutableMapping[str, str] | None = None) -> None:
    """Cap oneDNN's primitive cache and torch's ideep computation cache at
    `KERNEL_CACHE_CAPACITY` entries in `environ` (default: `os.environ`), so that processes
    started from it afterwards (a node's runners) keep them bounded. Both are read once when
    torch first uses them, so this must run before the process that uses them imports torch;
    a value the user already set is kept."""
    target = os.environ if environ is None else environ
    for name in KERNEL_CACHE_VARIABLES:
        target.setdefault(name, str(KERNEL_CACHE_CAPACITY))


def freeze_long_lived_objects() -> int:
    """Collect garbage, then move every object alive now into the collector's permanent
    generation (`gc.freeze`, Python >= 3.7), where later collections do not walk it; how
    many objects were frozen.

    Call it once a process has built what it keeps for its whole life (a runner's loaded and
    warmed-up model). A full collection otherwise walks those objects too: in a runner of
    SmolLM2-135M one took 170 ms, measured while it streamed (one every ~1,200 tokens),
    stalling that decode step; after freezing, 0.2 ms. The frozen objects are never freed by
    the cycle collector (they still are by reference counting), so call it after loading,
    not in a loop.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def trim_heap() -> bool:
    """Return free heap pages to the OS now; True if the C library has `malloc_trim` and
    released something."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))


class HeapTrimmer:
    """Calls `trim_heap` at most once per `interval_s` seconds (monotonic clock).

    Args:
        interval_s: the least time between two trims.
        clock: the time source (seconds), for tests.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self.trims = 0

    def maybe_trim(self, force: bool = False) -> None:
        """Trim if `interval_s` passed since the last trim (or `force`, still at most once
        per second)."""
        now = self._clock()
        elapsed = now - self._last
        if elapsed < self.interval_s and not (force and elapsed >= 1.0):
            return
        self._last = now
        self.trims += 1
        trim_heap()


async def trim_heap_periodically(interval_s: float = 60.0) -> None:
    """Trim this process's heap every `interval_s` seconds until cancelled (a node's
    background task)."""
    import anyio

    while True:
        await anyio.sleep(interval_s)
        trim_heap()


HUGE_PAGES_ENV = "EXO_HUGE_PAGES"
"""`0` keeps a node's runners on the kernel's default pages (`advise_huge_pages`)."""

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
"""glibc's (>= 2.35) tunable: 1 makes malloc advise the memory it maps `MADV_HUGEPAGE`, so
that where transparent huge pages are "madvise" the kernel backs it with 2 MiB pages when
first touched. Older glibc ignores the tunable."""

THP_MODE_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def transparent_huge_pages_mode(path: Path = THP_MODE_PATH) -> str | None:
    """The kernel's transparent huge page mode: the bracketed word of `path` ("always",
    "madvise" or "never"), None where it cannot be read (not Linux, no THP)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def advise_huge_pages(
    environ: MutableMapping[str, str] | None = None, mode: str | None = None
) -> bool:
    """Ask glibc to advise huge pages for the processes started from `environ` (default:
    `os.environ`) afterwards: a node's runners, which hold the model's weights in memory
    torch allocates through malloc and read them all once per decode step.

    Why: a decode step reads each weight it needs once, and a MoE step reads 8 experts of
    ~1 MB each chosen anew per layer; on 4 KiB pages every 4 KiB of such a read is a TLB
    entry and a point where the hardware prefetcher stops. Measured on the 2-core reference
    machine (docs/benchmarks/2026-12-06-huge-pages-and-q6k-head.md): a MoE model's decode
    8-11 % faster at the median of interleaved rounds, RSS unchanged. Where the kernel's mode
    (`transparent_huge_pages_mode`) is "madvise" (Debian's and Ubuntu's default), nothing
    gets huge pages unless advised; under "always" large allocations get them already and
    under "never" they cannot: only "madvise" is changed.

    Adds `glibc.malloc.hugetlb=1` to `GLIBC_TUNABLES` (keeping what is there), unless
    `EXO_HUGE_PAGES=0` or the tunables name `glibc.malloc.hugetlb` already (the user's
    choice). Returns whether it added it.
    """
    target = os.environ if environ is None else environ
    if target.get(HUGE_PAGES_ENV) == "0":
        return False
    if (mode if mode is not None else transparent_huge_pages_mode()) != "madvise":
        return False
    tunables = target.get("GLIBC_TUNABLES", "")
    if any(item.split("=", 1)[0] == HUGE_PAGE_TUNABLE for item in tunables.split(":") if item):
        return False
    target["GLIBC_TUNABLES"] = ":".join(filter(None, (tunables, f"{HUGE_PAGE_TUNABLE}=1")))
    return True
