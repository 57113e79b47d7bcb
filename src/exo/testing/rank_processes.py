"""Run the ranks of one process group as spawned processes and collect what they report,
for the multi-process engine tests (sharded == unsharded and its kin).

Each rank runs `target(rank, world_size, port, results, *args)`: `port` a free loopback
port for the group's rendezvous, `results` a queue on which it puts tuples whose first
item is a kind. A rank ends with `("done", ...)` (counted, not returned) or, on any
exception, `("error", ..., rank, traceback)`; every other tuple is returned in arrival
order for the test to read.

A rank's process stays alive after its target returns until the parent has read every
rank's reports (`_run_rank`, bounded by `RELEASE_SECONDS`): a tensor in a report travels as
a file descriptor its process shares on request, which a process that already exited can no
longer hand over ("No such file or directory" when the parent unpickles it).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from exo.testing.ports import free_port

# How long a finished rank's process gets to exit before it is killed (seconds).
JOIN_SECONDS = 10.0
# How long a rank whose target returned waits for the parent to have read the reports.
RELEASE_SECONDS = 60.0


def _run_rank(target: Callable[..., None], release: Any, *args: Any) -> None:
    """The spawned process: `target(*args)`, then wait (bounded) until the parent read
    every rank's reports, so that the tensors this rank reported can still be fetched."""
    target(*args)
    release.wait(RELEASE_SECONDS)


def run_rank_processes(
    target: Callable[..., None],
    args: Sequence[Any],
    world_size: int,
    deadline: float,
    on_report: Callable[[tuple[Any, ...]], None] | None = None,
) -> list[tuple[Any, ...]]:
    """Spawn `world_size` ranks of `target` and return their reports (module docstring).

    Args:
        deadline: seconds the whole group may take, from the first start to the last
            `done`.
        on_report: called with each report other than `done` as it arrives, on the calling
            thread (for tests that act while the ranks run); its exceptions end the group.

    Returns:
        Every report other than `done`, in arrival order.

    Raises:
        pytest.fail: a rank reported an error (its traceback in the message), or the group
            did not finish within `deadline`. Every process is joined, or killed, either way.
    """
    import torch.multiprocessing as multiprocessing  # heavy: only where ranks are spawned

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    release = context.Event()
    port = free_port()
    processes = [
        context.Process(
            target=_run_rank, args=(target, release, rank, world_size, port, results, *args)
        )
        for rank in range(world_size)
    ]
    reports: list[tuple[Any, ...]] = []
    try:
        for process in processes:
            process.start()
        ends_at = time.monotonic() + deadline
        done = 0
        while done < world_size:
            try:
                report = results.get(timeout=max(0.1, ends_at - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the {world_size}-rank group did not finish in {deadline:.0f} s")
            match report[0]:
                case "error":
                    pytest.fail(f"rank {report[-2]} failed:\n{report[-1]}")
                case "done":
                    done += 1
                case _:
                    reports.append(report)
                    if on_report is not None:
                        on_report(report)
    finally:
        release.set()
        for process in processes:
            process.join(timeout=JOIN_SECONDS)
            if process.is_alive():
                process.kill()
                process.join(timeout=JOIN_SECONDS)
    return reports
