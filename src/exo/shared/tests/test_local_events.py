"""A node's outgoing local events: numbering, acknowledgement, resending."""

from __future__ import annotations

import gc
import tracemalloc
import uuid

import anyio
import pytest

from exo.shared import local_events
from exo.shared.local_events import RESEND_AFTER_SECONDS, LocalEventSender
from exo.shared.types.common import NodeId, RunnerId, TaskId
from exo.shared.types.events import (
    ForwarderEvent,
    IndexedEvent,
    RunnerDeleted,
    TaskStatusUpdated,
)
from exo.shared.types.tasks import TaskComplete
from exo.utils.channels import Subscription, Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("node-a")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def event(name: str) -> RunnerDeleted:
    return RunnerDeleted(runner_id=RunnerId(name))


def sender_with_outbox(
    node_id: NodeId = NODE,
) -> tuple[LocalEventSender, Subscription[ForwarderEvent], FakeClock]:
    clock = FakeClock()
    topic: Topic[ForwarderEvent] = Topic("local_events")
    outbox = topic.subscribe()
    return LocalEventSender(node_id, topic.sender(), clock=clock), outbox, clock


def drain(outbox: Subscription[ForwarderEvent]) -> list[ForwarderEvent]:
    sent = []
    while True:
        try:
            sent.append(outbox.receive_nowait())
        except anyio.WouldBlock:
            return sent


def indexed_copy(forwarded: ForwarderEvent, idx: int = 0, **override: object) -> IndexedEvent:
    """The indexed event the master makes of `forwarded`, with fields overridden."""
    fields: dict[str, object] = {
        "idx": idx,
        "event": forwarded.event,
        "origin": forwarded.origin,
        "origin_session": forwarded.origin_session,
        "origin_idx": forwarded.origin_idx,
        **override,
    }
    return IndexedEvent.model_validate(fields)


async def test_events_are_numbered_from_zero_in_one_session() -> None:
    sender, outbox, _ = sender_with_outbox()
    for name in ("e0", "e1", "e2"):
        sender.emit(event(name))
    sent = drain(outbox)
    assert [(f.origin, f.origin_idx, f.event) for f in sent] == [
        (NODE, 0, event("e0")),
        (NODE, 1, event("e1")),
        (NODE, 2, event("e2")),
    ]
    assert {f.origin_session for f in sent} == {sender.session}
    assert sender.unacknowledged == 3
    # Another process of the same node counts in a session of its own.
    restarted, _, _ = sender_with_outbox()
    assert restarted.session != sender.session


async def test_nothing_is_resent_before_the_delay() -> None:
    sender, outbox, clock = sender_with_outbox()
    sender.emit(event("e0"))
    drain(outbox)
    clock.now += RESEND_AFTER_SECONDS * 0.9
    assert sender.resend_overdue() == 0
    assert drain(outbox) == []


async def test_all_unacknowledged_events_are_resent_in_order_after_the_delay() -> None:
    sender, outbox, clock = sender_with_outbox()
    sender.emit(event("e0"))
    sender.emit(event("e1"))
    clock.now += RESEND_AFTER_SECONDS * 0.9
    sender.emit(event("e2"))
    first = drain(outbox)
    clock.now += RESEND_AFTER_SECONDS * 0.2
    # e0 and e1 are overdue; e2 is not, but goes with them so the master sees them in order.
    assert sender.resend_overdue() == 3
    assert drain(outbox) == first
    # Resending restarts every event's delay.
    clock.now += RESEND_AFTER_SECONDS * 0.9
    assert sender.resend_overdue() == 0
    clock.now += RESEND_AFTER_SECONDS * 0.2
    assert sender.resend_overdue() == 3
    assert drain(outbox) == first


async def test_acknowledge_removes_every_event_up_to_the_indexed_one() -> None:
    sender, outbox, clock = sender_with_outbox()
    for name in ("e0", "e1", "e2", "e3"):
        sender.emit(event(name))
    sent = drain(outbox)
    sender.acknowledge(indexed_copy(sent[1], idx=7))
    assert sender.unacknowledged == 2
    clock.now += RESEND_AFTER_SECONDS
    assert sender.resend_overdue() == 2
    assert drain(outbox) == sent[2:]
    sender.acknowledge(indexed_copy(sent[3], idx=9))
    assert sender.unacknowledged == 0
    clock.now += RESEND_AFTER_SECONDS
    assert sender.resend_overdue() == 0
    assert drain(outbox) == []


async def test_other_sessions_and_nodes_are_not_acknowledgements() -> None:
    sender, outbox, _ = sender_with_outbox()
    sender.emit(event("e0"))
    [sent] = drain(outbox)
    sender.acknowledge(indexed_copy(sent, origin_session="another-session"))
    sender.acknowledge(indexed_copy(sent, origin=NodeId("node-b")))
    sender.acknowledge(IndexedEvent(idx=0, event=sent.event))
    assert sender.unacknowledged == 1
    sender.acknowledge(indexed_copy(sent))
    assert sender.unacknowledged == 0


async def test_a_new_session_sends_every_event_again_from_zero() -> None:
    sender, outbox, _ = sender_with_outbox()
    for name in ("e0", "e1"):
        sender.emit(event(name))
    first = drain(outbox)
    sender.acknowledge(indexed_copy(first[1], idx=7))  # indexed in a history since dropped
    old_session = sender.session
    sender.restart_session()
    again = drain(outbox)
    assert sender.session != old_session
    assert [(f.origin_session, f.origin_idx, f.event) for f in again] == [
        (sender.session, 0, event("e0")),
        (sender.session, 1, event("e1")),
    ]
    assert sender.unacknowledged == 2


async def test_run_sleeps_while_every_event_is_indexed_and_resends_once_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(local_events, "RESEND_AFTER_SECONDS", 0.02)
    topic: Topic[ForwarderEvent] = Topic("local_events")
    outbox = topic.subscribe()
    sender = LocalEventSender(NODE, topic.sender())
    checks: list[None] = []
    resend_overdue = sender.resend_overdue

    def counting_resend_overdue() -> int:
        checks.append(None)
        return resend_overdue()

    monkeypatch.setattr(sender, "resend_overdue", counting_resend_overdue)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(sender.run)
            await anyio.sleep(0.2)  # ten resend periods with nothing to resend
            assert checks == []
            sender.emit(event("e0"))
            first = await outbox.receive()
            assert await outbox.receive() == first  # resent: nobody indexed it
            sender.acknowledge(indexed_copy(first))
            task_group.cancel_scope.cancel()


async def test_the_events_kept_for_a_new_session_are_held_compactly() -> None:
    """The sender keeps its last `EMITTED_KEPT` events after they are indexed; as event
    objects a task's status update held ~1.2 KB, ~12 MB for a full deque. As JSON, ~150."""
    sender, outbox, _ = sender_with_outbox()
    sender.emit(event("first"))  # whatever the first emit builds once
    sender.acknowledge(indexed_copy(drain(outbox)[0]))
    count = 500
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        updates = [
            TaskStatusUpdated(task_id=TaskId(str(uuid.uuid4())), status=TaskComplete())
            for _ in range(count)
        ]
        for update in updates:
            sender.emit(update)
        sent = drain(outbox)
        sender.acknowledge(indexed_copy(sent[-1]))
        del sent, update, updates  # only the sender holds them now
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert sender.unacknowledged == 0
    assert held / count < 500, f"{held / count:.0f} bytes held per event"
    # They are sent again, whole and in order, in a new session.
    sender.restart_session()
    again = drain(outbox)
    assert len(again) == count + 1
    assert all(isinstance(f.event, TaskStatusUpdated) for f in again[1:])
