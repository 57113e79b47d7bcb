"""The API's view of the cluster: its copy of the state, the commands it sends, and the
chunk streams and command results it waits on.

Every route reaches the rest of the node through one `ClusterClient`: the state and model
cards, the commands (sent exactly once through its `CommandDelivery`,
`command_delivery.py`, which says how), and the chunk stream of each generation it sent,
routed to the instance that runs it and ended with an error chunk when that instance is
deleted, loses a node, or this node stops.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from contextlib import contextmanager

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from exo.api.serving.command_delivery import (
    COMMAND_RESULT_TIMEOUT_SECONDS,
    RESEND_FIRST_SECONDS,
    CommandDelivery,
)
from exo.api.serving.command_outcomes import answer_from_state
from exo.api.serving.load_wait import ReadyTimes
from exo.api.serving.node_stop import NodeStop
from exo.api.serving.request_loading import CommandRejectedError as CommandRejectedError
from exo.api.serving.request_loading import CommandTimeoutError as CommandTimeoutError
from exo.api.serving.request_loading import LoadOnRequest as LoadOnRequest
from exo.api.wire.images import ImagePolicy
from exo.node.election import Election
from exo.shared.models.cards import with_custom_cards
from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, NODE_SHUTTING_DOWN, Chunk, ErrorChunk
from exo.shared.types.commands import (
    CancelGeneration,
    Command,
    DeleteInstance,
    ForwarderCommand,
)
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.events import (
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceUsed,
    StateSnapshot,
    TaskCreated,
    TaskStatusUpdated,
)
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadStatus
from exo.shared.types.runners import KVCacheUse
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskCancelled, TaskComplete, TaskFailed
from exo.utils.channels import Publisher, Subscription

LOST_NODE_CHECK_SECONDS = 0.5
NODE_REPORTS_TIMEOUT_SECONDS = 30.0
NODE_REPORTS_CHECK_SECONDS = 0.5
CATCH_UP_WAIT_SECONDS = 15.0
"""How long a request naming a model or instance this node does not know waits for the
node to catch up with the master's history (a node that just joined, restarted or healed
from a split) before it is answered as unknown (404). Bounded so an unknown name on a
node that cannot catch up (no master) still gets its answer."""
CATCH_UP_CHECK_SECONDS = 0.1


class ClusterClient:
    """Everything the HTTP routes need from the rest of the node.

    Args:
        resend_first_seconds: an unanswered command is sent again after this long, then
            after twice as long each time, up to `RESEND_MAX_SECONDS`.
        clock: monotonic seconds.
        trust_remote_code: `POST /models/add` accepts repositories whose config asks for
            custom code (`--trust-remote-code`); the engine still runs only its families.
        image_policy: this node's limits on image input and image URL fetching
            (`--image-*`, `exo.api.wire.images`).
        caught_up: whether this node holds the elected master's history up to the
            event the master last announced (`Replica.caught_up`).
        storage_problem: why this node cannot write the cluster history now (its data
            directory's disk is full: `DiskSpace.problem`), else None; `submit` then
            refuses every command with a 503.
    """

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
        resend_first_seconds: float = RESEND_FIRST_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        load_on_request: LoadOnRequest | None = None,
        record_download: Callable[[ModelId, DownloadStatus], None] | None = None,
        trust_remote_code: bool = False,
        local_kv_cache: Callable[[], list[KVCacheUse]] = list,
        image_policy: ImagePolicy | None = None,
        caught_up: Callable[[], bool] = lambda: True,
        storage_problem: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.node_id = node_id
        self._caught_up = caught_up
        self.load_on_request = load_on_request or LoadOnRequest()
        self._record_download = record_download
        self.local_kv_cache = local_kv_cache  # this node's runners' KV use (`/metrics`)
        # Placements on request in progress, by model: concurrent requests wait for one.
        self.placing: dict[ModelId, anyio.Event] = {}
        self._current_state = current_state
        self.catalog = cards
        self.trust_remote_code = trust_remote_code
        self.image_policy = image_policy or ImagePolicy()
        self._applied_events = applied_events
        self._election = election
        self.current_peers = current_peers
        self._chunks = chunk_subscription
        self._chunk_streams: dict[CommandId, MemoryObjectSendStream[Chunk]] = {}
        self.stop = NodeStop()
        """Begun by `end_streams`: every wait of a request before its chunk stream races
        it (`NodeStop.unless_stopping`)."""
        self.commands = CommandDelivery(
            node_id,
            current_state,
            command_publisher,
            election,
            resend_first_seconds,
            clock,
            storage_problem,
            self.stop,
        )
        """Sends this node's commands to the master exactly once (`command_delivery.py`)."""
        self._command_instance: dict[CommandId, InstanceId] = {}
        # The instance each request with a chunk stream was sent to (kept after a loss).
        self._routed: dict[CommandId, InstanceId] = {}
        # Its placement then (nodes and runners): the instance may be placed again under
        # the same id, which is another placement for a failover (`routed_placement`).
        self._routed_placements: dict[CommandId, Instance] = {}
        # Set when a request's instance becomes known, to wake `_watch_lost_nodes`.
        self._request_routed = anyio.Event()
        self._task_commands: dict[TaskId, CommandId] = {}
        self.generation_aliases: dict[CommandId, CommandId] = {}
        """Generations sent again after their instance was lost: the command their client
        knows (its response id names it) -> the command running now (`/v1/cancel`)."""
        self.waiting_generations: dict[CommandId, anyio.Event] = {}
        """Generations waiting for a re-placed instance before being sent (not yet tasks):
        the command their client knows -> the event `/v1/cancel` sets to end the wait
        (`replacement_wait.submit_when_served`)."""
        self.state_changed = anyio.Event()
        self.ready_times = ReadyTimes()
        """When this node saw each instance become ready: how long a request waited for
        its model to load (`load_wait`, Ollama's `load_duration`)."""

    @property
    def state(self) -> State:
        return self._current_state()

    @property
    def cards(self) -> Mapping[ModelId, ModelCard]:
        """Every model the cluster knows: the catalog, then the custom models of the state."""
        return with_custom_cards(self.catalog, self.state.custom_cards)

    @property
    def master(self) -> NodeId | None:
        return self.commands.master

    async def run(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._event_loop)
            task_group.start_soon(self._chunk_loop)
            if self._election is not None:  # networked: peers are known
                task_group.start_soon(self._watch_lost_nodes)
            task_group.start_soon(self.commands.run)

    async def _event_loop(self) -> None:
        async for indexed_event in self._applied_events:
            self._on_event(indexed_event.event)
            self.ready_times.observe(self.state, time.monotonic_ns())
            self.commands.forget_answered_cancels()
            self.state_changed.set()
            self.state_changed = anyio.Event()

    def _on_event(self, event: Event) -> None:
        command_id: CommandId | None = None
        match event:
            case StateSnapshot(state=snapshot_state):
                self._answer_from_snapshot(snapshot_state)
                return
            case CommandRejected() if event.origin != self.node_id:
                return
            case InstanceCreated() | InstanceDeleted() | InstanceUsed() | CommandRejected():
                command_id = event.command_id
            case CustomModelAdded() | CustomModelDeleted() | DownloadControlled():
                command_id = event.command_id
            case TaskCreated(task=task):
                command_id = task.command_id
                if task.command_id in self._chunk_streams:
                    self._command_instance[task.command_id] = task.instance_id
                    self._routed[task.command_id] = task.instance_id
                    placement = self.state.instances.get(task.instance_id)
                    if placement is not None:
                        self._routed_placements[task.command_id] = placement
                    self._request_routed.set()
                    self._task_commands[task.task_id] = task.command_id
                    # Sent to an instance that lost a node since: no chunk will come.
                    self._end_streams_of_lost_instances()
            case TaskStatusUpdated(task_id=task_id, status=TaskFailed(error_message=message)):
                # Normally the runner's error chunk came first; this ends streams whose
                # runner could not say so (the node restarted or left, the task was
                # dropped). A lost instance's requests may be sent again elsewhere.
                failed_command = self._task_commands.pop(task_id, None)
                instance_id = self._command_instance.get(failed_command) if failed_command else None
                if instance_id is not None and instance_id in self.state.unavailable_instances:
                    self._end_stream(failed_command, message, INSTANCE_UNAVAILABLE)
                else:
                    self._end_stream(failed_command, message)
                return
            case TaskStatusUpdated(task_id=task_id, status=TaskComplete() | TaskCancelled()):
                self._task_commands.pop(task_id, None)
                return
            case _:
                pass
        if isinstance(event, InstanceDeleted):
            self._fail_streams_of_instance(event)
        if command_id is not None:
            self.commands.deliver(command_id, event)

    async def wait_until_caught_up(self, timeout: float = CATCH_UP_WAIT_SECONDS) -> bool:
        """Wait until this node holds the elected master's history (at once when it
        does), at most `timeout` seconds. Returns whether it does."""
        with anyio.move_on_after(timeout):
            while not self._caught_up():
                # Catching up shows in the state or in the master's heartbeat: look again.
                with anyio.move_on_after(CATCH_UP_CHECK_SECONDS):
                    await self.state_changed.wait()
            return True
        return False

    def _answer_from_snapshot(self, state: State) -> None:
        """Answer the commands whose answering events a snapshot stands in for (this node
        fell behind further than the master's log reaches): their outcomes are in it."""
        for command_id, command in self.commands.unanswered_commands().items():
            outcome = state.command_outcomes.get(command_id)
            if outcome is None:
                continue
            event = answer_from_state(command, outcome, state, self.node_id)
            if isinstance(event, TaskCreated) and event.task.task_id not in state.tasks:
                self.commands.deliver(command_id, event)  # finished: no chunk stream to route
            else:
                self._on_event(event)

    def _fail_streams_of_instance(self, deleted: InstanceDeleted) -> None:
        message = "the instance serving this request was deleted"
        if deleted.load_failure is not None:  # its model cannot load: a final 500
            message += f": its runners failed to load the model: {deleted.load_failure.reason}"
        for command_id, stream_instance in list(self._command_instance.items()):
            if stream_instance == deleted.instance_id:
                self._end_stream(command_id, message)

    async def _watch_lost_nodes(self) -> None:
        """A request whose instance runs on a node that left the cluster will never get
        its chunks: end it now (this node's own links say so as soon as the master's).
        With no request waiting for chunks there is nothing to look at until one is."""
        while True:
            if not self._command_instance:
                self._request_routed = anyio.Event()
                await self._request_routed.wait()
            await anyio.sleep(LOST_NODE_CHECK_SECONDS)
            self._end_streams_of_lost_instances()

    def _end_streams_of_lost_instances(self) -> None:
        """End, as sendable again elsewhere, every request of this node whose instance
        uses a node that this node's links or the cluster state say is gone."""
        peers = self.current_peers() if self._election is not None else None
        state = self.state
        for command_id, instance_id in list(self._command_instance.items()):
            instance = state.instances.get(instance_id)
            if instance is None:
                continue
            lost = [
                node
                for node in instance.shard_assignments.node_to_runner
                if node in state.lost_nodes
                or (peers is not None and node != self.node_id and node not in peers)
            ]
            if lost:
                self._end_stream(
                    command_id,
                    f"instance {instance_id} of {instance.model_id} is unavailable: node "
                    f"{lost[0]} left; re-placing",
                    INSTANCE_UNAVAILABLE,
                )
                self._command_instance.pop(command_id, None)

    def _end_stream(
        self, command_id: CommandId | None, message: str, error_code: str | None = None
    ) -> None:
        """End the stream of `command_id` with an error chunk: a 500, or a 503 with
        `error_code` (`INSTANCE_UNAVAILABLE`: its instance lost a node, and the generation
        may be sent again elsewhere; `NODE_SHUTTING_DOWN`)."""
        stream = self._chunk_streams.get(command_id) if command_id is not None else None
        if stream is None or command_id is None:
            return
        stream.send_nowait(
            ErrorChunk(
                command_id=command_id,
                model=ModelId("unknown"),
                error_message=message,
                status_code=503 if error_code is not None else 500,
                error_code=error_code,
            )
        )

    def end_streams(self, message: str) -> None:
        """The node is stopping: end every open chunk stream, and every one opened from now
        on, with a 503 `NODE_SHUTTING_DOWN` error chunk saying `message` (each dialect shows
        it in band, as any error mid-stream), and cancel those generations on the cluster:
        their clients leave with this node. Requests that have no chunk stream yet (a model
        loading on request, a place in the admission queue, a command awaiting its
        outcome) end too: this begins the node's `stop`, which their waits race."""
        self.stop.begin(message)
        for command_id in list(self._chunk_streams):
            self._end_stream(command_id, message, NODE_SHUTTING_DOWN)
            self.send_and_forget(
                CancelGeneration(command_id=CommandId.new(), target_command_id=command_id)
            )

    async def _chunk_loop(self) -> None:
        async for chunk in self._chunks:
            stream = self._chunk_streams.get(chunk.command_id)
            if stream is not None:
                stream.send_nowait(chunk)

    async def submit(
        self, command: Command, timeout: float = COMMAND_RESULT_TIMEOUT_SECONDS
    ) -> Event:
        """Send `command` to the master and wait for the event that carries it out
        (`CommandDelivery.submit`, which lists what it raises)."""
        return await self.commands.submit(command, timeout)

    def send_and_forget(self, command: CancelGeneration | DeleteInstance) -> None:
        """Send `command` without waiting for its outcome (`CommandDelivery.send_and_forget`)."""
        self.commands.send_and_forget(command)

    def history_dropped(self, lost: Collection[CommandId]) -> None:
        """This node dropped its history (`CommandDelivery.history_dropped`)."""
        self.commands.history_dropped(lost)

    def record_download(self, model_id: ModelId, status: DownloadStatus) -> None:
        """Tell this node's worker and the cluster state that the API changed the model's
        files on this node (Ollama's pull and delete)."""
        if self._record_download is not None:
            self._record_download(model_id, status)

    def routed_placement(self, command_id: CommandId) -> Instance | None:
        """The instance a request this node is streaming was sent to, as it was placed
        then (None before the master routed it), also after that instance was lost:
        placed again, the same id names other nodes and runners."""
        return self._routed_placements.get(command_id)

    def placement_lost_a_node(self, instance: Instance) -> bool:
        """Whether a node of `instance`'s placement is gone, as the cluster state or, before
        the master has marked it, this node's own links say."""
        peers = self.current_peers() if self._election is not None else None
        state = self.state
        return any(
            node in state.lost_nodes
            or (peers is not None and node != self.node_id and node not in peers)
            for node in instance.shard_assignments.node_to_runner
        )

    async def wait_for_node_reports(
        self,
        among: frozenset[NodeId] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Wait until the cluster state holds the resources (memory, ...) of this node and
        of the peers it is connected to (only those in `among`, when given): right after
        start-up a placement would otherwise find no node, or too few, to place on.

        Returns:
            Whether they all reported within `timeout` seconds (default
            `NODE_REPORTS_TIMEOUT_SECONDS`).
        """
        with anyio.move_on_after(NODE_REPORTS_TIMEOUT_SECONDS if timeout is None else timeout):
            while True:
                expected = self.current_peers() | {self.node_id}
                if among is not None:
                    expected &= among
                if expected <= self.state.node_info.keys():
                    return True
                # Peers come and go without a state change: look again now and then.
                with anyio.move_on_after(NODE_REPORTS_CHECK_SECONDS):
                    await self.state_changed.wait()
        return False

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        """Register for the chunks of `command_id` (before submitting it, so none is missed).

        The iterator ends after the chunk that finishes the stream (a finish reason or an
        error)."""
        send, receive = anyio.create_memory_object_stream[Chunk](max_buffer_size=math.inf)
        self._chunk_streams[command_id] = send
        if self.stop.message is not None:
            self._end_stream(command_id, self.stop.message, NODE_SHUTTING_DOWN)
        try:
            yield _until_finished(receive)
        finally:
            self._chunk_streams.pop(command_id, None)
            self._command_instance.pop(command_id, None)
            self._routed.pop(command_id, None)
            self._routed_placements.pop(command_id, None)
            send.close()
            receive.close()


async def _until_finished(receive: MemoryObjectReceiveStream[Chunk]) -> AsyncIterator[Chunk]:
    async for chunk in receive:
        yield chunk
        if chunk.finish_reason is not None:
            return
