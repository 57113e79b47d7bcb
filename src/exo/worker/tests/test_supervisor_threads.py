"""Supervisors reading their runners' pipes do not use AnyIO's shared thread pool: with
more runners than its 40 tokens, the node's other threaded work (API routes) still runs.
Found by the long fuzz, whose throwaway node placed over forty instances and then hung on
every route that runs a thread."""

from __future__ import annotations

from multiprocessing import Pipe
from typing import Any

import anyio
import pytest
from anyio import to_thread

from exo.shared.types.common import InstanceId, NodeId, RunnerId
from exo.testing.builders import make_shard
from exo.worker.runner.supervisor import RunnerSupervisor

RUNNERS = 45  # more than AnyIO's default limiter (40 tokens)

pytestmark = pytest.mark.anyio


def _supervisor(index: int, events: list[Any]) -> tuple[RunnerSupervisor, Any]:
    supervisor = RunnerSupervisor(
        node_id=NodeId("node"),
        runner_id=RunnerId(f"runner-{index}"),
        instance_id=InstanceId("instance"),
        shard=make_shard(),
        emit_event=events.append,
        publish_chunk=lambda _node, _chunk: None,
        on_change=lambda: None,
    )
    read, write = Pipe(duplex=False)
    supervisor._from_runner = read  # what start() sets, without spawning a process
    return supervisor, write


async def test_supervisors_leave_the_default_thread_pool_free() -> None:
    events: list[Any] = []
    pairs = [_supervisor(i, events) for i in range(RUNNERS)]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for supervisor, _ in pairs:
                group.start_soon(supervisor.run)
            await anyio.sleep(0.5)  # every supervisor now waits on its pipe
            assert to_thread.current_default_thread_limiter().borrowed_tokens == 0
            assert await to_thread.run_sync(lambda: "a route's thread ran") == (
                "a route's thread ran"
            )
            for _, write in pairs:
                write.close()  # each runner's pipe closes: its supervisor reports and ends
    assert len(events) == RUNNERS
