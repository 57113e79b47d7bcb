"""The supervisor relays what the runner sends, one pipe message per runner step: the
chunks of every request in a step reach each command's owner in order, streaming never
wakes the worker's planner, and a closed pipe fails whatever was still running."""

from __future__ import annotations

import time
from multiprocessing import Pipe
from typing import Any

import anyio
import pytest

from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk, TokenChunk
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.events import TaskStatusUpdated
from exo.shared.types.tasks import TaskComplete, TaskFailed
from exo.testing.builders import make_shard, make_text_generation_task
from exo.worker.runner.messages import (
    ChunkReport,
    KVCacheReport,
    RunnerOutbound,
    TaskStatusReport,
    encode_outbound,
)
from exo.worker.runner.supervisor import RunnerSupervisor

pytestmark = pytest.mark.anyio

MODEL = ModelId("test/model")
STEPS = 40
NAMES = ("a", "b", "c")


def _token(name: str, number: int, finish: bool = False) -> ChunkReport:
    return ChunkReport(
        chunk=TokenChunk(
            command_id=CommandId(f"command-task-{name}"),
            model=MODEL,
            text=f"{name}{number} ",
            finish_reason="stop" if finish else None,
        )
    )


async def test_each_step_s_chunks_reach_their_owners_in_order() -> None:
    published: list[tuple[NodeId, Chunk]] = []
    events: list[Any] = []
    changes: list[int] = []
    supervisor = RunnerSupervisor(
        node_id=NodeId("node"),
        runner_id=RunnerId("runner-1"),
        instance_id=InstanceId("instance"),
        shard=make_shard(),
        emit_event=events.append,
        publish_chunk=lambda owner, chunk: published.append((owner, chunk)),
        on_change=lambda: changes.append(len(published)),
    )
    read, write = Pipe(duplex=False)
    supervisor._from_runner = read  # what start() sets, without spawning a process
    supervisor._to_runner = Pipe(duplex=False)[1]
    for name in NAMES:
        supervisor.send(
            make_text_generation_task(task_id=f"task-{name}", origin_node_id=f"api-{name}")
        )

    def write_steps() -> None:
        # Every step's output in one pipe message: a piece for each request, "c" finishing
        # half-way; written at once (the supervisor takes what waits in batches).
        for step in range(STEPS):
            write.send_bytes(encode_outbound(step_output(step)))

    def step_output(step: int) -> list[RunnerOutbound]:
        batch: list[RunnerOutbound] = []
        for name in NAMES:
            if name == "c" and step > STEPS // 2:
                continue
            last = (name == "c" and step == STEPS // 2) or step == STEPS - 1
            batch.append(_token(name, step, finish=last and name != "b"))
            if last and name != "b":
                batch.append(
                    TaskStatusReport(task_id=TaskId(f"task-{name}"), status=TaskComplete())
                )
        batch.append(KVCacheReport(running_tokens=step, prefix_cache_tokens=0, budget_tokens=99))
        return batch

    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            await anyio.to_thread.run_sync(write_steps)
            while len(published) < 2 * STEPS + STEPS // 2 + 1:
                await anyio.sleep(0.01)
            write.close()  # "b" never finished: the runner's end fails it
    texts: dict[NodeId, list[str]] = {}
    for owner, chunk in published:
        if isinstance(chunk, TokenChunk):
            texts.setdefault(owner, []).append(chunk.text)
        else:
            assert isinstance(chunk, ErrorChunk)
            # A runner that ended without saying why: its instance cannot serve the
            # request, which the API may continue elsewhere (mid-stream failover).
            assert (chunk.status_code, chunk.error_code) == (503, INSTANCE_UNAVAILABLE)
            texts.setdefault(owner, []).append("error")
    assert texts[NodeId("api-a")] == [f"a{step} " for step in range(STEPS)]
    assert texts[NodeId("api-b")] == [f"b{step} " for step in range(STEPS)] + ["error"]
    assert texts[NodeId("api-c")] == [f"c{step} " for step in range(STEPS // 2 + 1)]
    finals = {
        event.task_id: type(event.status)
        for event in events
        if isinstance(event, TaskStatusUpdated)
    }
    assert finals == {"task-a": TaskComplete, "task-b": TaskFailed, "task-c": TaskComplete}
    assert supervisor.kv_cache is not None and supervisor.kv_cache.running_tokens == STEPS - 1
    # The planner woke for the two ended tasks and the runner's end, never for a chunk or
    # a KV-cache report (it would otherwise plan once per token).
    assert 2 <= len(changes) <= 3


async def test_a_cancelled_relay_stops_relaying() -> None:
    published: list[Chunk] = []
    supervisor = RunnerSupervisor(
        node_id=NodeId("node"),
        runner_id=RunnerId("runner-1"),
        instance_id=InstanceId("instance"),
        shard=make_shard(),
        emit_event=lambda _event: None,
        publish_chunk=lambda _owner, chunk: published.append(chunk),
        on_change=lambda: None,
    )
    read, write = Pipe(duplex=False)
    supervisor._from_runner = read
    supervisor._to_runner = Pipe(duplex=False)[1]
    supervisor.send(make_text_generation_task(task_id="task-a"))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as group:
            group.start_soon(supervisor.run)
            write.send_bytes(encode_outbound([_token("a", 0)]))
            while not published:
                await anyio.sleep(0.01)
            group.cancel_scope.cancel()
    write.send_bytes(encode_outbound([_token("a", 1)]))
    await anyio.sleep(0.2)  # the reader thread reads it; nobody relays it any more
    write.close()
    assert [chunk.text for chunk in published if isinstance(chunk, TokenChunk)] == ["a0 "]


async def test_the_runner_process_starts_with_bounded_kernel_caches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from exo.utils.heap import KERNEL_CACHE_CAPACITY, KERNEL_CACHE_VARIABLES

    for name in KERNEL_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    supervisor = RunnerSupervisor(
        node_id=NodeId("node"),
        runner_id=RunnerId("runner-env"),
        instance_id=InstanceId("instance"),
        shard=make_shard(),
        emit_event=lambda event: None,
        publish_chunk=lambda owner, chunk: None,
        on_change=lambda: None,
    )
    await supervisor.start()
    try:
        assert supervisor.pid is not None
        # Right after the fork, before the exec, /proc shows an empty environment.
        environ: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while "PATH" not in environ and time.monotonic() < deadline:
            with open(f"/proc/{supervisor.pid}/environ", "rb") as environ_file:
                environ = dict(
                    entry.decode().split("=", 1)
                    for entry in environ_file.read().split(b"\0")
                    if b"=" in entry
                )
            await anyio.sleep(0.05)
        for name in KERNEL_CACHE_VARIABLES:
            assert environ.get(name) == str(KERNEL_CACHE_CAPACITY), name
    finally:
        await supervisor.shutdown()
