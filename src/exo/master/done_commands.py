"""The commands a master has carried out, so that one resent to it is not carried out twice,
bounded so that a master serving for months does not keep every command id it ever saw."""

from __future__ import annotations

from collections.abc import Iterable

from exo.node.event_log import SNAPSHOT_EVERY_EVENTS
from exo.shared.types.common import CommandId
from exo.shared.types.state import MAX_COMMAND_OUTCOMES

DONE_COMMANDS_KEPT = MAX_COMMAND_OUTCOMES + SNAPSHOT_EVERY_EVENTS
"""Command ids a master keeps (11,000, ~1.5 MB of ids at ~140 bytes each): as many as a
newly activated master can learn at most, from the state's `command_outcomes` plus the
events its log holds after the snapshot, so an active master never knows fewer answered
commands than one elected in its place would. A command is resent while unanswered (seconds)
or after its node dropped its history (`exo.api.serving.command_delivery`), far fewer than
this many commands later."""


class DoneCommands:
    """Command ids in the order they were carried out, the newest `kept` of them.

    Args:
        command_ids: ids already carried out, oldest first.
        kept: how many ids are kept (default `DONE_COMMANDS_KEPT`); adding one more forgets
            the oldest.

    Raises:
        ValueError: `kept` is below 1.
    """

    def __init__(self, command_ids: Iterable[CommandId] = (), kept: int | None = None) -> None:
        self.kept = DONE_COMMANDS_KEPT if kept is None else kept
        if self.kept < 1:
            raise ValueError(f"kept must be at least 1, not {self.kept}")
        self._ids: dict[CommandId, None] = {}  # insertion-ordered: the oldest first
        for command_id in command_ids:
            self.add(command_id)

    def add(self, command_id: CommandId) -> None:
        """Record `command_id` as carried out, forgetting the oldest beyond `kept`."""
        self._ids[command_id] = None
        while len(self._ids) > self.kept:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, command_id: object) -> bool:
        return command_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
