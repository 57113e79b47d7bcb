"""A full data directory (`exo.node.data_directory`): the event log keeps nothing of a write
that ran out of space and goes on once there is room; the master drops the events it could
not persist instead of crashing the node; the API refuses state-changing commands with a
503 naming the directory while it is full. (A new-user trial, 2026-12-07: a full
`EXO_HOME` killed the node with an ExceptionGroup traceback at the first chat.) The full
disk is an injected `OSError(ENOSPC)` at the log's fsync and a free-space reading of 0:
mounting a small tmpfs needs root."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, NoReturn

import anyio
import pytest

from exo.api.serving.command_delivery import DATA_DIRECTORY_FULL
from exo.api.wire.errors import NoCapacityError
from exo.node.data_directory import DataDirectoryFullError, DiskSpace, not_writable_message
from exo.node.event_log import EventLog
from exo.shared.types.commands import PlaceInstance
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import InstanceCreated, NodeTimedOut
from exo.testing.builders import SMOLLM2, indexed
from exo.testing.in_process import NODE, in_process_cluster

DEADLINE_SECONDS = 10
EVENTS = indexed([NodeTimedOut(node_id=NodeId(f"node-{i}")) for i in range(3)])


def no_space(*_arguments: Any) -> NoReturn:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_append_on_a_full_disk_keeps_nothing_and_the_log_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = EventLog(tmp_path / "event_log.jsonl")
    log.append(EVENTS[:1])
    before = log.path.read_bytes()
    with monkeypatch.context() as full:
        full.setattr(os, "fsync", no_space)  # the records reached the file, then failed
        with pytest.raises(DataDirectoryFullError, match=f"data directory {tmp_path} is full"):
            log.append(EVENTS[1:])
    assert log.path.read_bytes() == before, "a torn or unsynced record was left behind"
    assert log.last_idx == 0
    log.append(EVENTS[1:])
    log.close()
    assert EventLog(log.path).read_all() == EVENTS


async def until(condition: Any) -> None:
    with anyio.fail_after(DEADLINE_SECONDS):
        while not condition():
            await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_full_data_directory_refuses_changes_and_the_node_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = [0]
    monkeypatch.setattr(DiskSpace, "free_bytes", lambda _space: free[0])
    async with in_process_cluster(tmp_path) as cluster:
        free[0] = 1 << 30
        cluster.report_node()
        await until(lambda: NODE in cluster.state.node_info)
        place = PlaceInstance(command_id=CommandId("place-1"), model_id=SMOLLM2)
        free[0] = 0
        with pytest.raises(NoCapacityError, match="is full") as refused:
            await cluster.client.submit(place, timeout=DEADLINE_SECONDS)
        assert refused.value.code == DATA_DIRECTORY_FULL
        # Events that reach a master whose log cannot be written are dropped, not
        # published: the state stays, and the master's loop goes on.
        logged = cluster.logged_events()
        state = cluster.master.state
        with monkeypatch.context() as full:
            full.setattr(os, "fsync", no_space)
            cluster.master.emit([NodeTimedOut(node_id=NodeId("node-9"))])
        assert cluster.logged_events() == logged and cluster.master.state == state
        free[0] = 1 << 30  # room again: the same node carries the command out
        answer = await cluster.client.submit(place, timeout=DEADLINE_SECONDS)
        assert isinstance(answer, InstanceCreated)


def test_a_read_only_data_directory_is_named_at_start(tmp_path: Path) -> None:
    error = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "node.lock"))
    message = not_writable_message(error, tmp_path)
    assert message is not None
    assert message.startswith(f"the data directory {tmp_path} is not writable")
    elsewhere = OSError(errno.EACCES, "Permission denied", "/etc/exo-elsewhere")
    assert not_writable_message(elsewhere, tmp_path) is None
    listen = OSError(errno.EADDRINUSE, "Address already in use")
    assert not_writable_message(listen, tmp_path) is None
