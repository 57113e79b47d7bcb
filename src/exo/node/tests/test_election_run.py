"""`Election.run` in real time on real channels: between rounds it wakes for heartbeats
only (it used to tick ten times a second for nothing), and a round opened by a message
is still decided at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from exo.node import election as election_module
from exo.node.election import Election, ElectionMessage
from exo.routing.connections import ConnectionMessage
from exo.shared.types.common import NodeId
from exo.shared.types.state import State
from exo.utils.channels import Subscription, Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("node-a")
STRANGER = NodeId("node-z")


@pytest.fixture(autouse=True)
def quick_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(election_module, "STARTUP_GRACE_SECONDS", 0.0)
    monkeypatch.setattr(election_module, "SETTLE_SECONDS", 0.05)
    monkeypatch.setattr(election_module, "ROUND_MAX_SECONDS", 0.2)
    monkeypatch.setattr(election_module, "TICK_SECONDS", 0.01)


@asynccontextmanager
async def running_election() -> AsyncIterator[tuple[Election, Topic[ElectionMessage]]]:
    topic: Topic[ElectionMessage] = Topic("election")
    election = Election(
        node_id=NODE,
        election_publisher=topic.sender(),
        election_subscription=topic.subscribe(),
        connections=Topic[ConnectionMessage]("connections").subscribe(),
        current_peers=frozenset,
        current_state=State,
    )
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(election.run)
        yield election, topic
        task_group.cancel_scope.cancel()


async def wait_for(condition: Callable[[], bool]) -> None:
    while not condition():
        await anyio.sleep(0.005)


def count_ticks(election: Election, monkeypatch: pytest.MonkeyPatch) -> list[None]:
    ticks: list[None] = []
    tick = election.tick

    def counting_tick() -> None:
        ticks.append(None)
        tick()

    monkeypatch.setattr(election, "tick", counting_tick)
    return ticks


async def test_between_rounds_it_wakes_only_for_heartbeats(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(election_module, "BROADCAST_INTERVAL_SECONDS", 0.05)
    with anyio.fail_after(30):
        async with running_election() as (election, topic):
            heard: Subscription[ElectionMessage] = topic.subscribe()
            await wait_for(lambda: election.master == NODE)
            ticks = count_ticks(election, monkeypatch)
            for _ in range(10):
                await heard.receive()
    # One wake per heartbeat (ticking every TICK_SECONDS would be ~5 per heartbeat).
    assert len(ticks) <= 11


async def test_a_round_opened_by_a_message_is_decided_without_waiting_for_a_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Heartbeats an hour apart: only the wake-up when the round opens can decide it.
    monkeypatch.setattr(election_module, "BROADCAST_INTERVAL_SECONDS", 3600.0)
    with anyio.fail_after(30):
        async with running_election() as (election, topic):
            await wait_for(lambda: election.master == NODE)
            clock = election.election_clock
            stranger = ElectionMessage(
                node_id=STRANGER, clock=clock + 1, seniority=0, last_event_idx=-1
            )
            topic.publish(stranger)
            await wait_for(lambda: election.election_clock == clock + 1)
            await wait_for(lambda: election.master == NODE)
