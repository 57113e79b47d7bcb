from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from exo.master.event_log import EventLog
from exo.master.main import Master
from exo.shared.apply import apply_all
from exo.shared.types.commands import ForwarderCommand, GenerateText, PlaceInstance
from exo.shared.types.common import CommandId, NodeId, RunnerId
from exo.shared.types.events import (
    CommandRejected,
    ForwarderEvent,
    IndexedEvent,
    InstanceCreated,
    NodeGatheredInfo,
    RunnerDeleted,
    TaskCreated,
)
from exo.shared.types.state import State
from exo.testing.builders import SMOLLM2, make_card, make_node_info, make_params
from exo.utils.channels import Subscription, Topic

MASTER_NODE = NodeId("master-node")
NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
CARD = make_card()
DEADLINE_S = 5


@pytest.fixture
def anyio_backend() -> str:
    # exo runs on asyncio (anyio.run's default); trio is not a supported backend.
    return "asyncio"


@dataclass
class Cluster:
    master: Master
    commands: Topic[ForwarderCommand]
    local_events: Topic[ForwarderEvent]
    global_events: Subscription[IndexedEvent]
    log_path: Path

    def send_command(self, command: PlaceInstance | GenerateText) -> None:
        self.commands.publish(ForwarderCommand(origin=NODE_A, command=command))

    def send_local_event(self, origin: NodeId, origin_idx: int, runner: str) -> None:
        event = RunnerDeleted(runner_id=RunnerId(runner))
        self.local_events.publish(ForwarderEvent(origin=origin, origin_idx=origin_idx, event=event))

    async def receive(self, count: int) -> list[IndexedEvent]:
        with anyio.fail_after(DEADLINE_S):
            return [await self.global_events.receive() for _ in range(count)]

    def assert_nothing_more(self) -> None:
        with pytest.raises(anyio.WouldBlock):
            self.global_events.receive_nowait()


@asynccontextmanager
async def running_master(tmp_path: Path, state: State | None = None) -> AsyncIterator[Cluster]:
    commands: Topic[ForwarderCommand] = Topic("commands")
    local_events: Topic[ForwarderEvent] = Topic("local_events")
    global_events: Topic[IndexedEvent] = Topic("global_events")
    log = EventLog(tmp_path / "events.jsonl")
    master = Master(
        node_id=MASTER_NODE,
        state=state or State(),
        event_log=log,
        command_subscription=commands.subscribe(),
        local_event_subscription=local_events.subscribe(),
        global_event_publisher=global_events.sender(),
        cards={CARD.model_id: CARD},
    )
    cluster = Cluster(master, commands, local_events, global_events.subscribe(), log.path)
    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(master.run)
            yield cluster
            task_group.cancel_scope.cancel()
    finally:
        log.close()


@pytest.mark.anyio
async def test_commands_and_local_events_become_indexed_persisted_events(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        info = NodeGatheredInfo(node_id=NODE_A, info=make_node_info(4096))
        cluster.local_events.publish(ForwarderEvent(origin=NODE_A, origin_idx=0, event=info))
        [first] = await cluster.receive(1)
        cluster.send_command(PlaceInstance(command_id=CommandId("place"), model_id=SMOLLM2))
        cluster.send_command(GenerateText(command_id=CommandId("generate"), params=make_params()))
        second, third = await cluster.receive(2)
        cluster.assert_nothing_more()

        assert [first.idx, second.idx, third.idx] == [0, 1, 2]
        assert first.event == info
        assert isinstance(second.event, InstanceCreated)
        assert second.event.command_id == CommandId("place")
        assert list(second.event.instance.shard_assignments.node_to_runner) == [NODE_A]
        assert isinstance(third.event, TaskCreated)
        assert third.event.task.command_id == CommandId("generate")
        assert third.event.task.origin_node_id == NODE_A
        assert third.event.task.instance_id == second.event.instance.instance_id

        assert EventLog(cluster.log_path).read_all() == [first, second, third]
        assert cluster.master.state == apply_all(State(), [first, second, third])
        assert cluster.master.state.last_event_applied_idx == 2


@pytest.mark.anyio
async def test_rejected_command_is_published_not_only_logged(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        cluster.send_command(GenerateText(command_id=CommandId("generate"), params=make_params()))
        [rejected] = await cluster.receive(1)
        assert rejected.idx == 0
        assert isinstance(rejected.event, CommandRejected)
        assert rejected.event.command_id == CommandId("generate")
        assert rejected.event.origin == NODE_A
        assert rejected.event.status_code == 404


@pytest.mark.anyio
async def test_duplicate_local_event_is_dropped(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        cluster.send_local_event(NODE_A, 0, "a-0")
        cluster.send_local_event(NODE_A, 0, "a-0-resent")
        # The same origin_idx from another node is a different event.
        cluster.send_local_event(NODE_B, 0, "b-0")
        cluster.send_local_event(NODE_A, 1, "a-1")
        cluster.send_local_event(NODE_A, 1, "a-1-resent")
        cluster.send_local_event(NODE_A, 0, "a-0-late")
        cluster.send_local_event(NODE_A, 2, "a-2")
        received = await cluster.receive(4)
        cluster.assert_nothing_more()
        assert [(e.idx, e.event) for e in received] == [
            (0, RunnerDeleted(runner_id=RunnerId("a-0"))),
            (1, RunnerDeleted(runner_id=RunnerId("b-0"))),
            (2, RunnerDeleted(runner_id=RunnerId("a-1"))),
            (3, RunnerDeleted(runner_id=RunnerId("a-2"))),
        ]
        assert EventLog(cluster.log_path).read_all() == received


@pytest.mark.anyio
async def test_restarted_master_continues_the_index(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    earlier = [
        IndexedEvent(idx=0, event=RunnerDeleted(runner_id=RunnerId("r-0"))),
        IndexedEvent(idx=1, event=RunnerDeleted(runner_id=RunnerId("r-1"))),
    ]
    log.append(earlier)
    log.close()
    state = apply_all(State(), EventLog(tmp_path / "events.jsonl").read_all())
    async with running_master(tmp_path, state) as cluster:
        cluster.send_local_event(NODE_A, 0, "r-2")
        [event] = await cluster.receive(1)
        assert event.idx == 2
        assert EventLog(cluster.log_path).read_all() == [*earlier, event]


def test_emit_of_nothing_publishes_nothing(tmp_path: Path) -> None:
    global_events: Topic[IndexedEvent] = Topic("global_events")
    subscription = global_events.subscribe()
    log = EventLog(tmp_path / "events.jsonl")
    master = Master(
        MASTER_NODE, State(), log, Topic[ForwarderCommand]("c").subscribe(),
        Topic[ForwarderEvent]("e").subscribe(), global_events.sender(), {},
    )  # fmt: skip
    assert master.emit([]) == []
    with pytest.raises(anyio.WouldBlock):
        subscription.receive_nowait()
    assert not log.path.exists()
