"""Tracing where a node's Python memory goes, for finding what grows (off by default).

`EXO_TRACEMALLOC=DIR` in a node's environment starts `tracemalloc` once the node's modules
are imported (`EXO_TRACEMALLOC_FRAMES` frames per allocation, default 16; 0 traces
nothing, for the figures below without tracing's own cost in them) and makes `SIGUSR2`
write, after a full garbage collection:
- `DIR/snapshot-NNN.tracemalloc` (`tracemalloc.Snapshot.load` reads it);
- one JSON line in `DIR/snapshots.jsonl`: the traced bytes (live Python objects), the
  process's RSS, glibc's heap in use and free (`mallinfo2`: every library's malloc, zenoh's
  and pydantic-core's too), CPython's small-object arenas against the live blocks in them
  (only when not tracing), and the count of live objects by type. RSS growing while traced
  bytes do not is the allocators' (free memory kept, fragmentation), not objects kept;
- with `EXO_TRACEMALLOC_HOLDERS=module.Class,...`, `DIR/holders-NNN.txt`: for the newest
  instances of each named type, the chain of objects that keeps each alive.
`bench/node_memory.py` drives a node this way and compares its snapshots.

Only the node process is traced: its runners are other processes, started without this
module. Tracing costs time and memory (each traced block carries its traceback, ~100 bytes
a frame), so it is for a test node, never a serving one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import os
import re
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import AsyncGeneratorType, CoroutineType, FrameType, ModuleType
from typing import Any

TRACE_DIRECTORY_ENV = "EXO_TRACEMALLOC"
TRACE_FRAMES_ENV = "EXO_TRACEMALLOC_FRAMES"
TRACE_HOLDERS_ENV = "EXO_TRACEMALLOC_HOLDERS"
DEFAULT_FRAMES = 16
HOLDER_DEPTH = 8
"""Referrer steps followed from an instance towards what keeps it alive."""
HOLDER_SAMPLES = 3
"""Instances of each named type whose holders are written (the newest ones)."""
SNAPSHOT_SIGNAL = signal.SIGUSR2
INDEX_FILE = "snapshots.jsonl"


def resident_bytes() -> int:
    """This process's resident set size in bytes (Linux `/proc/self/statm`; 0 elsewhere)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def malloc_figures() -> dict[str, int]:
    """glibc's heap figures (`mallinfo2`, glibc >= 2.33), in bytes: `malloc_in_use` (blocks
    allocated through malloc, by any library: Python's large objects, zenoh, pydantic-core)
    and `malloc_free` (free memory inside the heap, kept by the allocator). Empty where the
    C library has no `mallinfo2`."""
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    function.restype = _MallInfo2
    info = function()
    return {"malloc_in_use": info.uordblks + info.hblkhd, "malloc_free": info.fordblks}


def pymalloc_figures() -> dict[str, int]:
    """CPython's small-object allocator (`sys._debugmallocstats`), in bytes: `pymalloc_arenas`
    (the memory its arenas hold), `pymalloc_allocated` (in live blocks), `pymalloc_available`
    (free blocks inside used pools) and `pymalloc_unused_pools`: arenas much larger than the
    live blocks are fragmentation. The statistics are printed on file descriptor 2, which
    is pointed at a temporary file meanwhile (another thread's log line may land there).
    Empty while `tracemalloc` traces: CPython prints them only when pymalloc is the
    allocator in place, and tracing wraps it."""
    if not hasattr(sys, "_debugmallocstats"):
        return {}
    patterns = {
        "pymalloc_arenas": r"^\d+ arenas \* \d+ bytes/arena\s+=\s+([\d,]+)",
        "pymalloc_allocated": r"^# bytes in allocated blocks\s+=\s+([\d,]+)",
        "pymalloc_available": r"^# bytes in available blocks\s+=\s+([\d,]+)",
        "pymalloc_unused_pools": r"^\d+ unused pools \* \d+ bytes\s+=\s+([\d,]+)",
    }
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        capture.seek(0)
        text = capture.read().decode(errors="replace")
    figures: dict[str, int] = {}
    for name, pattern in patterns.items():
        found = re.search(pattern, text, re.MULTILINE)
        if found is not None:
            figures[name] = int(found.group(1).replace(",", ""))
    return figures


def _type_name(value: object) -> str:
    """`module.Class`; a coroutine or async generator also names its function (`builtins.
    coroutine:Api.stream`), so that those left suspended can be told apart."""
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, CoroutineType | AsyncGeneratorType):
        return f"{name}:{value.__qualname__}"
    return name


def type_counts() -> Counter[str]:
    """Live objects tracked by the garbage collector, by `_type_name`."""
    return Counter(_type_name(o) for o in gc.get_objects())


def _describe(holder: Any, held: Any) -> str:
    """One referrer step: the holder's type and, where cheap, how it holds `held`."""
    if isinstance(holder, ModuleType):
        return f"module {holder.__name__}"
    name = f"{type(holder).__module__}.{type(holder).__qualname__}"
    if isinstance(holder, dict):
        for key, value in holder.items():
            if value is held:
                return f"{name}[{repr(key)[:60]}]"
    return name


def holder_chain(instance: Any, ignore: set[int]) -> list[str]:
    """What keeps `instance` alive: the first referrer of each step that is no frame, no
    module and none of `ignore` (the caller's own lists), up to `HOLDER_DEPTH` steps; a
    dict that is an object's `__dict__` is shown as that object. (Plain loops: a
    comprehension here would hold the object it looks at in a closure cell.)"""
    chain: list[str] = []
    current = instance
    seen = {id(instance)}
    for _ in range(HOLDER_DEPTH):
        holder = None
        for referrer in gc.get_referrers(current):
            if id(referrer) in ignore or id(referrer) in seen or isinstance(referrer, FrameType):
                continue
            holder = referrer
            break
        if holder is None:
            break
        owner = None
        for referrer in gc.get_referrers(holder):
            if getattr(referrer, "__dict__", None) is holder:
                owner = referrer
                break
        if isinstance(holder, dict) and owner is not None:
            key = "?"
            for name, value in holder.items():
                if value is current:
                    key = str(name)
                    break
            chain.append(f"{_describe(owner, holder)}.{key}")
            holder = owner
        else:
            chain.append(_describe(holder, current))
        if isinstance(holder, ModuleType):
            break
        seen.add(id(holder))
        current = holder
    return chain


class SnapshotWriter:
    """Writes numbered `tracemalloc` snapshots and their figures into `directory`.

    Args:
        directory: where snapshots go (created if absent).
        holder_types: qualified type names (`module.Class`) whose newest instances' holders
            (`holder_chain`) go into `holders-NNN.txt` with each snapshot.
    """

    def __init__(self, directory: Path, holder_types: tuple[str, ...] = ()) -> None:
        self.directory = directory
        self.holder_types = holder_types
        self.written = 0

    def write(self) -> dict[str, Any]:
        """Collect garbage, then write the next snapshot (when tracing) and its figures;
        the figures."""
        gc.collect()
        self.directory.mkdir(parents=True, exist_ok=True)
        figures: dict[str, Any] = {"time": time.time()}
        if tracemalloc.is_tracing():
            path = self.directory / f"snapshot-{self.written:03d}.tracemalloc"
            tracemalloc.take_snapshot().dump(str(path))
            traced_bytes, peak_bytes = tracemalloc.get_traced_memory()
            figures |= {
                "path": path.name,
                "traced_bytes": traced_bytes,
                "traced_peak_bytes": peak_bytes,
                # tracemalloc's own bookkeeping, in the RSS too
                "tracemalloc_bytes": tracemalloc.get_tracemalloc_memory(),
            }
        counts = type_counts()
        figures |= {
            "rss_bytes": resident_bytes(),
            **malloc_figures(),
            **pymalloc_figures(),
            "gc_objects": sum(counts.values()),
            "types": dict(counts.most_common()),
        }
        with (self.directory / INDEX_FILE).open("a", encoding="utf-8") as index:
            index.write(json.dumps(figures) + "\n")
        if self.holder_types:
            self._write_holders(self.directory / f"holders-{self.written:03d}.txt")
        self.written += 1
        return figures

    def _write_holders(self, path: Path) -> None:
        objects = gc.get_objects()
        lines: list[str] = []
        for wanted in self.holder_types:
            instances = [
                o for o in objects if f"{type(o).__module__}.{type(o).__qualname__}" == wanted
            ][-HOLDER_SAMPLES:]
            ignore = {id(objects), id(instances), id(lines), id(sys._getframe())}
            lines.append(f"{wanted}: {len(instances)} sampled")
            lines += ["  " + " <- ".join(holder_chain(o, ignore)) for o in instances]
        del objects
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def start_tracing_from_environment(environ: Mapping[str, str] | None = None) -> bool:
    """Start `tracemalloc` and the `SIGUSR2` snapshot handler when `EXO_TRACEMALLOC` names a
    directory in `environ` (default: `os.environ`); whether it did. Call it from the main
    thread (signal handlers can only be set there), before the node starts, so that the
    objects built at start are traced too.

    `EXO_TRACEMALLOC_FRAMES=0` traces nothing: each snapshot is then only its figures (RSS,
    the allocators', objects by type), without tracing's own memory and time in them.

    Raises:
        ValueError: `EXO_TRACEMALLOC_FRAMES` is negative.
    """
    source = os.environ if environ is None else environ
    directory = source.get(TRACE_DIRECTORY_ENV)
    if not directory:
        return False
    frames = int(source.get(TRACE_FRAMES_ENV, DEFAULT_FRAMES))
    if frames < 0:
        raise ValueError(f"{TRACE_FRAMES_ENV} must be 0 or more, not {frames}")
    holders = tuple(filter(None, source.get(TRACE_HOLDERS_ENV, "").split(",")))
    writer = SnapshotWriter(Path(directory), holders)

    def on_signal(_number: int, _frame: FrameType | None) -> None:
        writer.write()

    if frames > 0:
        tracemalloc.start(frames)
    signal.signal(SNAPSHOT_SIGNAL, on_signal)
    return True
