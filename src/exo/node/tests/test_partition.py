"""A healed network split: two masters wrote two histories since the split; the losing
side's node takes the winner's history and re-reports what it still runs, so the one
history left holds every instance still running on either side."""

from __future__ import annotations

from pathlib import Path

import anyio

from exo.master.main import Master
from exo.node.event_log import EventLog, event_digest
from exo.node.tests.test_replica import MASTER, NODE, Harness, make_harness
from exo.shared.apply import apply_all
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import InstanceId, NodeId, RunnerId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    Event,
    ForwarderEvent,
    IndexedEvent,
    InstanceCreated,
    InstanceReported,
    InstanceUsed,
    NodeGatheredInfo,
    NodeLost,
    RunnerStatusUpdated,
)
from exo.shared.types.runners import RunnerLoading, RunnerReady
from exo.shared.types.state import State
from exo.shared.types.tasks import Shutdown
from exo.testing.builders import make_instance, make_node_info
from exo.utils.channels import Subscription, Topic
from exo.worker.plan import LocalRunner, plan

LOSER = NODE  # the replica's node: its side lost the election when the split healed
WINNER = MASTER
THIRD = NodeId("node-c")
WINNER_INSTANCE = make_instance(WINNER, instance_id="instance-w")
LOSER_INSTANCE = make_instance(LOSER, instance_id="instance-l")
SPLIT_INSTANCE = make_instance([LOSER, THIRD], instance_id="instance-s")


def numbered(events: list[Event], start: int = 0) -> list[IndexedEvent]:
    return [IndexedEvent(idx=start + i, event=event) for i, event in enumerate(events)]


PREFIX: list[Event] = [
    ClusterHistoryStarted(history_id="history-1", master=WINNER),
    NodeGatheredInfo(node_id=WINNER, info=make_node_info(8192)),
    NodeGatheredInfo(node_id=LOSER, info=make_node_info(8192)),
    NodeGatheredInfo(node_id=THIRD, info=make_node_info(8192)),
]


def ready(instance_id: str, node_id: NodeId, rank: int = 0) -> RunnerStatusUpdated:
    return RunnerStatusUpdated(
        runner_id=RunnerId(f"{instance_id}-rank{rank}"), node_id=node_id, status=RunnerReady()
    )


WINNER_SIDE: list[Event] = [
    NodeLost(node_id=LOSER),
    NodeLost(node_id=THIRD),
    InstanceCreated(instance=WINNER_INSTANCE),
    ready("instance-w", WINNER),
]
LOSER_SIDE: list[Event] = [
    NodeLost(node_id=WINNER),
    InstanceCreated(instance=LOSER_INSTANCE),
    ready("instance-l", LOSER),
    InstanceUsed(instance_id=LOSER_INSTANCE.instance_id, used_at=5.0, keep_alive_seconds=None),
    InstanceCreated(instance=SPLIT_INSTANCE),
    ready("instance-s", LOSER),
    ready("instance-s", THIRD, rank=1),
]


def winner_master(tmp_path: Path, history: list[IndexedEvent]) -> tuple[Master, Subscription]:
    log = EventLog(tmp_path / "winner" / "events.jsonl")
    log.append(history)
    published: Topic[IndexedEvent] = Topic("global_events")
    master = Master(
        node_id=WINNER,
        state=apply_all(State(), history),
        event_log=log,
        command_subscription=Topic[ForwarderCommand]("commands").subscribe(),
        local_event_subscription=Topic[ForwarderEvent]("local_events").subscribe(),
        global_event_publisher=published.sender(),
        cards={},
    )
    return master, published.subscribe()


def drain(subscription: Subscription) -> list:
    items = []
    while True:
        try:
            items.append(subscription.receive_nowait())
        except anyio.WouldBlock:
            return items


def heal(tmp_path: Path, winner_side: list[Event]) -> tuple[Harness, Master]:
    """The loser's replica meets the winner's master; the loser's reports go to it; the
    master's history goes back to the loser."""
    winner_history = numbered([*PREFIX, *winner_side])
    loser_history = numbered([*PREFIX, *LOSER_SIDE])
    (tmp_path / "loser").mkdir()
    harness = make_harness(tmp_path / "loser", held=loser_history)
    master, published = winner_master(tmp_path, winner_history)
    last = winner_history[-1]
    harness.follow(last_event_idx=last.idx, last_event_digest=event_digest(last))
    harness.replica.check()  # the loser's event at that index differs: it starts over
    assert harness.replica.state == State()
    assert harness.replica.resyncing
    for forwarded in drain(harness.forwarded):
        master.handle_local_event(forwarded)
    master.replay(0)
    harness.receive(*drain(published))
    final = master.state.last_event_applied_idx
    digest = master._event_log.digest_at(final)
    harness.follow(last_event_idx=final, last_event_digest=digest)
    harness.replica.check()
    return harness, master


def test_the_winner_keeps_what_the_losing_side_still_runs(tmp_path: Path) -> None:
    harness, master = heal(tmp_path, WINNER_SIDE)
    state = harness.replica.state
    assert state == master.state  # one history
    assert not harness.replica.resyncing
    assert set(state.instances) == {
        WINNER_INSTANCE.instance_id,
        LOSER_INSTANCE.instance_id,
        SPLIT_INSTANCE.instance_id,
    }
    # Runner statuses came with the reports: the instances serve at once.
    assert state.runners[RunnerId("instance-l-rank0")] == RunnerReady()
    assert state.runners[RunnerId("instance-s-rank1")] == RunnerReady()
    assert state.runner_nodes[RunnerId("instance-s-rank1")] == THIRD
    assert state.instance_usage[LOSER_INSTANCE.instance_id].last_used_at == 5.0
    # Every report was indexed (acknowledged), so none is sent again.
    assert harness.local_events.pending() == []
    reports = [e.event for e in master._event_log.events if isinstance(e.event, InstanceReported)]
    assert [r.instance.instance_id for r in reports] == [
        LOSER_INSTANCE.instance_id,
        SPLIT_INSTANCE.instance_id,
    ]


def test_an_instance_the_winner_replaced_is_not_doubled(tmp_path: Path) -> None:
    # The winner's side re-placed the loser's instance (same id) on its own node.
    moved = make_instance(WINNER, instance_id="instance-l", runner_tag="moved")
    harness, master = heal(tmp_path, [*WINNER_SIDE, InstanceCreated(instance=moved)])
    state = harness.replica.state
    assert state == master.state
    assert state.instances[LOSER_INSTANCE.instance_id] == moved
    assert RunnerId("instance-l-rank0") not in state.runners
    assert SPLIT_INSTANCE.instance_id in state.instances


def test_the_worker_keeps_reported_runners_until_the_master_decides(tmp_path: Path) -> None:
    runners = {
        RunnerId("instance-l-rank0"): LocalRunner(
            instance_id=LOSER_INSTANCE.instance_id, status=RunnerReady(), in_flight=frozenset()
        )
    }
    # Without the report in flight, an instance the state lacks is an orphan.
    assert plan(LOSER, State(), runners, {}, {}, 0.0) == Shutdown(
        runner_id=RunnerId("instance-l-rank0")
    )
    kept = frozenset({InstanceId("instance-l")})
    assert not isinstance(plan(LOSER, State(), runners, {}, {}, 0.0, reported=kept), Shutdown)


def test_a_second_report_of_the_same_instance_changes_nothing(tmp_path: Path) -> None:
    state = apply_all(State(), numbered(PREFIX))
    first = InstanceReported(
        node_id=LOSER,
        instance=SPLIT_INSTANCE,
        runners={
            RunnerId("instance-s-rank0"): RunnerReady(),
            RunnerId("instance-s-rank1"): RunnerReady(),
        },
    )
    second = first.model_copy(
        update={
            "node_id": THIRD,
            "runners": {
                RunnerId("instance-s-rank1"): RunnerLoading(layers_loaded=1, total_layers=30)
            },
        }
    )
    once = apply_all(state, numbered([first], start=len(PREFIX)))
    twice = apply_all(once, numbered([second], start=len(PREFIX) + 1))
    assert twice.model_copy(update={"last_event_applied_idx": once.last_event_applied_idx}) == once


def test_a_compacted_winner_s_snapshot_still_keeps_the_loser_s_instances(tmp_path: Path) -> None:
    # The winner's side ran longer and compacted past the split: the loser gets a
    # snapshot it cannot compare its events with.
    filler: list[Event] = [
        NodeGatheredInfo(node_id=WINNER, info=make_node_info(8192 + i)) for i in range(20)
    ]
    winner_history = numbered([*PREFIX, *WINNER_SIDE, *filler])
    loser_history = numbered([*PREFIX, *LOSER_SIDE])
    (tmp_path / "loser").mkdir()
    harness = make_harness(tmp_path / "loser", held=loser_history)
    master, published = winner_master(tmp_path, winner_history)
    master._event_log.write_snapshot(master.state)
    last = winner_history[-1]
    harness.follow(last_event_idx=last.idx, last_event_digest=event_digest(last))
    harness.replica.check()
    assert harness.replays() == [len(loser_history) - 1]
    master.replay(harness.replays()[-1])
    harness.receive(*drain(published))
    assert harness.replica.resyncing
    assert LOSER_INSTANCE.instance_id not in harness.replica.state.instances
    for forwarded in drain(harness.forwarded):
        master.handle_local_event(forwarded)
    harness.receive(*drain(published))
    final = master.state.last_event_applied_idx
    harness.follow(last_event_idx=final, last_event_digest=master._event_log.digest_at(final))
    harness.replica.check()
    state = harness.replica.state
    assert state == master.state
    assert not harness.replica.resyncing
    assert {LOSER_INSTANCE.instance_id, SPLIT_INSTANCE.instance_id} <= set(state.instances)
    assert harness.local_events.pending() == []
