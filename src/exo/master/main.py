"""The master: the only writer of cluster history, active on the elected node only."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import anyio
from loguru import logger

from exo.master.decisions import events_for_command
from exo.master.done_commands import DoneCommands
from exo.master.keep_alive import idle_instances, usage_after_command, usage_after_local_event
from exo.master.recovery import (
    ACTIVATION_GRACE_SECONDS,
    connectivity_events,
    events_after_node_removed,
    replacements_for_waiting,
    replacements_nearer_files,
)
from exo.node.data_directory import DataDirectoryFullError
from exo.node.event_log import EventLog, EventLogCorruptError
from exo.routing.connections import ConnectionMessage
from exo.shared.apply import apply, apply_event, origin_key
from exo.shared.types.commands import REPLAY_BATCH, ForwarderCommand, RequestEventReplay
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    Event,
    ForwarderEvent,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceReplaced,
    InstanceUnplaced,
    InstanceUsed,
    NodeLost,
    NodeRejoined,
    NodeTimedOut,
    StateSnapshot,
    TaskCreated,
)
from exo.shared.types.models import ModelCard
from exo.shared.types.runners import RunnerFailed
from exo.shared.types.state import LoadFailure, State
from exo.utils.channels import Publisher, Subscription

NODE_TIMEOUT_SECONDS = 30.0
MAX_INSTANCE_FAILURES = 3


def command_id_of(event: Event) -> CommandId | None:
    """The command an event carried out, for events that carry one out."""
    match event:
        case InstanceCreated() | InstanceDeleted() | InstanceUsed() | CommandRejected():
            return event.command_id
        case CustomModelAdded() | CustomModelDeleted() | DownloadControlled():
            return event.command_id
        case TaskCreated(task=task):
            return task.command_id
        case _:
            return None


def failed_instances(state: State, now: float) -> list[Event]:
    """Instances whose runners failed `MAX_INSTANCE_FAILURES` times without becoming
    ready in between are deleted: retrying further would only keep failing. When a rank's
    last failure is the model's own (`RunnerFailed.permanent`), the deletion says so
    (`InstanceDeleted.load_failure`, stamped `now`: Unix seconds), and requests for the
    model get a final error instead of a 503 (`exo.api.serving.load_on_request`)."""
    deleted: list[Event] = []
    for instance_id, failures in state.instance_failures.items():
        if failures < MAX_INSTANCE_FAILURES or instance_id not in state.instances:
            continue
        runner_ids = state.instances[instance_id].shard_assignments.runner_to_shard
        reason = next(
            (
                status.error_message
                for runner_id in runner_ids
                if isinstance(status := state.runners.get(runner_id), RunnerFailed)
                and status.permanent
            ),
            None,
        )
        failure = None if reason is None else LoadFailure(reason=reason, failed_at=now)
        deleted.append(InstanceDeleted(instance_id=instance_id, load_failure=failure))
    return deleted


class Master:
    """Turns commands and nodes' local events into indexed, persisted, published events.

    Every event gets the next index, is appended (fsynced) to the event log, applied to
    the master's state, then published on the global events topic — in that order, so
    nothing is published that a restart would forget. Only acts while `is_active()`
    (this node won the election); on activation it continues from the highest index
    this node holds.
    """

    def __init__(
        self,
        node_id: NodeId,
        state: State,
        event_log: EventLog,
        command_subscription: Subscription[ForwarderCommand],
        local_event_subscription: Subscription[ForwarderEvent],
        global_event_publisher: Publisher[IndexedEvent],
        cards: Mapping[ModelId, ModelCard],
        is_active: Callable[[], bool] = lambda: True,
        current_state: Callable[[], State] | None = None,
        last_heard: Mapping[NodeId, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        current_peers: Callable[[], frozenset[NodeId]] | None = None,
        connections: Subscription[ConnectionMessage] | None = None,
    ) -> None:
        self.node_id = node_id
        self.state = state
        self._event_log = event_log
        self._commands = command_subscription
        self._local_events = local_event_subscription
        self._global_events = global_event_publisher
        self._cards = cards
        self._is_active = is_active
        self._current_state = current_state
        self._last_heard = last_heard if last_heard is not None else {}
        self._now = clock
        self._wall_clock = wall_clock
        self._active = False
        self._activated_at = 0.0
        self._done_commands = DoneCommands()
        # The nodes this node is linked to, and their joins and leaves: losses are
        # decided from them (`exo.master.recovery`). None: links are not watched.
        self._current_peers = current_peers
        self._connections = connections

    def emit(self, events: Sequence[Event], origin: ForwarderEvent | None = None) -> None:
        """Index, persist, apply and publish `events` (in that order)."""
        if not events:
            return
        first = self.state.last_event_applied_idx + 1
        indexed = [
            IndexedEvent(
                idx=first + i,
                event=event,
                origin=origin.origin if origin else None,
                origin_session=origin.origin_session if origin else None,
                origin_idx=origin.origin_idx if origin else None,
            )
            for i, event in enumerate(events)
        ]
        try:
            try:
                self._event_log.append(indexed)
            except EventLogCorruptError as error:
                # The log lost its place (set aside on start): the state before these
                # events becomes the snapshot the log continues from.
                logger.warning(
                    f"master: {error}; writing a snapshot of the state before event {first}"
                )
                self._event_log.write_snapshot(self.state)
                self._event_log.append(indexed)
        except DataDirectoryFullError:
            # Persisted before published, or not at all (`exo.node.data_directory`; the
            # log said so once): their command stays unanswered until there is room.
            logger.debug(f"master: {len(indexed)} events from {first} dropped: disk full")
            return
        for indexed_event in indexed:
            self.state = apply(self.state, indexed_event)
            command_id = command_id_of(indexed_event.event)
            if command_id is not None:
                self._done_commands.add(command_id)
            self._publish(indexed_event)
            _log_recovery(indexed_event.event)

    def _check_active(self) -> bool:
        active = self._is_active()
        if active and not self._active:
            self._activate()
            self._active = True
            # Nodes lost while there was no master (the old master's own node among them)
            # stop receiving requests before this master routes any.
            self.emit(self.connectivity())
        self._active = active
        return active

    def _activate(self) -> None:
        if self._current_state is not None:
            self.state = self._current_state()
        snapshot = self._event_log.snapshot
        if snapshot is not None and snapshot.idx > self.state.last_event_applied_idx:
            self.state = snapshot.state
        # Events this master emitted before a short election round may not have come back
        # to the node's replica yet; the log holds them, and the next index follows them.
        for indexed_event in self._event_log.events_from(
            self.state.last_event_applied_idx + 1, self._event_log.held
        ):
            self.state = apply(self.state, indexed_event)
        self._activated_at = self._now()
        # Commands answered in the log, and those a snapshot compacted (their outcomes).
        self._done_commands = DoneCommands(
            [*self.state.command_outcomes, *self._event_log.command_ids()]
        )
        logger.info(f"master: active from event {self.state.last_event_applied_idx + 1}")
        if self.state.last_event_applied_idx < 0:
            self.emit([ClusterHistoryStarted(history_id=uuid.uuid4().hex, master=self.node_id)])

    async def run(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._command_loop)
            task_group.start_soon(self._local_event_loop)
            if self._connections is not None:
                task_group.start_soon(self._connection_loop, self._connections)
            while True:
                if self._check_active():
                    self.emit(self.connectivity())
                    self.emit(replacements_nearer_files(self.state))
                    self.emit(replacements_for_waiting(self.state))
                    self.emit(self.timed_out_nodes())
                    self.emit(idle_instances(self.state, self._wall_clock()))
                await anyio.sleep(1.0)

    def connectivity(self) -> list[Event]:
        """Losses and returns of nodes that the links show now (none when not watched)."""
        if self._current_peers is None:
            return []
        return connectivity_events(
            self.state,
            self.node_id,
            self._current_peers(),
            heard_from=self._last_heard.keys(),
            grace_over=self._now() - self._activated_at >= ACTIVATION_GRACE_SECONDS,
        )

    def timed_out_nodes(self) -> list[Event]:
        """Nodes silent for the timeout are removed (`events_after_node_removed`): one not
        yet lost is first lost, so its instances are placed again rather than dropped, and
        the requests it sent end. Each removal is decided on the state after the ones
        before it: an instance placed again on a node removed later in the same pass is
        placed again once more rather than dropped with that node."""
        now = self._now()
        state = self.state
        events: list[Event] = []
        for node_id in list(state.node_info):
            if node_id == self.node_id:
                continue
            silent = now - max(self._last_heard.get(node_id, 0.0), self._activated_at)
            if silent <= NODE_TIMEOUT_SECONDS:
                continue
            removal = events_after_node_removed(state, node_id)
            events += removal
            for event in removal:
                state = apply_event(state, event)
        return events

    def handle_command(self, forwarded: ForwarderCommand) -> None:
        command = forwarded.command
        if isinstance(command, RequestEventReplay):
            self.replay(command.from_idx)
            return
        if command.command_id in self._done_commands:
            return  # resent after a master change; already carried out
        logger.debug(f"master: command {command!r} from {forwarded.origin}")
        now = self._wall_clock()
        events = events_for_command(self.state, forwarded.origin, command, self._cards, now=now)
        events += usage_after_command(self.state, command, events, now)
        self.emit(events)
        # A keep-alive of 0 set on an idle instance unloads it at once.
        self.emit(idle_instances(self.state, now))

    def replay(self, from_idx: int) -> None:
        """Publish the events from `from_idx` on (`REPLAY_BATCH` at most); when the log
        compacted some of them, the snapshot they ended in goes first."""
        log = self._event_log
        # A node asks from the last event it holds (0 when it holds none): one holding the
        # snapshot's own event gets the snapshot too (it only checks that it agrees).
        if from_idx <= log.base_idx and log.snapshot is not None:
            snapshot = log.snapshot
            self._publish(
                IndexedEvent(
                    idx=snapshot.idx,
                    event=StateSnapshot(
                        state=snapshot.state, last_event_digest=snapshot.last_event_digest
                    ),
                )
            )
        for indexed_event in log.events_from(from_idx, REPLAY_BATCH):
            self._publish(indexed_event)

    def _publish(self, indexed_event: IndexedEvent) -> None:
        """Send a copy stamped with this master's node: nodes that follow another master
        (a healed split's winner, one elected after this one) drop it."""
        self._global_events.publish(indexed_event.model_copy(update={"published_by": self.node_id}))

    def handle_local_event(self, forwarded: ForwarderEvent) -> None:
        key = origin_key(forwarded.origin, forwarded.origin_session)
        expected = self.state.local_event_progress.get(key, -1) + 1
        # Strictly in order: a later event waits for its resent predecessors.
        if forwarded.origin_idx != expected:
            return
        before = self.state
        self.emit([forwarded.event], origin=forwarded)
        now = self._wall_clock()
        self.emit(usage_after_local_event(before, self.state, forwarded.event, now))
        self.emit(failed_instances(self.state, now))
        # An instance with a keep-alive of 0 goes as soon as its last generation ends.
        self.emit(idle_instances(self.state, now))

    async def _command_loop(self) -> None:
        async for forwarded in self._commands:
            if self._check_active():
                self.handle_command(forwarded)

    async def _connection_loop(self, connections: Subscription[ConnectionMessage]) -> None:
        async for _ in connections:
            if self._check_active():
                self.emit(self.connectivity())
                # A node that came back may hold the files of an instance still loading.
                self.emit(replacements_nearer_files(self.state))

    async def _local_event_loop(self) -> None:
        async for forwarded in self._local_events:
            if self._check_active():
                self.handle_local_event(forwarded)


def _log_recovery(event: Event) -> None:
    """One line per node loss, return, removal and re-placement."""
    match event:
        case NodeLost(node_id=node_id):
            logger.warning(f"master: node {node_id} left (link lost)")
        case NodeRejoined(node_id=node_id):
            logger.info(f"master: node {node_id} is back")
        case NodeTimedOut(node_id=node_id):
            logger.warning(
                f"master: node {node_id} removed (silent for {NODE_TIMEOUT_SECONDS:.0f} s)"
            )
        case InstanceReplaced(instance=instance, reason=reason):
            logger.warning(
                f"master: instance {instance.instance_id} ({instance.model_id}): {reason}"
            )
        case InstanceUnplaced(instance_id=instance_id, reason=reason):
            logger.warning(f"master: instance {instance_id}: {reason}")
        case _:
            pass
