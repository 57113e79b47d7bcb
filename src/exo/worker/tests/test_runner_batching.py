"""A ready runner hands every generation to its engine at once and streams each request's
pieces step by step; a cancel arriving between steps ends only that request, a request the
engine fails alone fails only itself."""

from __future__ import annotations

from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any, cast

from exo.chat_protocol.prompt import RenderedPrompt
from exo.shared.types.chunks import ErrorChunk, TokenChunk, Usage
from exo.shared.types.common import RunnerId, TaskId
from exo.shared.types.runners import RunnerFailed, RunnerReady, RunnerRunning
from exo.shared.types.tasks import CancelTask, TaskCancelled, TaskComplete, TaskFailed
from exo.testing.builders import make_shard, make_text_generation_task
from exo.worker.engines.torch.engine import GeneratedPiece
from exo.worker.engines.torch.engine_requests import RequestHandle
from exo.worker.runner.messages import (
    ChunkReport,
    KVCacheReport,
    RunnerOutbound,
    RunnerStatusReport,
    TaskStatusReport,
    decode_outbound,
)
from exo.worker.runner.runner import Runner


class BatchEngine:
    """Every running request gets one piece per step: "a0", "a1", ... then a final piece
    after `length` pieces; a request named "task-bad" fails at its second step."""

    max_concurrent_requests = 4

    def __init__(self, length: int) -> None:
        self.length = length
        self.running: dict[str, int] = {}
        self.cancelled: list[str] = []

    def render_prompt(self, params: Any) -> RenderedPrompt:
        return RenderedPrompt(
            token_ids=[1, 2, 3], text="", tool_call_format="hermes", thinking_open=False,
            tools_in_template=False,
        )  # fmt: skip

    def submit(self, params: Any, prompt: RenderedPrompt, request_id: str) -> RequestHandle:
        self.running[request_id] = 0
        return RequestHandle(request_id, len(prompt.token_ids))

    def step(self) -> list[tuple[str, GeneratedPiece | Exception]]:
        outputs: list[tuple[str, GeneratedPiece | Exception]] = []
        for request_id, done in list(self.running.items()):
            if request_id == "task-bad" and done == 1:
                del self.running[request_id]
                outputs.append((request_id, RuntimeError("the constraint allows no token")))
                continue
            self.running[request_id] = done + 1
            finished = done + 1 == self.length
            usage = Usage(prompt_tokens=3, completion_tokens=done + 1) if finished else None
            piece = GeneratedPiece(
                f"{request_id[-1]}{done} ", (done,), "length" if finished else None, usage
            )
            outputs.append((request_id, piece))
            if finished:
                del self.running[request_id]
        return outputs

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return self.running.pop(request_id, None) is not None

    def kv_cache_usage(self) -> tuple[int, int, int]:
        # 3 prompt tokens plus one per piece for each running request; no prefix cache.
        return sum(3 + done for done in self.running.values()), 0, 100

    def store_finished(self) -> int:
        return 0  # no prefix cache


def ready_runner(engine: BatchEngine) -> tuple[Runner, Connection, Connection]:
    """A runner serving `engine`, ready; with the pipe end that writes to it and the one
    that reads what it sends."""
    inbound_reader, inbound_writer = Pipe(duplex=False)
    outbound_reader, outbound_writer = Pipe(duplex=False)
    runner = Runner(RunnerId("runner-1"), make_shard(), inbound_reader, outbound_writer)
    runner._engine = cast(Any, engine)
    runner._ready = RunnerReady(max_concurrent_requests=4)
    runner._status = runner._ready
    return runner, inbound_writer, outbound_reader


def test_requests_run_together_and_a_cancel_or_failure_ends_only_its_own() -> None:
    engine = BatchEngine(length=4)
    runner, inbound_writer, outbound_reader = ready_runner(engine)
    tasks = [make_text_generation_task(task_id=f"task-{name}") for name in ("a", "b", "bad")]
    for task in tasks:
        runner._start_generation(task)
    assert set(engine.running) == {"task-a", "task-b", "task-bad"}
    sent: list[RunnerOutbound] = []
    while outbound_reader.poll(0):  # what starting the generations reported, at once
        sent.extend(decode_outbound(outbound_reader.recv_bytes()))

    def one_step() -> list[RunnerOutbound]:
        runner._run_step()
        batch = decode_outbound(outbound_reader.recv_bytes())
        assert not outbound_reader.poll(0), "a step's output leaves as one pipe message"
        sent.extend(batch)
        return batch

    first = one_step()
    assert [message.chunk.command_id for message in first if isinstance(message, ChunkReport)] == [
        "command-task-a",
        "command-task-b",
        "command-task-bad",
    ]
    # A cancel for b arrives between steps; the runner reads it before the next step.
    inbound_writer.send_bytes(
        CancelTask(runner_id=RunnerId("runner-1"), task_id=TaskId("task-b"))
        .model_dump_json()
        .encode()
    )
    for _step in range(6):
        if runner._generations:
            one_step()
    assert not runner._generations and engine.cancelled == ["task-b"]
    texts: dict[str, str] = {}
    finals: dict[str, TaskStatusReport] = {}
    statuses = []
    kv_reports: list[KVCacheReport] = []
    for message in sent:
        if isinstance(message, ChunkReport) and isinstance(message.chunk, TokenChunk):
            key = str(message.chunk.command_id)
            texts[key] = texts.get(key, "") + message.chunk.text
        elif isinstance(message, ChunkReport) and isinstance(message.chunk, ErrorChunk):
            texts[str(message.chunk.command_id)] = "error"
        elif isinstance(message, TaskStatusReport) and message.status.kind != "TaskRunning":
            finals[str(message.task_id)] = message
        elif isinstance(message, RunnerStatusReport):
            statuses.append(message.status)
        elif isinstance(message, KVCacheReport):
            kv_reports.append(message)
    assert texts["command-task-a"] == "a0 a1 a2 a3 "  # every step, to its end
    assert texts["command-task-b"] == "b0 "  # one step, then cancelled
    assert texts["command-task-bad"] == "error"
    assert isinstance(finals["task-a"].status, TaskComplete)
    assert isinstance(finals["task-b"].status, TaskCancelled)
    assert isinstance(finals["task-bad"].status, TaskFailed)
    assert isinstance(statuses[0], RunnerRunning) and statuses[-1] == runner._ready
    assert statuses[0].max_concurrent_requests == 4
    # The KV cache's use reaches the node (/metrics): throttled while it changes, and at
    # once when the batch empties. The first step left a, b and bad at 4 tokens each.
    assert kv_reports[0] == KVCacheReport(
        running_tokens=12, prefix_cache_tokens=0, budget_tokens=100
    )
    assert kv_reports[-1] == KVCacheReport(
        running_tokens=0, prefix_cache_tokens=0, budget_tokens=100
    )


def test_cancelling_the_last_request_reports_the_freed_kv_at_once() -> None:
    """A cancel (a client that hung up) that empties the batch is followed by no step; the
    KV report saying nothing runs goes out with the cancel, not at the next request."""
    engine = BatchEngine(length=50)
    runner, _inbound_writer, outbound_reader = ready_runner(engine)
    runner._start_generation(make_text_generation_task(task_id="task-a"))
    for _step in range(3):  # reports are throttled: the last one says 4 tokens
        runner._run_step()
    while outbound_reader.poll(0):
        outbound_reader.recv_bytes()
    runner._cancel("task-a")
    sent: list[RunnerOutbound] = []
    while outbound_reader.poll(0):
        sent.extend(decode_outbound(outbound_reader.recv_bytes()))
    reports = [message for message in sent if isinstance(message, KVCacheReport)]
    assert reports == [KVCacheReport(running_tokens=0, prefix_cache_tokens=0, budget_tokens=100)]
    assert engine.cancelled == ["task-a"]


class PeerGoneEngine(BatchEngine):
    """Rank 0 of a split instance whose next step finds rank 1 gone (the error of a live
    run where rank 1's node was killed while three requests decoded)."""

    def step(self) -> list[Any]:
        raise ConnectionResetError(
            "rank 0: receiving from rank 1 failed: [Errno 104] Connection reset by peer"
        )


def test_a_broken_group_fails_the_runner_once_however_many_generations_it_held() -> None:
    """Each running generation fails, and the runner reports `RunnerFailed` once: the state
    counts every report as a failure of the instance, and three (a batch of three) reached
    the limit that deletes it before the master placed it again on the remaining node."""
    engine = PeerGoneEngine(length=100)
    runner, _inbound, outbound = ready_runner(engine)
    runner.shard = make_shard(world_size=2)
    for name in ("a", "b", "c"):
        runner._start_generation(make_text_generation_task(task_id=f"task-{name}"))
    runner._run_step()
    sent: list[RunnerOutbound] = []
    while outbound.poll(0):
        sent.extend(decode_outbound(outbound.recv_bytes()))
    failed_tasks = [
        message.task_id
        for message in sent
        if isinstance(message, TaskStatusReport) and isinstance(message.status, TaskFailed)
    ]
    failures = [
        message
        for message in sent
        if isinstance(message, RunnerStatusReport) and isinstance(message.status, RunnerFailed)
    ]
    assert sorted(failed_tasks) == ["task-a", "task-b", "task-c"]
    assert len(failures) == 1, [message.status for message in failures]


class StepFailsOnceEngine(BatchEngine):
    """An engine whose first step raises and, as one that broke its own contract, keeps
    its requests; later steps run."""

    failed = False

    def step(self) -> list[Any]:
        if not self.failed:
            self.failed = True
            raise IndexError("list index out of range")
        return super().step()


def test_a_failed_step_takes_its_requests_out_of_the_engine() -> None:
    """When a step raises, the runner fails every generation and cancels each in the
    engine, so the next request streams alone (a trial's instance answered every later
    request with the first one's 500)."""
    engine = StepFailsOnceEngine(length=2)
    runner, _inbound, outbound = ready_runner(engine)
    runner._start_generation(make_text_generation_task(task_id="task-x"))
    runner._run_step()
    assert engine.cancelled == ["task-x"] and not engine.running
    runner._start_generation(make_text_generation_task(task_id="task-y"))
    while runner._generations:
        runner._run_step()
    sent: list[RunnerOutbound] = []
    while outbound.poll(0):
        sent.extend(decode_outbound(outbound.recv_bytes()))
    finals = {
        str(message.task_id): message.status
        for message in sent
        if isinstance(message, TaskStatusReport) and message.status.kind != "TaskRunning"
    }
    assert isinstance(finals["task-x"], TaskFailed)
    assert isinstance(finals["task-y"], TaskComplete)
    texts = [
        message.chunk.text
        for message in sent
        if isinstance(message, ChunkReport) and isinstance(message.chunk, TokenChunk)
    ]
    assert "".join(texts) == "y0 y1 "
