"""Exactly-once delivery of the API's commands to the master: sent again until answered,
and again after this node dropped its history.

A command must be carried out exactly once whatever the timing of start-up and elections:
it can be published while no master is elected, before the master's node is linked to
this one, to a node that won the election but has not started acting as master yet, or
to a master that dies before answering. So the delivery keeps every unanswered command
and sends it again — at once to a newly elected master, and with backoff while
unanswered — until the event that carries it out (or rejects it) comes back; the
master ignores a command id its history already holds (`master.main.Master`).

Acknowledged: a command is answered to its client (2xx) only once the event that carries
it out is applied on this node, that is, written (fsynced) to the log of the master this
node follows and to this node's own. Such a command survives any election and split:
either the history the cluster keeps holds that event, or this node drops its history
for the cluster's (a healed split's losing side, a forced master that lacks it), and then
sends again its acknowledged state-changing commands that the cluster's history lacks
(`history_dropped`); the master carries out each command id at most once, so each takes
effect exactly once. Placements come back through the instances the node reports
(`exo.node.replica`), so they are not sent again (they would place a second instance);
generations and embeddings are not state and are not repeated. Bounds: the latest
`ACKNOWLEDGED_KEPT` commands, kept in memory (a node restarted between the answer and the
heal has forgotten them).

`ClusterClient` (`cluster_client.py`) owns one and hands it the events this node applies
(`deliver`); kept apart from the client's chunk streams and request routing, which this
contract does not concern.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from loguru import logger

from exo.api.serving.node_stop import NodeStop
from exo.api.serving.request_loading import CommandRejectedError, CommandTimeoutError
from exo.api.wire.errors import NoCapacityError
from exo.node.election import Election
from exo.shared.types.commands import (
    AddCustomModel,
    CancelGeneration,
    Command,
    ControlDownload,
    DeleteCustomModel,
    DeleteInstance,
    ForwarderCommand,
    SetKeepAlive,
)
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import CommandRejected, Event
from exo.shared.types.state import MAX_COMMAND_OUTCOMES, State
from exo.utils.channels import Publisher

COMMAND_RESULT_TIMEOUT_SECONDS = 30.0
# First resend of an unanswered command after this long, then twice as long each time up
# to the maximum. On loopback a master answers within milliseconds; an election takes
# a few seconds.
RESEND_FIRST_SECONDS = 1.0
RESEND_MAX_SECONDS = 4.0
# A cancel has no event of its own; it is resent until its generation is gone, at most
# this long.
CANCEL_RESEND_SECONDS = 30.0
# The acknowledged commands kept to send again if this node drops its history: as many
# as the state keeps the outcomes of (the master's record of what it carried out).
ACKNOWLEDGED_KEPT = MAX_COMMAND_OUTCOMES
RESENT_AFTER_HISTORY_DROPPED = (
    DeleteInstance,
    SetKeepAlive,
    AddCustomModel,
    DeleteCustomModel,
    ControlDownload,
)

DATA_DIRECTORY_FULL = "data_directory_full"
"""The error code (503) of a request refused because this node's data directory is full
(`CommandDelivery.submit`)."""


@dataclass(slots=True)
class _Unanswered:
    """A command not carried out yet, and when to send it again (monotonic seconds)."""

    command: Command
    first_sent: float
    next_send: float
    interval: float


class CommandDelivery:
    """This node's commands on their way to the master (module docstring).

    Args:
        node_id: this node (the commands' origin; the master when there is no election).
        current_state: the cluster state as this node holds it.
        command_publisher: where commands go to the master.
        election: who the master is (None: a single node, its own master).
        resend_first_seconds: an unanswered command is sent again after this long, then
            after twice as long each time, up to `RESEND_MAX_SECONDS`.
        clock: monotonic seconds.
        storage_problem: why this node cannot write the cluster history now (its data
            directory's disk is full: `DiskSpace.problem`), else None; `submit` then
            refuses every command with a 503.
        stop: the node's stop, which every wait for an outcome races.
    """

    def __init__(
        self,
        node_id: NodeId,
        current_state: Callable[[], State],
        command_publisher: Publisher[ForwarderCommand],
        election: Election | None,
        resend_first_seconds: float,
        clock: Callable[[], float],
        storage_problem: Callable[[], str | None],
        stop: NodeStop,
    ) -> None:
        self.node_id = node_id
        self._current_state = current_state
        self._commands = command_publisher
        self._election = election
        self._resend_first_seconds = resend_first_seconds
        self._now = clock
        self._storage_problem = storage_problem
        self.stop = stop
        # Commands not yet carried out: held while there is no master, resent until answered.
        self._unanswered: dict[CommandId, _Unanswered] = {}
        # State-changing commands carried out and answered, oldest first (module docstring).
        self._acknowledged: dict[CommandId, Command] = {}
        self._result_waiters: dict[CommandId, MemoryObjectSendStream[Event]] = {}
        self._sent_to_master: NodeId | None = None
        self._resend_wake = anyio.Event()

    @property
    def state(self) -> State:
        return self._current_state()

    @property
    def master(self) -> NodeId | None:
        return self.node_id if self._election is None else self._election.master

    def unanswered_commands(self) -> dict[CommandId, Command]:
        """The commands sent and not carried out yet, oldest first (a copy)."""
        return {command_id: item.command for command_id, item in self._unanswered.items()}

    async def run(self) -> None:
        """Send unanswered commands again: all of them at once to a newly elected master,
        each with backoff while it stays unanswered."""
        async with anyio.create_task_group() as task_group:
            if self._election is not None:
                task_group.start_soon(self._wake_on_master_change, self._election)
            while True:
                with anyio.move_on_after(self._seconds_until_next_send()):
                    await self._resend_wake.wait()
                self._resend_wake = anyio.Event()
                self.resend_due()

    async def _wake_on_master_change(self, election: Election) -> None:
        while True:
            await election.master_changed.wait()
            self._resend_wake.set()

    def _seconds_until_next_send(self) -> float:
        if self.master is None or not self._unanswered:
            return math.inf
        earliest = min(unanswered.next_send for unanswered in self._unanswered.values())
        return max(0.0, earliest - self._now())

    def resend_due(self) -> None:
        """Send every unanswered command whose time has come (all of them when the master
        changed since the last send); forget cancels whose generation is gone."""
        master = self.master
        if master is None:
            # Held; whoever wins next (the same node too) gets them all at once: a master
            # that was not active during the round dropped what it was sent then.
            self._sent_to_master = None
            return
        now = self._now()
        new_master = master != self._sent_to_master
        self._sent_to_master = master
        self.forget_answered_cancels()
        for unanswered in list(self._unanswered.values()):
            if not new_master and now < unanswered.next_send:
                continue
            if new_master:
                logger.info(f"api: sending {unanswered.command.kind} to the new master {master}")
            else:
                logger.debug(f"api: no answer to {unanswered.command.kind} yet; sending again")
            self._send(unanswered, now, restart_backoff=new_master)

    def forget_answered_cancels(self) -> None:
        now = self._now()
        for command_id, unanswered in list(self._unanswered.items()):
            if self._answered_without_event(unanswered, now):
                del self._unanswered[command_id]

    def _answered_without_event(self, unanswered: _Unanswered, now: float) -> bool:
        """A cancel is done when its generation has no task (and none can come: the
        generation's own command is answered), or after `CANCEL_RESEND_SECONDS`."""
        match unanswered.command:
            case CancelGeneration(target_command_id=target):
                if now - unanswered.first_sent > CANCEL_RESEND_SECONDS:
                    return True
                return target not in self._unanswered and not any(
                    task.command_id == target for task in self.state.tasks.values()
                )
            case command:
                # Sent without a waiter (again after this node dropped its history, or
                # `send_and_forget`) and carried out in the history this node holds: the
                # state has its outcome, maybe before its event reached this loop.
                if command.command_id in self._result_waiters:
                    return False
                outcome = self.state.command_outcomes.get(command.command_id)
                if outcome is None:
                    return False
                if outcome.kind != "CommandRejected":
                    self._acknowledge(command)
                return True

    def track(self, command: Command) -> None:
        now = self._now()
        unanswered = _Unanswered(
            command=command, first_sent=now, next_send=now, interval=self._resend_first_seconds
        )
        self._unanswered[command.command_id] = unanswered
        self._resend_wake.set()  # its resend may be due before the one the loop waits for
        if self.master is None:
            return  # held: sent when a master is elected
        if self.master != self._sent_to_master:
            self.resend_due()  # a new master the loop has not seen yet: it gets them all
        else:
            self._send(unanswered, now, restart_backoff=True)

    def _send(self, unanswered: _Unanswered, now: float, restart_backoff: bool) -> None:
        if restart_backoff:
            unanswered.interval = self._resend_first_seconds
        unanswered.next_send = now + unanswered.interval
        unanswered.interval = min(unanswered.interval * 2, RESEND_MAX_SECONDS)
        self._commands.publish(ForwarderCommand(origin=self.node_id, command=unanswered.command))

    def deliver(self, command_id: CommandId, event: Event) -> None:
        unanswered = self._unanswered.pop(command_id, None)
        if unanswered is not None and not isinstance(event, CommandRejected):
            self._acknowledge(unanswered.command)
        if command_id in self._result_waiters:
            self._result_waiters.pop(command_id).send_nowait(event)

    def _acknowledge(self, command: Command) -> None:
        if not isinstance(command, RESENT_AFTER_HISTORY_DROPPED):
            return
        self._acknowledged[command.command_id] = command
        while len(self._acknowledged) > ACKNOWLEDGED_KEPT:
            del self._acknowledged[next(iter(self._acknowledged))]

    def history_dropped(self, lost: Collection[CommandId]) -> None:
        """This node dropped its history for the cluster's, which lacks the outcomes of
        the commands `lost`: send those this API was answered for again, until the
        cluster's history holds their outcome (the master carries out each once)."""
        again = [
            command
            for command_id, command in self._acknowledged.items()
            if command_id in lost and command_id not in self._unanswered
        ]
        if not again:
            return
        logger.warning(
            f"api: this node's history was dropped; sending its {len(again)} acknowledged "
            "commands the cluster's history lacks again"
        )
        for command in again:
            self.track(command)

    async def submit(
        self, command: Command, timeout: float = COMMAND_RESULT_TIMEOUT_SECONDS
    ) -> Event:
        """Send `command` to the master and wait for the event that carries it out.

        Raises:
            CommandRejectedError: the master refused it (with the reason and status code).
            CommandTimeoutError: no answer within `timeout` seconds.
            NoCapacityError: the node began shutting down first (`NodeStop.unless_stopping`);
                the command may still be carried out. Or this node's data directory is
                full (`storage_problem`): not sent, its events could not be written.
        """
        if self.stop.begun:
            raise self.stop.error()  # not sent: no one would wait for its outcome
        if (problem := self._storage_problem()) is not None:
            raise NoCapacityError(problem, code=DATA_DIRECTORY_FULL)
        send, receive = anyio.create_memory_object_stream[Event](1)
        self._result_waiters[command.command_id] = send
        self.track(command)

        async def outcome() -> Event:
            with anyio.fail_after(timeout):
                return await receive.receive()

        try:
            result = await self.stop.unless_stopping(outcome)
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

    @property
    def unanswered_command_ids(self) -> list[CommandId]:
        """Commands sent and not carried out yet (sent again until they are)."""
        return list(self._unanswered)

    def send_and_forget(self, command: CancelGeneration | DeleteInstance) -> None:
        """Send `command` without waiting for its outcome; it is still sent again until
        carried out (see `_answered_without_event`)."""
        self.track(command)
