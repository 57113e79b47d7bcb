"""What a serving node keeps per request: snapshots of a node's memory under the soak's
traffic, compared phase by phase.

Usage: PYTHONPATH=src python bench/node_memory.py [--warmup 80] [--requests 150]
       [--phases 2] [--streams 4] [--seed 23] [--max-tokens 12] [--frames 16] [--top 15]
       [--json PATH] [--keep DIR] [--models-dir DIR]

A node is started on loopback with the default model (a fresh home, random ports, its own
namespace) and `EXO_TRACEMALLOC` set (`exo.utils.memory_trace`), so it traces its Python
allocations and writes a snapshot on `SIGUSR2`. `--streams` clients send the soak's requests
(`bench/soak.py`: the four dialects, some cancelled with `POST /v1/cancel/{id}`, some
disconnected mid-stream), 4 to `--max-tokens` tokens each (Responses: at least 16). After
`--warmup` requests the first snapshot is taken, then one after each phase of `--requests`
requests, each once the node holds no task. Each phase's growth is printed per request:
traced bytes (live Python objects), tracemalloc's own bookkeeping, RSS, glibc's heap in use
and free, CPython's small-object arenas (only with `--frames 0`, which traces nothing and
gives the figures without tracing's cost), live objects by type; then the allocation sites
that grew most (file and line of the newest frame) and the call paths of the top ones (up
to `--frames` frames). `--keep` keeps the snapshots and the holders files (what keeps the
newest instances of `HOLDER_TYPES` alive) for a closer look.

Tracing slows the node several-fold; the figures are bytes, not times, so a machine busy with
other work changes how long a run takes, not what it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx

from exo.shared.constants import models_dir as default_models_dir
from exo.testing.processes import ExoNode, wait_until
from exo.utils.memory_trace import (
    INDEX_FILE,
    TRACE_DIRECTORY_ENV,
    TRACE_FRAMES_ENV,
    TRACE_HOLDERS_ENV,
)

sys.path.insert(0, str(Path(__file__).parent))
import soak  # bench/soak.py: the soak's requests

# Per-request objects whose holders each snapshot writes (`holders-NNN.txt`).
HOLDER_TYPES = (
    "exo.shared.types.events.TaskCreated",
    "exo.shared.types.events.TaskStatusUpdated",
    "exo.shared.types.events.RunnerStatusUpdated",
    "exo.shared.types.events.IndexedEvent",
    "exo.shared.types.events.ForwarderEvent",
    "exo.shared.types.commands.ForwarderCommand",
    "exo.shared.types.tasks.TextGeneration",
    "exo.shared.types.state.CommandOutcome",
)
# The figures of each snapshot compared (`exo.utils.memory_trace`), bytes but the last.
FIGURES = (
    "traced_bytes", "tracemalloc_bytes", "rss_bytes", "malloc_in_use", "malloc_free",
    "pymalloc_arenas", "pymalloc_allocated", "pymalloc_available", "pymalloc_unused_pools",
    "gc_objects",
)  # fmt: skip
IDLE_TIMEOUT_SECONDS = 300.0
SNAPSHOT_TIMEOUT_SECONDS = 300.0


def send_requests(url: str, count: int, streams: int, seed: int, max_tokens: int) -> soak.Outcomes:
    """Send `count` of the soak's requests from `streams` clients; how they ended."""
    outcomes = soak.Outcomes()
    remaining = [count]
    lock = threading.Lock()

    def take() -> bool:
        with lock:
            remaining[0] -= 1
            return remaining[0] >= 0

    def stream(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        transport = httpx.HTTPTransport(local_address=soak.client_address(index))
        with httpx.Client(timeout=soak.CLIENT_TIMEOUT_SECONDS, transport=transport) as client:
            while take():
                soak.one_request(client, rng, outcomes, url, max_tokens)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def wait_idle(node: ExoNode) -> None:
    """Wait until the node's state holds no task (cancelled and disconnected ones ended)."""
    wait_until(
        lambda: not node.state()["tasks"], IDLE_TIMEOUT_SECONDS, interval=1.0, what="no tasks"
    )


def take_snapshot(node: ExoNode, directory: Path) -> dict[str, Any]:
    """Signal the node for a snapshot and wait for its figures."""
    assert node.process is not None
    index = directory / INDEX_FILE
    before = len(index.read_text().splitlines()) if index.exists() else 0
    os.kill(node.process.pid, signal.SIGUSR2)

    def written() -> dict[str, Any] | None:
        lines = index.read_text().splitlines() if index.exists() else []
        return json.loads(lines[before]) if len(lines) > before else None

    figures: dict[str, Any] = wait_until(written, SNAPSHOT_TIMEOUT_SECONDS, what="a snapshot")
    return figures


def compare(
    directory: Path, old: dict[str, Any], new: dict[str, Any], requests: int, top: int
) -> dict[str, Any]:
    """The growth from snapshot `old` to `new`, per request, by site (when traced)."""
    sites: list[dict[str, Any]] = []
    paths: list[dict[str, Any]] = []
    if "path" in old and "path" in new:
        exclude = [tracemalloc.Filter(False, tracemalloc.__file__)]
        first = tracemalloc.Snapshot.load(str(directory / old["path"])).filter_traces(exclude)
        second = tracemalloc.Snapshot.load(str(directory / new["path"])).filter_traces(exclude)
        sites = [
            {
                "site": str(stat.traceback[0]),
                "bytes_per_request": stat.size_diff / requests,
                "blocks_per_request": stat.count_diff / requests,
                "bytes": stat.size,
            }
            for stat in second.compare_to(first, "lineno")[:top]
        ]
        paths = [
            {
                "bytes_per_request": stat.size_diff / requests,
                "blocks_per_request": stat.count_diff / requests,
                "path": [str(frame) for frame in reversed(stat.traceback)],
            }
            for stat in second.compare_to(first, "traceback")[: max(3, top // 3)]
        ]
    types = {
        name: (count - old["types"].get(name, 0)) / requests
        for name, count in new["types"].items()
        if abs(count - old["types"].get(name, 0)) >= requests / 10
    }
    per_request = {
        figure: (new[figure] - old[figure]) / requests
        for figure in FIGURES
        if figure in new and figure in old
    }
    return {
        "requests": requests,
        "per_request": per_request,
        "now": {figure: new[figure] for figure in per_request},
        "sites": sites,
        "paths": paths,
        "types_per_request": dict(sorted(types.items(), key=lambda item: -abs(item[1]))[:top]),
    }


def report(phase: int, growth: dict[str, Any]) -> None:
    per_request = ", ".join(f"{k} {v:+,.0f}" for k, v in growth["per_request"].items())
    now = ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in growth["now"].items() if k != "gc_objects"
    )
    print(f"\nphase {phase}: {growth['requests']} requests; per request: {per_request}; now {now}")
    for detail, count in {**growth["refusals"], **dict.fromkeys(growth["unclean"], 1)}.items():
        print(f"  refused, failed or unclean x{count}: {detail}")
    for name, count in growth["types_per_request"].items():
        print(f"  {count:+7.2f} objects/req  {name}")
    for site in growth["sites"]:
        print(
            f"  {site['bytes_per_request']:+9,.0f} B/req {site['blocks_per_request']:+7.2f} "
            f"blocks/req  {site['site']}"
        )
    for path in growth["paths"]:
        print(f"  path {path['bytes_per_request']:+,.0f} B/req:")
        for frame in path["path"]:
            print(f"      {frame}")


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--warmup", type=int, default=80)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--phases", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--seed", type=int, default=23)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument(
        "--keep", type=Path, default=None, help="copy the snapshots and holders files here"
    )
    arguments = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result: dict[str, Any] = {"arguments": {k: str(v) for k, v in vars(arguments).items()}}
    with tempfile.TemporaryDirectory(prefix="exo-node-memory-") as home:
        directory = Path(home) / "traces"
        env = {
            TRACE_DIRECTORY_ENV: str(directory),
            TRACE_FRAMES_ENV: str(arguments.frames),
            TRACE_HOLDERS_ENV: ",".join(HOLDER_TYPES),
        }
        models = arguments.models_dir or default_models_dir()
        node = ExoNode(Path(home) / "node", models, ("-q",), env=env)
        node.start()
        try:
            node.wait_ready()
            started = time.monotonic()
            outcomes = send_requests(
                node.url, arguments.warmup, arguments.streams, arguments.seed, arguments.max_tokens
            )
            wait_idle(node)
            snapshots = [take_snapshot(node, directory)]
            print(f"warm-up: {dict(outcomes.counts)} in {time.monotonic() - started:.0f} s")
            result["phases"] = []
            for phase in range(1, arguments.phases + 1):
                started = time.monotonic()
                outcomes = send_requests(
                    node.url,
                    arguments.requests,
                    arguments.streams,
                    arguments.seed + phase,
                    arguments.max_tokens,
                )
                wait_idle(node)
                snapshots.append(take_snapshot(node, directory))
                print(
                    f"phase {phase}: {dict(outcomes.counts)} in {time.monotonic() - started:.0f} s"
                )
                growth = compare(
                    directory, snapshots[-2], snapshots[-1], arguments.requests, arguments.top
                )
                growth["outcomes"] = dict(outcomes.counts)
                growth["unclean"] = outcomes.unclean[:10]
                growth["refusals"] = dict(outcomes.refusals.most_common(5))
                report(phase, growth)
                result["phases"].append(growth)
        finally:
            node.stop()
            if arguments.keep is not None and directory.exists():
                shutil.copytree(directory, arguments.keep, dirs_exist_ok=True)
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
