from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import pytest

from exo.master import done_commands
from exo.master import main as master_main
from exo.master.main import NODE_TIMEOUT_SECONDS, Master
from exo.node.event_log import EventLog
from exo.shared.apply import apply_all
from exo.shared.types.commands import (
    Command,
    ForwarderCommand,
    GenerateText,
    PlaceInstance,
    RequestEventReplay,
)
from exo.shared.types.common import CommandId, NodeId, RunnerId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    CommandRejected,
    Event,
    ForwarderEvent,
    IndexedEvent,
    InstanceCreated,
    NodeGatheredInfo,
    NodeLost,
    NodeTimedOut,
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


SESSION = "session-1"


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Cluster:
    master: Master
    commands: Topic[ForwarderCommand]
    local_events: Topic[ForwarderEvent]
    global_events: Subscription[IndexedEvent]
    log_path: Path

    def send_command(self, command: Command) -> None:
        self.commands.publish(ForwarderCommand(origin=NODE_A, command=command))

    def send_event(self, origin: NodeId, origin_idx: int, event: Event, session: str = SESSION):
        self.local_events.publish(
            ForwarderEvent(
                origin=origin, origin_session=session, origin_idx=origin_idx, event=event
            )
        )

    def send_local_event(
        self, origin: NodeId, origin_idx: int, runner: str, session: str = SESSION
    ) -> None:
        self.send_event(origin, origin_idx, RunnerDeleted(runner_id=RunnerId(runner)), session)

    async def receive(self, count: int) -> list[IndexedEvent]:
        """The next `count` published copies, checked to be stamped by this master and
        returned without the stamp (as the log holds them)."""
        with anyio.fail_after(DEADLINE_S):
            copies = [await self.global_events.receive() for _ in range(count)]
        assert {copy.published_by for copy in copies} <= {self.master.node_id}
        return [copy.model_copy(update={"published_by": None}) for copy in copies]

    async def receive_history_started(self) -> IndexedEvent:
        [started] = await self.receive(1)
        assert started.idx == 0
        assert isinstance(started.event, ClusterHistoryStarted)
        assert started.event.master == MASTER_NODE
        return started

    def assert_nothing_more(self) -> None:
        with pytest.raises(anyio.WouldBlock):
            self.global_events.receive_nowait()


@dataclass
class Options:
    """What a node hands its master besides the channels."""

    is_active: Callable[[], bool] = lambda: True
    current_state: Callable[[], State] | None = None
    last_heard: dict[NodeId, float] = field(default_factory=dict)
    clock: Callable[[], float] = field(default_factory=FakeClock)


@asynccontextmanager
async def running_master(
    tmp_path: Path, state: State | None = None, options: Options | None = None
) -> AsyncIterator[Cluster]:
    options = options or Options()
    commands: Topic[ForwarderCommand] = Topic("commands")
    local_events: Topic[ForwarderEvent] = Topic("local_events")
    global_events: Topic[IndexedEvent] = Topic("global_events")
    log = EventLog(tmp_path / "events.jsonl")
    log.read_all()
    master = Master(
        node_id=MASTER_NODE,
        state=state or State(),
        event_log=log,
        command_subscription=commands.subscribe(),
        local_event_subscription=local_events.subscribe(),
        global_event_publisher=global_events.sender(),
        cards={CARD.model_id: CARD},
        is_active=options.is_active,
        current_state=options.current_state,
        last_heard=options.last_heard,
        clock=options.clock,
    )
    cluster = Cluster(master, commands, local_events, global_events.subscribe(), log.path)
    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(master.run)
            yield cluster
            task_group.cancel_scope.cancel()
    finally:
        log.close()


def write_log(tmp_path: Path, events: list[Event]) -> tuple[list[IndexedEvent], State]:
    """A log of `events` (numbered from 0) and the state they build, as a node restarting
    from its log holds them."""
    earlier = [IndexedEvent(idx=i, event=event) for i, event in enumerate(events)]
    log = EventLog(tmp_path / "events.jsonl")
    log.append(earlier)
    log.close()
    return earlier, apply_all(State(), earlier)


@pytest.mark.anyio
async def test_commands_and_local_events_become_indexed_persisted_events(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        started = await cluster.receive_history_started()
        info = NodeGatheredInfo(node_id=NODE_A, info=make_node_info(4096))
        cluster.send_event(NODE_A, 0, info)
        [first] = await cluster.receive(1)
        cluster.send_command(PlaceInstance(command_id=CommandId("place"), model_id=SMOLLM2))
        cluster.send_command(GenerateText(command_id=CommandId("generate"), params=make_params()))
        second, third = await cluster.receive(2)
        cluster.assert_nothing_more()

        assert [first.idx, second.idx, third.idx] == [1, 2, 3]
        assert first.event == info
        assert (first.origin, first.origin_session, first.origin_idx) == (NODE_A, SESSION, 0)
        assert isinstance(second.event, InstanceCreated)
        assert second.event.command_id == CommandId("place")
        assert second.origin is None
        assert list(second.event.instance.shard_assignments.node_to_runner) == [NODE_A]
        assert isinstance(third.event, TaskCreated)
        assert third.event.task.command_id == CommandId("generate")
        assert third.event.task.origin_node_id == NODE_A
        assert third.event.task.instance_id == second.event.instance.instance_id

        history = [started, first, second, third]
        assert EventLog(cluster.log_path).read_all() == history
        assert cluster.master.state == apply_all(State(), history)
        assert cluster.master.state.last_event_applied_idx == 3


@pytest.mark.anyio
async def test_rejected_command_is_published_not_only_logged(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        await cluster.receive_history_started()
        cluster.send_command(GenerateText(command_id=CommandId("generate"), params=make_params()))
        [rejected] = await cluster.receive(1)
        assert rejected.idx == 1
        assert isinstance(rejected.event, CommandRejected)
        assert rejected.event.command_id == CommandId("generate")
        assert rejected.event.origin == NODE_A
        assert rejected.event.status_code == 404


@pytest.mark.anyio
async def test_duplicate_local_event_is_dropped(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        started = await cluster.receive_history_started()
        cluster.send_local_event(NODE_A, 0, "a-0")
        cluster.send_local_event(NODE_A, 0, "a-0-resent")
        # The same origin_idx from another node, or another process of the same node,
        # is a different event.
        cluster.send_local_event(NODE_B, 0, "b-0")
        cluster.send_local_event(NODE_A, 0, "a-0-restarted", session="session-2")
        cluster.send_local_event(NODE_A, 1, "a-1")
        cluster.send_local_event(NODE_A, 1, "a-1-resent")
        cluster.send_local_event(NODE_A, 0, "a-0-late")
        cluster.send_local_event(NODE_A, 2, "a-2")
        received = await cluster.receive(5)
        cluster.assert_nothing_more()
        assert [(e.idx, e.event) for e in received] == [
            (1, RunnerDeleted(runner_id=RunnerId("a-0"))),
            (2, RunnerDeleted(runner_id=RunnerId("b-0"))),
            (3, RunnerDeleted(runner_id=RunnerId("a-0-restarted"))),
            (4, RunnerDeleted(runner_id=RunnerId("a-1"))),
            (5, RunnerDeleted(runner_id=RunnerId("a-2"))),
        ]
        assert EventLog(cluster.log_path).read_all() == [started, *received]


@pytest.mark.anyio
async def test_out_of_order_local_event_waits_for_its_predecessor(tmp_path: Path) -> None:
    async with running_master(tmp_path) as cluster:
        await cluster.receive_history_started()
        cluster.send_local_event(NODE_A, 1, "a-1-early")
        cluster.send_local_event(NODE_A, 0, "a-0")
        [first] = await cluster.receive(1)
        # a-1 arrived before a-0 and was dropped, not kept for later.
        cluster.assert_nothing_more()
        cluster.send_local_event(NODE_A, 1, "a-1-resent")
        [second] = await cluster.receive(1)
        cluster.assert_nothing_more()
        assert [(e.idx, e.origin_idx, e.event) for e in (first, second)] == [
            (1, 0, RunnerDeleted(runner_id=RunnerId("a-0"))),
            (2, 1, RunnerDeleted(runner_id=RunnerId("a-1-resent"))),
        ]


@pytest.mark.anyio
async def test_restarted_master_continues_the_index(tmp_path: Path) -> None:
    earlier, state = write_log(
        tmp_path,
        [RunnerDeleted(runner_id=RunnerId("r-0")), RunnerDeleted(runner_id=RunnerId("r-1"))],
    )
    async with running_master(tmp_path, state) as cluster:
        cluster.send_local_event(NODE_A, 0, "r-2")
        [event] = await cluster.receive(1)
        cluster.assert_nothing_more()
        assert event.idx == 2
        assert EventLog(cluster.log_path).read_all() == [*earlier, event]


class Election:
    """Stands in for `election.master == node_id`, counting how often it was asked."""

    def __init__(self) -> None:
        self.won = False
        self.asked = 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.won

    async def wait_asked(self, times: int) -> None:
        with anyio.fail_after(DEADLINE_S):
            while self.asked < times:
                await anyio.sleep(0.001)


@pytest.mark.anyio
async def test_inactive_master_ignores_everything_until_elected(tmp_path: Path) -> None:
    election = Election()
    async with running_master(tmp_path, options=Options(is_active=election)) as cluster:
        cluster.send_local_event(NODE_A, 0, "ignored")
        cluster.send_command(GenerateText(command_id=CommandId("ignored"), params=make_params()))
        # Asked once by the master's own loop and once for each message.
        await election.wait_asked(3)
        cluster.assert_nothing_more()
        election.won = True
        cluster.send_local_event(NODE_A, 0, "a-0")
        started = await cluster.receive_history_started()
        [event] = await cluster.receive(1)
        cluster.assert_nothing_more()
        assert event.event == RunnerDeleted(runner_id=RunnerId("a-0"))
        assert EventLog(cluster.log_path).read_all() == [started, event]


@pytest.mark.anyio
async def test_activation_on_a_held_history_continues_from_the_replica(tmp_path: Path) -> None:
    earlier, replica_state = write_log(
        tmp_path,
        [
            ClusterHistoryStarted(history_id="history-1", master=NODE_B),
            RunnerDeleted(runner_id=RunnerId("r-1")),
        ],
    )
    # The master's own state is stale; on activation it takes the replica's.
    options = Options(current_state=lambda: replica_state)
    async with running_master(tmp_path, State(), options) as cluster:
        cluster.send_local_event(NODE_A, 0, "a-0")
        [event] = await cluster.receive(1)
        cluster.assert_nothing_more()
        assert event.idx == 2
        assert cluster.master.state.history_id == "history-1"
        assert EventLog(cluster.log_path).read_all() == [*earlier, event]


@pytest.mark.anyio
async def test_master_elected_again_continues_after_events_its_replica_lacks(
    tmp_path: Path,
) -> None:
    """A short election round that the master wins again: what it emitted before may not
    have come back to its node's replica yet, so it continues from its log."""
    election = Election()
    election.won = True
    lagging_replica = State()  # none of the master's events has come back yet
    options = Options(is_active=election, current_state=lambda: lagging_replica)
    async with running_master(tmp_path, options=options) as cluster:
        cluster.send_command(PlaceInstance(command_id=CommandId("place"), model_id=SMOLLM2))
        started, rejected = await cluster.receive(2)
        assert isinstance(rejected.event, CommandRejected)  # no node reported: nothing lost
        election.won = False
        asked = election.asked
        cluster.send_local_event(NODE_A, 0, "during-the-round")
        await election.wait_asked(asked + 1)
        election.won = True
        cluster.send_local_event(NODE_A, 0, "a-0")
        [event] = await cluster.receive(1)
        cluster.send_command(PlaceInstance(command_id=CommandId("place"), model_id=SMOLLM2))
        cluster.send_local_event(NODE_A, 1, "a-1")
        [marker] = await cluster.receive(1)
        cluster.assert_nothing_more()
    assert (event.idx, event.event) == (2, RunnerDeleted(runner_id=RunnerId("a-0")))
    assert marker.idx == 3  # the resent command was recognised as carried out
    assert EventLog(cluster.log_path).read_all() == [started, rejected, event, marker]


@pytest.mark.anyio
async def test_resent_command_already_carried_out_is_ignored(tmp_path: Path) -> None:
    place = PlaceInstance(command_id=CommandId("place"), model_id=SMOLLM2)
    info = NodeGatheredInfo(node_id=NODE_A, info=make_node_info(4096))
    with_info = apply_all(
        State(),
        [
            IndexedEvent(idx=0, event=ClusterHistoryStarted(history_id="h", master=NODE_B)),
            IndexedEvent(idx=1, event=info),
        ],
    )
    [created] = master_main.events_for_command(with_info, NODE_A, place, {CARD.model_id: CARD})
    earlier, state = write_log(
        tmp_path, [ClusterHistoryStarted(history_id="h", master=NODE_B), info, created]
    )
    async with running_master(tmp_path, options=Options(current_state=lambda: state)) as cluster:
        # The previous master carried `place` out; its sender resends it to the new one.
        cluster.send_command(place)
        cluster.send_command(place.model_copy(update={"command_id": CommandId("place-2")}))
        [event] = await cluster.receive(1)
        cluster.assert_nothing_more()
        assert event.idx == 3
        assert isinstance(event.event, InstanceCreated)
        assert event.event.command_id == CommandId("place-2")
        # A command this master carried out itself is not carried out twice either.
        cluster.send_command(place.model_copy(update={"command_id": CommandId("place-2")}))
        cluster.send_local_event(NODE_A, 0, "marker")
        [marker] = await cluster.receive(1)
        assert marker.event == RunnerDeleted(runner_id=RunnerId("marker"))
        assert EventLog(cluster.log_path).read_all() == [*earlier, event, marker]


@pytest.mark.anyio
async def test_replay_request_republishes_a_slice_of_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(master_main, "REPLAY_BATCH", 3)
    events: list[Event] = [ClusterHistoryStarted(history_id="h", master=MASTER_NODE)]
    events += [RunnerDeleted(runner_id=RunnerId(f"r-{i}")) for i in range(1, 6)]
    earlier, state = write_log(tmp_path, events)
    async with running_master(tmp_path, state) as cluster:
        cluster.send_command(RequestEventReplay(command_id=CommandId("replay"), from_idx=2))
        replayed = await cluster.receive(3)
        cluster.send_command(RequestEventReplay(command_id=CommandId("replay-2"), from_idx=5))
        tail = await cluster.receive(1)
        cluster.send_command(RequestEventReplay(command_id=CommandId("replay-3"), from_idx=9))
        cluster.send_local_event(NODE_A, 0, "marker")
        [marker] = await cluster.receive(1)
        cluster.assert_nothing_more()
    assert replayed == earlier[2:5]
    assert tail == earlier[5:]
    # Replays are not new history: the next event still follows the last one.
    assert marker.idx == 6


@pytest.mark.anyio
async def test_nodes_not_heard_from_time_out(tmp_path: Path) -> None:
    clock = FakeClock(1000.0)
    last_heard: dict[NodeId, float] = {}
    options = Options(last_heard=last_heard, clock=clock)
    node_c = NodeId("node-c")
    async with running_master(tmp_path, options=options) as cluster:
        await cluster.receive_history_started()
        for index, node_id in enumerate([MASTER_NODE, NODE_A, NODE_B, node_c]):
            info = NodeGatheredInfo(node_id=node_id, info=make_node_info(1024 + index))
            cluster.send_event(node_id, 0, info)
        await cluster.receive(4)
        # Nobody was heard from yet: activation time is the grace period's start.
        clock.now = 1000.0 + NODE_TIMEOUT_SECONDS
        assert cluster.master.timed_out_nodes() == []
        last_heard[NODE_A] = 1000.0 + 20
        last_heard[NODE_B] = 1000.0 + 5
        clock.now = 1000.0 + NODE_TIMEOUT_SECONDS + 1
        # The master never times itself out (it is not in `last_heard`); C was never heard.
        # A node not lost before is lost first (its instances are placed again).
        assert cluster.master.timed_out_nodes() == [
            NodeLost(node_id=node_c),
            NodeTimedOut(node_id=node_c),
        ]
        clock.now = 1000.0 + NODE_TIMEOUT_SECONDS + 6
        expected = [
            NodeLost(node_id=NODE_B),
            NodeTimedOut(node_id=NODE_B),
            NodeLost(node_id=node_c),
            NodeTimedOut(node_id=node_c),
        ]
        assert cluster.master.timed_out_nodes() == expected
        # The master's own loop publishes them (within its 1 s period).
        timed_out = await cluster.receive(4)
        assert [e.event for e in timed_out] == expected
        assert sorted(cluster.master.state.node_info) == [MASTER_NODE, NODE_A]
        assert cluster.master.timed_out_nodes() == []


def test_emit_of_nothing_publishes_nothing(tmp_path: Path) -> None:
    global_events: Topic[IndexedEvent] = Topic("global_events")
    subscription = global_events.subscribe()
    log = EventLog(tmp_path / "events.jsonl")
    master = Master(
        MASTER_NODE, State(), log, Topic[ForwarderCommand]("c").subscribe(),
        Topic[ForwarderEvent]("e").subscribe(), global_events.sender(), {},
    )  # fmt: skip
    master.emit([])
    with pytest.raises(anyio.WouldBlock):
        subscription.receive_nowait()
    assert not log.path.exists()
    assert master.state == State()


def test_the_commands_a_master_remembers_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every command ever carried out stayed in the master's memory (~140 bytes each,
    unbounded); now the newest `DONE_COMMANDS_KEPT`, still enough to ignore a resend."""
    monkeypatch.setattr(done_commands, "DONE_COMMANDS_KEPT", 8)
    log = EventLog(tmp_path / "events.jsonl")
    master = Master(
        MASTER_NODE, State(), log, Topic[ForwarderCommand]("c").subscribe(),
        Topic[ForwarderEvent]("e").subscribe(), Topic[IndexedEvent]("g").sender(), {},
    )  # fmt: skip
    ids = [CommandId(f"command-{i}") for i in range(50)]
    master.emit([CommandRejected(command_id=i, origin=NODE_A, reason="no") for i in ids])
    log.close()
    assert len(master._done_commands) == 8
    assert all(i in master._done_commands for i in ids[-8:])
    assert not any(i in master._done_commands for i in ids[:-8])
    # The newest is still not carried out twice.
    master.handle_command(ForwarderCommand(origin=NODE_A, command=GenerateText(
        command_id=ids[-1], params=make_params())))  # fmt: skip
    assert master.state.last_event_applied_idx == 49
