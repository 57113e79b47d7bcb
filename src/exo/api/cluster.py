"""The API's view of the cluster: its copy of the state, the commands it sends, and the
chunk streams and command results it waits on."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from loguru import logger

from exo.shared.election import Election
from exo.shared.types.chunks import Chunk, ErrorChunk
from exo.shared.types.commands import Command, ForwarderCommand
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.models import ModelCard
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskCancelled, TaskComplete, TaskFailed
from exo.utils.channels import Publisher, Subscription

COMMAND_RESULT_TIMEOUT_SECONDS = 30.0
LOST_NODE_CHECK_SECONDS = 0.5


class CommandRejectedError(Exception):
    def __init__(self, reason: str, status_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


class CommandTimeoutError(Exception):
    pass


class ClusterClient:
    """Everything the HTTP routes need from the rest of the node."""

    def __init__(
        self,
        node_id: NodeId,
        current_state: Callable[[], State],
        applied_events: Subscription[IndexedEvent],
        chunk_subscription: Subscription[Chunk],
        command_publisher: Publisher[ForwarderCommand],
        cards: Mapping[ModelId, ModelCard],
        election: Election | None = None,
        current_peers: Callable[[], frozenset[NodeId]] = frozenset,
    ) -> None:
        self.node_id = node_id
        self._current_state = current_state
        self.cards = cards
        self._applied_events = applied_events
        self._election = election
        self.current_peers = current_peers
        # Commands not yet carried out: held while there is no master, resent to a new one.
        self._unanswered: dict[CommandId, Command] = {}
        self._chunks = chunk_subscription
        self._commands = command_publisher
        self._result_waiters: dict[CommandId, MemoryObjectSendStream[Event]] = {}
        self._chunk_streams: dict[CommandId, MemoryObjectSendStream[Chunk]] = {}
        self._command_instance: dict[CommandId, InstanceId] = {}
        self._task_commands: dict[TaskId, CommandId] = {}
        self.state_changed = anyio.Event()

    @property
    def state(self) -> State:
        return self._current_state()

    @property
    def master(self) -> NodeId | None:
        return self.node_id if self._election is None else self._election.master

    async def run(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._event_loop)
            task_group.start_soon(self._chunk_loop)
            if self._election is not None:  # networked: peers are known
                task_group.start_soon(self._watch_lost_nodes)
            if self._election is not None:
                task_group.start_soon(self._resend_on_new_master, self._election)

    async def _event_loop(self) -> None:
        async for indexed_event in self._applied_events:
            self._on_event(indexed_event.event)
            self.state_changed.set()
            self.state_changed = anyio.Event()

    async def _resend_on_new_master(self, election: Election) -> None:
        while True:
            await election.master_changed.wait()
            if election.master is None:
                continue
            for command in list(self._unanswered.values()):
                logger.info(f"api: resending {command.kind} to the new master {election.master}")
                self._publish(command)

    def _publish(self, command: Command) -> None:
        if self.master is None:
            return  # held: sent when a master is elected
        self._commands.publish(ForwarderCommand(origin=self.node_id, command=command))

    def _on_event(self, event: Event) -> None:
        command_id: CommandId | None = None
        match event:
            case CommandRejected() if event.origin != self.node_id:
                return
            case InstanceCreated() | InstanceDeleted() | CommandRejected():
                command_id = event.command_id
            case TaskCreated(task=task):
                command_id = task.command_id
                if task.command_id in self._chunk_streams:
                    self._command_instance[task.command_id] = task.instance_id
                    self._task_commands[task.task_id] = task.command_id
            case TaskStatusUpdated(task_id=task_id, status=TaskFailed(error_message=message)):
                # Normally the runner's error chunk came first; this ends streams whose
                # runner could not say so (the node restarted, the task was dropped).
                self._end_stream(self._task_commands.pop(task_id, None), message)
                return
            case TaskStatusUpdated(task_id=task_id, status=TaskComplete() | TaskCancelled()):
                self._task_commands.pop(task_id, None)
                return
            case _:
                pass
        if isinstance(event, InstanceDeleted):
            self._fail_streams_of_instance(event.instance_id)
        if command_id is None:
            return
        self._unanswered.pop(command_id, None)
        if command_id in self._result_waiters:
            self._result_waiters.pop(command_id).send_nowait(event)

    def _fail_streams_of_instance(self, instance_id: InstanceId) -> None:
        for command_id, stream_instance in list(self._command_instance.items()):
            if stream_instance == instance_id:
                self._end_stream(command_id, "the instance serving this request was deleted")

    async def _watch_lost_nodes(self) -> None:
        """A request whose instance runs on a node that left the cluster will never get
        its chunks: end it now rather than when the node times out."""
        while True:
            await anyio.sleep(LOST_NODE_CHECK_SECONDS)
            peers = self.current_peers()
            for command_id, instance_id in list(self._command_instance.items()):
                instance = self.state.instances.get(instance_id)
                if instance is None:
                    continue
                lost = [
                    node
                    for node in instance.shard_assignments.node_to_runner
                    if node != self.node_id and node not in peers
                ]
                if lost:
                    self._end_stream(
                        command_id,
                        f"node {lost[0]} running this request left the cluster",
                    )
                    self._command_instance.pop(command_id, None)

    def _end_stream(self, command_id: CommandId | None, message: str) -> None:
        stream = self._chunk_streams.get(command_id) if command_id is not None else None
        if stream is None or command_id is None:
            return
        stream.send_nowait(
            ErrorChunk(command_id=command_id, model=ModelId("unknown"), error_message=message)
        )

    async def _chunk_loop(self) -> None:
        async for chunk in self._chunks:
            stream = self._chunk_streams.get(chunk.command_id)
            if stream is not None:
                stream.send_nowait(chunk)

    async def submit(
        self, command: Command, timeout: float = COMMAND_RESULT_TIMEOUT_SECONDS
    ) -> Event:
        """Send `command` to the master and wait for the event that carries it out.

        Raises:
            CommandRejectedError: the master refused it (with the reason and status code).
            CommandTimeoutError: no answer within `timeout` seconds.
        """
        send, receive = anyio.create_memory_object_stream[Event](1)
        self._result_waiters[command.command_id] = send
        self._unanswered[command.command_id] = command
        self._publish(command)
        try:
            with anyio.fail_after(timeout):
                result = await receive.receive()
        except TimeoutError:
            raise CommandTimeoutError(
                f"the cluster did not answer command {command.kind} within {timeout:.0f}s"
            ) from None
        finally:
            self._result_waiters.pop(command.command_id, None)
            self._unanswered.pop(command.command_id, None)
            receive.close()
        if isinstance(result, CommandRejected):
            raise CommandRejectedError(result.reason, result.status_code)
        return result

    def send_and_forget(self, command: Command) -> None:
        self._publish(command)

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        """Register for the chunks of `command_id` (before submitting it, so none is missed).

        The iterator ends after the chunk that finishes the stream (a finish reason or an
        error)."""
        send, receive = anyio.create_memory_object_stream[Chunk](max_buffer_size=math.inf)
        self._chunk_streams[command_id] = send
        try:
            yield _until_finished(receive)
        finally:
            self._chunk_streams.pop(command_id, None)
            self._command_instance.pop(command_id, None)
            send.close()
            receive.close()


async def _until_finished(receive: MemoryObjectReceiveStream[Chunk]) -> AsyncIterator[Chunk]:
    async for chunk in receive:
        yield chunk
        if chunk.finish_reason is not None:
            return
