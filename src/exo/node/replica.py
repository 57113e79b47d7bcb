"""The node's replica of the cluster history: indexed events applied in order.

Events from the master can arrive out of order, twice, or not at all (a node that joins
late, a message lost during a master change). The replica buffers what is ahead, asks
the master to replay a gap, persists each event to the node's own log (so any node can
become master and continue from the highest index it holds), and tells the node's
components after each applied event. A master that compacted the events a node lacks
sends a `StateSnapshot` first; the replica takes it as its state and snapshot, and
compacts its own log past the same thresholds (`exo.node.event_log`).

When this node drops its history for the cluster's (a healed split whose other side won
the election), it reports each instance it still runs (`InstanceReported`) after
re-sending its own events, so the winner's history keeps what still exists.

Only the master this node's election follows is listened to: every copy a master
publishes names it (`IndexedEvent.published_by`), and others' copies are dropped. When a
split heals, both masters act until the new round reaches them, and a node that took the
other side's events or snapshot into its state (its log and its own master keeping their
history) never converged again. A newly followed master's events are applied only once
its history is known to continue this node's, compared at this node's last event.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import anyio
from loguru import logger

from exo.node.data_directory import DataDirectoryFullError
from exo.node.election import Election, ElectionMessage
from exo.node.event_log import EventLog, EventLogCorruptError, event_digest
from exo.shared.apply import apply, command_outcome, origin_key
from exo.shared.local_events import LocalEventSender
from exo.shared.types.commands import REPLAY_BATCH, Command, RequestEventReplay
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import Event, IndexedEvent, InstanceReported, StateSnapshot
from exo.shared.types.state import CommandOutcome, State
from exo.utils.channels import Subscription, Topic

REPLAY_RETRY_SECONDS = 1.0
# Events the master's own node applies from its log per check when it missed their copies.
OWN_LOG_BATCH = 500
CHECK_INTERVAL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class DroppedHistory:
    """What a dropped history answered: the commands its state recorded (the latest
    `MAX_COMMAND_OUTCOMES`) and the digests of the events that answered them, where the
    log still held those events."""

    outcomes: dict[CommandId, CommandOutcome]
    digests: dict[int, str]

    def lost_in(self, kept: State, kept_log: EventLog) -> list[CommandId]:
        """The commands this history carried out that the kept history lacks: neither
        answered there (its outcomes, its log) nor answered by the same event at the same
        index (the two histories' common part). Rejections are left out."""
        answered = set(kept.command_outcomes)
        for indexed_event in kept_log.events:
            if (answer := command_outcome(indexed_event)) is not None:
                answered.add(answer[0])
        lost: list[CommandId] = []
        for command_id, outcome in self.outcomes.items():
            if command_id in answered or outcome.kind == "CommandRejected":
                continue
            digest = self.digests.get(outcome.event_idx)
            if digest is not None and digest == kept_log.digest_at(outcome.event_idx):
                continue
            lost.append(command_id)
        return lost


class Replica:
    """This node's copy of the cluster history (module docstring).

    Args:
        history_dropped: called once this node, having given up (part of) its history
            for the master's (a reset, or a snapshot that skips past what it held), holds
            the master's: with the commands the dropped part carried out that the kept
            history lacks. The API sends those it was answered for again
            (`ClusterClient.history_dropped`).
    """

    def __init__(
        self,
        node_id: NodeId,
        state: State,
        event_log: EventLog,
        global_events: Subscription[IndexedEvent],
        send_command: Callable[[Command], None],
        election: Election,
        local_events: LocalEventSender,
        clock: Callable[[], float] = time.monotonic,
        history_dropped: Callable[[Collection[CommandId]], None] = lambda lost: None,
    ) -> None:
        self.node_id = node_id
        self._history_dropped = history_dropped
        self.state = state
        self.applied: Topic[IndexedEvent] = Topic("applied_events")
        """Every event this node applied, in index order (in-process)."""
        self.changed = anyio.Event()
        self._event_log = event_log
        self._global_events = global_events
        self._send_command = send_command
        self._election = election
        self._local_events = local_events
        self._now = clock
        self._ahead: dict[int, IndexedEvent] = {}
        self._replay_requested_at = -1.0e9
        self._replay_requested_from = -1
        self._applied_at = -1.0e9  # when an event was last applied (a replay's progress)
        self._following: NodeId | None = None
        """The master whose copies this node applies (the one its election follows)."""
        self._continues_master = False
        """Whether `_following`'s history is known to continue this node's: compared at
        this node's last event (a replay's first event, a snapshot, or the master's
        election message), or this node holds no history. Until then events are kept
        aside, not applied: a node on a healed split's losing side holds a fork whose
        last index the winner's next live event may happen to follow."""
        self._dropped: list[DroppedHistory] = []
        """Histories dropped since this node last held the master's (`check`)."""
        self.resyncing = False
        """From a reset (this node dropped its history) until it holds the master's again:
        the worker keeps its runners as they are meanwhile."""

    def receive(self, indexed_event: IndexedEvent) -> None:
        """Apply an event (or snapshot) the master this node follows sent, in index order.

        A copy another master sent is dropped: while a healed split's two masters both
        still act, or a deposed master's last events are in flight, its events would
        fork this node's state from its log (the state then never converged with the
        cluster's). What the followed master holds and this node lacks is replayed.
        """
        master = self._election.master
        if master is None or indexed_event.published_by != master:
            return
        self._follow(master)
        indexed_event = indexed_event.model_copy(update={"published_by": None})
        if isinstance(indexed_event.event, StateSnapshot):
            self._install(indexed_event.idx, indexed_event.event)
            return
        if indexed_event.idx <= self.state.last_event_applied_idx:
            # Replays overlap what we hold by one event: a different event there means
            # this node's history forked (it ran as a lone master) and must start over.
            mine = self._event_log.digest_at(indexed_event.idx)
            if mine is not None and mine != event_digest(indexed_event):
                self._reset(f"this node's event {indexed_event.idx} differs from the master's")
            else:
                if indexed_event.idx == self.state.last_event_applied_idx:
                    self._continues_master = True
                self._apply_ahead()
                return
        self._ahead[indexed_event.idx] = indexed_event
        self._apply_ahead()

    def _follow(self, master: NodeId) -> None:
        """Note the master this node follows; a new one's history is not known to
        continue this node's until they are compared at this node's last event."""
        if master == self._following:
            return
        self._following = master
        self._ahead.clear()
        self._continues_master = master == self.node_id or self.state.last_event_applied_idx < 0

    def _apply_ahead(self) -> None:
        """Apply the buffered events that continue the state, once the master's history is
        known to continue this node's; ask for a replay while a gap (or that check) remains."""
        applied_any = False
        while self._continues_master and (next_idx := self.state.last_event_applied_idx + 1) in (
            self._ahead
        ):
            event = self._ahead.pop(next_idx)
            self.state = apply(self.state, event)
            self._persist(event)
            self._local_events.acknowledge(event)
            self.applied.publish(event)
            applied_any = True
        if applied_any:
            self._applied_at = self._now()
            with contextlib.suppress(DataDirectoryFullError):  # compacted once there is room
                self._event_log.maybe_compact(self.state)
            self._notify()
        if self._ahead:
            self._request_replay()

    def _persist(self, event: IndexedEvent) -> None:
        """Write `event` to the node's log. On a full disk the state goes on in memory
        (`exo.node.data_directory`): the master holds the event, and the next append
        after a gap writes a snapshot of the state first (below)."""
        try:
            try:
                self._event_log.append([event])
            except EventLogCorruptError as error:
                # The log lost its place (set aside on start, reset, or a disk that was
                # full): the state is right, so it becomes the snapshot it continues from.
                logger.warning(f"replica: {error}; writing a snapshot at event {event.idx}")
                self._event_log.write_snapshot(self.state, event_digest(event))
        except DataDirectoryFullError:
            pass  # the event log said so, once

    def _install(self, idx: int, snapshot: StateSnapshot) -> None:
        """Take the master's snapshot of the state after event `idx`, unless this node
        already holds that event (then only check that it is the same one)."""
        if snapshot.state.last_event_applied_idx != idx:
            logger.warning(f"replica: ignoring a snapshot labelled {idx} that is not at {idx}")
            return
        if idx <= self.state.last_event_applied_idx:
            mine = self._event_log.digest_at(idx)
            if mine is None or snapshot.last_event_digest in (None, mine):
                if idx == self.state.last_event_applied_idx:
                    self._continues_master = True
                    self._apply_ahead()
                return
            self._reset(f"this node's event {idx} differs from the master's snapshot")
        logger.info(f"replica: took the master's snapshot at event {idx}")
        before = self.state
        dropping = self._record_dropped(before)
        key = origin_key(self.node_id, self._local_events.session)
        self.state = snapshot.state
        with contextlib.suppress(DataDirectoryFullError):  # the state goes on in memory
            self._event_log.write_snapshot(self.state, snapshot.last_event_digest)
        missing = [
            report
            for report in self.instance_reports(before)
            if report.instance.instance_id not in self.state.instances
        ]
        regressed = before.local_event_progress.get(key, -1) > self.state.local_event_progress.get(
            key, -1
        )
        if missing or regressed:
            # The snapshot skips past what this node held, so its events cannot be
            # compared: this node may have been on the other side of a split. What it
            # still runs is reported, and its own events sent again under a new session
            # (the master would wait forever for the ones only the other side indexed).
            logger.warning(
                f"replica: the master's snapshot at event {idx} lacks {len(missing)} "
                "instances this node runs; reporting them and sending this node's events again"
            )
            self.resyncing = True
            self._local_events.restart_session(then=missing)
            self._dropped.append(dropping)
        elif (progress := self.state.local_event_progress.get(key)) is not None:
            self._local_events.acknowledge_through(progress)
        for stale in [i for i in self._ahead if i <= idx]:
            del self._ahead[stale]
        # The state is now the master's own.
        self._continues_master = True
        self.applied.publish(IndexedEvent(idx=idx, event=snapshot))
        self._notify()
        self._apply_ahead()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def behind_master(self) -> bool:
        master = self._election.master_message
        return master is not None and master.last_event_idx > self.state.last_event_applied_idx

    def caught_up(self) -> bool:
        """Whether this node holds the elected master's history up to the event the
        master last announced (same history, same event there). Before that, its state
        may still hold what the cluster has since undone (a node restarting from its log)."""
        master = self._election.master_message
        if self._election.master is None or master is None:
            return False
        if master.node_id == self.node_id:
            return True
        if master.history_id is not None and master.history_id != self.state.history_id:
            return False
        if self.state.last_event_applied_idx < master.last_event_idx:
            return False
        if master.last_event_digest is None or master.last_event_idx < 0:
            return True
        return self._event_log.digest_at(master.last_event_idx) == master.last_event_digest

    def check(self) -> None:
        """Start over on another history; ask for what the master has and we lack."""
        if self.resyncing and self.caught_up():
            self.resyncing = False
            if self._dropped:
                lost = {
                    command_id
                    for dropped in self._dropped
                    for command_id in dropped.lost_in(self.state, self._event_log)
                }
                self._dropped = []
                self._history_dropped(lost)
            self._notify()
        master = self._election.master_message
        if master is None or self._election.master is None:
            return
        self._follow(self._election.master)
        if master.node_id == self.node_id:
            # Copies this node's master sent during an election round were dropped; its
            # log (the master's own history) holds them.
            first = self.state.last_event_applied_idx + 1
            for indexed_event in self._event_log.events_from(first, OWN_LOG_BATCH):
                self._ahead.setdefault(indexed_event.idx, indexed_event)
            self._apply_ahead()
            return
        if (
            master.history_id is not None
            and self.state.history_id is not None
            and master.history_id != self.state.history_id
        ):
            self._reset(f"this node's history {self.state.history_id} is not the cluster's")
        elif self._diverged_from(master):
            self._reset(
                f"this node's event {master.last_event_idx} differs from the master's "
                "(the cluster was split and this side's events were not kept)"
            )
        elif (
            not self._continues_master
            and master.last_event_idx == self.state.last_event_applied_idx
            and master.last_event_digest is not None
            and master.last_event_digest == self.last_event_digest()
        ):
            self._continues_master = True
            self._apply_ahead()
        if self._ahead or self.behind_master() or not self._continues_master:
            self._request_replay()

    def _diverged_from(self, master: ElectionMessage) -> bool:
        if master.last_event_digest is None or master.last_event_idx < 0:
            return False
        mine = self._event_log.digest_at(master.last_event_idx)
        return mine is not None and mine != master.last_event_digest

    def last_event_digest(self) -> str | None:
        return self._event_log.digest_at(self.state.last_event_applied_idx)

    def _record_dropped(self, state: State) -> DroppedHistory:
        """What `state` (this node's history, with its log) answered, before it goes."""
        digests = {
            outcome.event_idx: digest
            for outcome in state.command_outcomes.values()
            if (digest := self._event_log.digest_at(outcome.event_idx)) is not None
        }
        return DroppedHistory(outcomes=dict(state.command_outcomes), digests=digests)

    def _reset(self, reason: str) -> None:
        reports: list[Event] = list(self.instance_reports(self.state))
        self._dropped.append(self._record_dropped(self.state))
        archive = self._event_log.reset()
        logger.warning(
            f"{reason}; starting over from the master's history (old log kept at {archive}); "
            f"reporting the {len(reports)} instances this node runs"
        )
        self.state = State()
        self._ahead.clear()
        self._continues_master = True
        self.resyncing = True
        # Our events indexed in the discarded history never reached the cluster's; the
        # instances this node runs are reported after them so the cluster keeps them.
        self._local_events.restart_session(then=reports)
        self._replay_requested_at = -1.0e9
        self._replay_requested_from = -1
        self._notify()

    def instance_reports(self, state: State) -> list[InstanceReported]:
        """An `InstanceReported` for each instance of `state` with a runner on this node,
        carrying the statuses of all the instance's runners."""
        reports: list[InstanceReported] = []
        for instance in state.instances.values():
            assignments = instance.shard_assignments
            if self.node_id not in assignments.node_to_runner:
                continue
            runners = {
                runner_id: state.runners[runner_id]
                for runner_id in assignments.runner_to_shard
                if runner_id in state.runners
            }
            usage = state.instance_usage.get(instance.instance_id)
            reports.append(
                InstanceReported(
                    node_id=self.node_id, instance=instance, runners=runners, usage=usage
                )
            )
        return reports

    def _request_replay(self) -> None:
        """Ask the master to replay from the last event this node holds, unless the last
        request is still being answered: its batch (`REPLAY_BATCH` events from where it
        asked) not yet applied and an event applied, or the request sent, within
        `REPLAY_RETRY_SECONDS`. (Asking again after each applied event made a joining node
        ask once per event, the master resend up to a batch each time: minutes to catch up
        with a long history.)"""
        # From the last event we hold (not the next), so the reply proves we agree on it.
        from_idx = max(0, self.state.last_event_applied_idx)
        now = self._now()
        asked = self._replay_requested_from  # -1: nothing asked since the last reset
        answered = not 0 <= asked <= from_idx < asked + REPLAY_BATCH - 1
        stalled = now - max(self._replay_requested_at, self._applied_at) >= REPLAY_RETRY_SECONDS
        if not answered and not stalled:
            return
        if self._election.master is None:
            return
        self._replay_requested_at = now
        self._replay_requested_from = from_idx
        logger.debug(f"replica: asking the master to replay events from {from_idx}")
        self._send_command(RequestEventReplay(command_id=CommandId.new(), from_idx=from_idx))

    async def run(self) -> None:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(self._receive_loop)
            while True:
                self.check()
                await anyio.sleep(CHECK_INTERVAL_SECONDS)

    async def _receive_loop(self) -> None:
        async for indexed_event in self._global_events:
            self.receive(indexed_event)
