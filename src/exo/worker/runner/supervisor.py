"""The runner supervisor: owns one runner subprocess and turns what happens to it into
events and chunks. A runner that dies becomes a value (`RunnerFailed`), and every
request it was serving gets an error chunk instead of hanging."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess

import anyio
from loguru import logger

from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk
from exo.shared.types.common import CommandId, InstanceId, NodeId, RunnerId, TaskId
from exo.shared.types.events import Event, RunnerStatusUpdated, TaskStatusUpdated
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerShutdown,
    RunnerStatus,
)
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.tasks import (
    TERMINAL_TASK_STATUSES,
    CancelTask,
    ConnectToGroup,
    Embedding,
    LoadModel,
    Shutdown,
    StartWarmup,
    TaskFailed,
    TextGeneration,
)
from exo.worker.runner.messages import (
    ChunkReport,
    KVCacheReport,
    RunnerInbound,
    RunnerOutbound,
    RunnerStatusReport,
    TaskStatusReport,
    decode_outbound,
)
from exo.worker.runner.options import RunnerOptions
from exo.worker.runner.process import runner_main
from exo.worker.runner.start_method import runner_context, runner_server_failed, spawn_context

SHUTDOWN_GRACE_SECONDS = 5.0
# Bytes read from a runner's pipe per call, and at most per wake-up of the loop (more
# waits for the next turn of the loop, so that a flood cannot starve it).
READ_CHUNK_BYTES = 1 << 16
READ_BATCH_BYTES = 1 << 20
_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


class RunnerSupervisor:
    """Starts the runner process, relays its messages, and reports its death."""

    def __init__(
        self,
        node_id: NodeId,
        runner_id: RunnerId,
        instance_id: InstanceId,
        shard: ShardMetadata,
        emit_event: Callable[[Event], None],
        publish_chunk: Callable[[NodeId, Chunk], None],
        on_change: Callable[[], None],
        log_level: str = "INFO",
        options: RunnerOptions | None = None,
    ) -> None:
        self.node_id = node_id
        self.runner_id = runner_id
        self.instance_id = instance_id
        self.shard = shard
        self.status: RunnerStatus = RunnerIdle()
        self.in_flight: dict[TaskId, TextGeneration | Embedding] = {}
        self.busy_loading = False
        self.kv_cache: KVCacheReport | None = None  # the runner's last report
        self._emit_event = emit_event
        self._publish_chunk = publish_chunk
        self._on_change = on_change
        self._log_level = log_level
        self._options = options or RunnerOptions()
        self._process: BaseProcess | None = None
        self._to_runner: Connection | None = None
        self._writer: PipeWriter | None = None
        self._from_runner: Connection | None = None
        self._stopping = False
        # Where each running command's chunks go (the node whose API owns it), kept until
        # the runner reports the task's end even if the worker cancelled it earlier.
        self._chunk_owners: dict[CommandId, NodeId] = {}
        self._task_commands: dict[TaskId, CommandId] = {}

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def start(self) -> None:
        """Start the runner process (`start_method.runner_context`: forked from the node's
        runner server, or spawned), on a worker thread: a fork request waits for the
        server, whose imports may still run when the node's first runner is wanted, and the
        event loop must not wait with it. Where the server cannot fork it (the server died,
        or failed in its imports), the runner is spawned instead.

        Raises:
            OSError: the runner process could not be started at all.
        """
        context = runner_context()
        try:
            await self._start_with(context)
        except (OSError, EOFError) as error:
            if context.get_start_method() != "forkserver":
                raise
            logger.warning(
                f"the runner server failed ({error!r}): runner {self.runner_id} and the "
                "node's later runners are spawned"
            )
            runner_server_failed()
            await self._start_with(spawn_context())

    async def _start_with(self, context: ForkServerContext | SpawnContext) -> None:
        runner_inbound_read, runner_inbound_write = context.Pipe(duplex=False)
        runner_outbound_read, runner_outbound_write = context.Pipe(duplex=False)
        process = context.Process(
            target=runner_main,
            args=(
                str(self.runner_id),
                self.shard.model_dump_json(),
                runner_inbound_read,
                runner_outbound_write,
                self._log_level,
                self._options.model_dump_json(),
            ),
            name=f"exo-runner-{self.runner_id}",
            daemon=True,
        )
        # Held before the start, so that a shutdown while it starts still finds it.
        self._process = process
        self._to_runner = runner_inbound_write
        self._from_runner = runner_outbound_read
        try:
            await anyio.to_thread.run_sync(process.start)
        except Exception:  # not started (a cancellation waits until it is: kept, stopped later)
            runner_inbound_write.close()
            runner_outbound_read.close()
            self._process = self._to_runner = self._from_runner = None
            raise
        finally:
            # Close our copies of the child's ends so its death reads as EOF here.
            runner_inbound_read.close()
            runner_outbound_write.close()
        method = context.get_start_method()
        logger.info(f"runner {self.runner_id} started (pid {process.pid}, {method})")

    def send(self, task: RunnerInbound) -> None:
        """Hand a task to the runner, never blocking the event loop (`PipeWriter`). A dead
        runner's failure is reported by `run()`."""
        if self._writer is None:
            assert self._to_runner is not None, "send() before start()"
            self._writer = PipeWriter(self._to_runner.fileno())
        match task:
            case TextGeneration() | Embedding():
                self.in_flight[task.task_id] = task
                self._task_commands[task.task_id] = task.command_id
                self._chunk_owners[task.command_id] = task.origin_node_id
            case ConnectToGroup() | LoadModel() | StartWarmup():
                self.busy_loading = True
            case CancelTask() | Shutdown():
                pass
        try:
            self._writer.write(task.model_dump_json().encode())
        except (BrokenPipeError, OSError) as error:
            logger.warning(f"runner {self.runner_id}: could not send {task.kind}: {error}")

    async def run(self) -> None:
        """Relay the runner's messages until its pipe closes, then report how it ended.

        The event loop itself watches the pipe (`add_reader`, the pipe non-blocking): when
        the runner wrote, everything waiting in the pipe is read and handled in one
        callback, in order. No thread sits in between (a reader thread cost a GIL hand-over
        and a self-pipe wake-up of the loop per runner step, ~0.15 ms of node CPU per
        streamed token on 2 cores), and none is borrowed from AnyIO's shared limiter of 40
        (forty runners holding it, as the long fuzz's throwaway node did, would leave no
        thread for the API's routes).

        Raises:
            pydantic.ValidationError: the runner sent something that is not a runner message.
        """
        assert self._from_runner is not None, "run() before start()"
        loop = asyncio.get_running_loop()
        descriptor = self._from_runner.fileno()
        frames = PipeFrames(descriptor)
        ended = anyio.Event()
        failures: list[Exception] = []

        def relay() -> None:  # on the loop, whenever the pipe has something to read
            batch, closed = frames.read()
            try:
                changed = False
                for raw in batch:
                    for message in decode_outbound(raw):
                        changed = self._handle(message) or changed
                if changed:
                    self._on_change()
            except Exception as error:
                failures.append(error)
                closed = True
            if closed:
                loop.remove_reader(descriptor)
                ended.set()

        loop.add_reader(descriptor, relay)
        try:
            await ended.wait()
        finally:
            loop.remove_reader(descriptor)  # cancelled: nobody relays any more
        if failures:
            raise failures[0]
        await self._on_exit()

    def _handle(self, message: RunnerOutbound) -> bool:
        """Act on one runner message; whether the worker's plan may have changed (a chunk
        or a KV-cache report never changes it, so streaming never wakes the planner)."""
        match message:
            case RunnerStatusReport(status=status):
                self.status = status
                if isinstance(status, RunnerConnected | RunnerLoaded | RunnerReady | RunnerFailed):
                    self.busy_loading = False
                if not isinstance(status, RunnerLoading) or _worth_reporting(status):
                    self._emit_event(
                        RunnerStatusUpdated(
                            runner_id=self.runner_id, node_id=self.node_id, status=status
                        )
                    )
            case TaskStatusReport(task_id=task_id, status=status):
                if isinstance(status, TERMINAL_TASK_STATUSES):
                    self.in_flight.pop(task_id, None)
                    command_id = self._task_commands.pop(task_id, None)
                    if command_id is not None:
                        self._chunk_owners.pop(command_id, None)
                self._emit_event(TaskStatusUpdated(task_id=task_id, status=status))
            case KVCacheReport():
                self.kv_cache = message
                return False  # node-local figures: nothing for the worker to plan
            case ChunkReport(chunk=chunk):
                owner = self._chunk_owners.get(chunk.command_id)
                if owner is not None:
                    self._publish_chunk(owner, chunk)
                return False
        return True

    async def _on_exit(self) -> None:
        process = self._process
        exit_code: int | None = None
        if process is not None:
            await anyio.to_thread.run_sync(process.join, 2.0)
            exit_code = process.exitcode
        crashed = False
        if self._stopping or isinstance(self.status, RunnerShutdown):
            message = "runner shut down"
        elif isinstance(self.status, RunnerFailed):
            message = self.status.error_message  # the runner said why before it ended
        else:
            message = f"runner process exited unexpectedly (exit code {exit_code})"
            logger.error(f"runner {self.runner_id}: {message}")
            crashed = True
        self._fail_in_flight(message, unavailable=crashed)
        if not isinstance(self.status, RunnerShutdown | RunnerFailed):
            status: RunnerStatus = (
                RunnerShutdown() if self._stopping else RunnerFailed(error_message=message)
            )
            self.status = status
            self._emit_event(
                RunnerStatusUpdated(runner_id=self.runner_id, node_id=self.node_id, status=status)
            )
        self.busy_loading = False
        self._on_change()

    def _fail_in_flight(self, message: str, unavailable: bool = False) -> None:
        """End the in-flight tasks' streams and tasks; `unavailable`: the runner died without
        saying why (killed, crashed), so its instance cannot serve them — a 503
        `INSTANCE_UNAVAILABLE` the API may send elsewhere (mid-stream failover included)."""
        for task in list(self.in_flight.values()):
            self._publish_chunk(
                task.origin_node_id,
                ErrorChunk(
                    command_id=task.command_id,
                    model=task.params.model,
                    error_message=message,
                    status_code=503 if unavailable else 500,
                    error_code=INSTANCE_UNAVAILABLE if unavailable else None,
                ),
            )
            self._emit_event(
                TaskStatusUpdated(task_id=task.task_id, status=TaskFailed(error_message=message))
            )
        self.in_flight.clear()

    async def shutdown(self) -> None:
        """Ask the runner to stop; terminate, then kill it if it does not within the grace
        period. Safe to call on a runner that already died."""
        self._stopping = True
        process = self._process
        if process is None or process.pid is None:
            return  # never started
        if process.is_alive():
            self.send(Shutdown(runner_id=self.runner_id))
            with anyio.move_on_after(SHUTDOWN_GRACE_SECONDS, shield=True):
                while process.is_alive():
                    await anyio.sleep(0.05)
        if process.is_alive():
            process.terminate()
            with anyio.move_on_after(2.0, shield=True):
                while process.is_alive():
                    await anyio.sleep(0.05)
        if process.is_alive():
            process.kill()
        process.join(1.0)
        if self._writer is not None:
            self._writer.close()
        if self._to_runner is not None:
            self._to_runner.close()

    def kill_now(self) -> None:
        """Last-resort cleanup for interpreter exit: no waiting, no messages."""
        if self._process is not None and self._process.is_alive():
            self._process.kill()


def _framed(data: bytes) -> bytes:
    """`data` with `multiprocessing.Connection`'s length header (what `recv_bytes` reads)."""
    if len(data) > 0x7FFFFFFF:
        return _LENGTH.pack(-1) + _LONG_LENGTH.pack(len(data)) + data
    return _LENGTH.pack(len(data)) + data


class PipeWriter:
    """Messages to a `multiprocessing` connection's pipe, in its framing, written without
    ever blocking the event loop: what the pipe does not take now waits here, in order,
    and leaves when the loop sees the pipe writable again (`add_writer`). Puts the
    descriptor in non-blocking mode.

    Why: the runner writes its answers with a blocking `send_bytes` and reads its tasks
    only between steps. A blocking write here, while the runner was itself blocked writing
    a large answer (an embedding batch's vectors) into the other full pipe, stopped the
    loop that reads that pipe: node and runner waited on each other for good (each pipe
    holds 64 KiB on Linux). With nothing blocking, the loop keeps reading the runner.

    A caller without a running event loop (a synchronous test) gets a blocking write.
    """

    def __init__(self, descriptor: int) -> None:
        os.set_blocking(descriptor, False)
        self._descriptor = descriptor
        self._pending = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        """Bytes accepted by `write` that the pipe has not taken yet."""
        return len(self._pending)

    def write(self, data: bytes) -> None:
        """Queue one message; as much of it as the pipe takes now is written at once.

        Raises:
            OSError: the pipe is broken (the runner is gone) or closed here.
        """
        if self._closed:
            raise OSError("the runner's pipe is closed")
        frame = _framed(data)
        if self._pending:  # earlier messages still wait: keep the order
            self._pending += frame
            return
        written = self._write_now(frame)
        if written == len(frame):
            return
        self._pending += frame[written:]
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop to wait with: finish the write blocking
            self._write_blocking()
            return
        self._loop = loop
        loop.add_writer(self._descriptor, self._drain)

    def close(self) -> None:
        """Drop what is still waiting and stop watching the pipe (the runner is gone)."""
        self._closed = True
        self._pending.clear()
        self._stop_watching()

    def _write_now(self, data: bytes | bytearray) -> int:
        try:
            return os.write(self._descriptor, data)
        except (BlockingIOError, InterruptedError):
            return 0

    def _write_blocking(self) -> None:
        os.set_blocking(self._descriptor, True)
        try:
            while self._pending:
                del self._pending[: os.write(self._descriptor, self._pending)]
        finally:
            os.set_blocking(self._descriptor, False)

    def _drain(self) -> None:  # on the loop, whenever the pipe can take more
        try:
            written = self._write_now(self._pending)
        except OSError as error:  # the runner is gone: `run()` reports how it ended
            logger.warning(f"could not write to a runner: {error}")
            self._pending.clear()
            written = 0
        del self._pending[:written]
        if not self._pending:
            self._stop_watching()

    def _stop_watching(self) -> None:
        if self._loop is not None:
            self._loop.remove_writer(self._descriptor)
            self._loop = None


class PipeFrames:
    """The messages of a `multiprocessing` connection's pipe, read without blocking: each
    is a 4-byte big-endian length (-1, then an 8-byte length, past 2 GiB) and its bytes
    (CPython's `Connection._send_bytes` framing). Puts the descriptor in non-blocking mode.
    """

    def __init__(self, descriptor: int) -> None:
        os.set_blocking(descriptor, False)
        self._descriptor = descriptor
        self._buffer = bytearray()

    def read(self) -> tuple[list[bytes], bool]:
        """The whole messages waiting now (at most ~`READ_BATCH_BYTES` read per call, in
        order), and whether the pipe has closed (the writer is gone, or it failed)."""
        closed = False
        received = 0
        while received < READ_BATCH_BYTES:
            try:
                data = os.read(self._descriptor, READ_CHUNK_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                closed = True
                break
            if not data:
                closed = True
                break
            self._buffer += data
            received += len(data)
            if len(data) < READ_CHUNK_BYTES:
                break  # drained
        return self._messages(), closed

    def _messages(self) -> list[bytes]:
        messages: list[bytes] = []
        buffer = self._buffer
        start = 0
        while True:
            header = 4
            if len(buffer) - start < header:
                break
            (size,) = _LENGTH.unpack_from(buffer, start)
            if size == -1:
                header = 12
                if len(buffer) - start < header:
                    break
                (size,) = _LONG_LENGTH.unpack_from(buffer, start + 4)
            end = start + header + size
            if len(buffer) < end:
                break
            messages.append(bytes(buffer[start + header : end]))
            start = end
        if start:
            del buffer[:start]
        return messages


def _worth_reporting(status: RunnerLoading) -> bool:
    # Loading progress goes into the replicated log: report roughly every tenth.
    step = max(1, status.total_layers // 10)
    return status.layers_loaded % step == 0 or status.layers_loaded == status.total_layers
