"""Link measurement against a tiny API on 127.0.0.1, and which changes are worth events."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Query, Response

from exo.node.topology import (
    BANDWIDTH_PROBE_BYTES,
    FAILURES_BEFORE_REMOVAL,
    TopologyProber,
    measure_link,
    worth_reporting,
)
from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId
from exo.shared.types.events import ForwarderEvent, TopologyEdgeMeasured, TopologyEdgeRemoved
from exo.shared.types.nodes import TopologyEdge
from exo.shared.types.state import State
from exo.testing.builders import make_node_info
from exo.utils.channels import Subscription, Topic

pytestmark = pytest.mark.anyio

PEER = NodeId("peer-node")
SELF = NodeId("self-node")
DEADLINE_S = 10


def edge(latency_ms: float = 10.0, bandwidth_mbps: float = 1000.0, address: str = "10.0.0.2"):
    return TopologyEdge(
        source=SELF,
        sink=PEER,
        address=address,
        latency_ms=latency_ms,
        bandwidth_mbps=bandwidth_mbps,
    )


def test_a_first_measurement_or_a_new_address_is_worth_reporting() -> None:
    assert worth_reporting(None, edge())
    assert worth_reporting(edge(), edge(address="192.168.1.2"))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # Latency: more than half of the old value, and at least 1 ms.
        (edge(latency_ms=10.0), edge(latency_ms=15.0), False),
        (edge(latency_ms=10.0), edge(latency_ms=15.1), True),
        (edge(latency_ms=10.0), edge(latency_ms=4.9), True),
        (edge(latency_ms=0.2), edge(latency_ms=1.2), False),
        (edge(latency_ms=0.2), edge(latency_ms=1.3), True),
        # Bandwidth: more than half of the old value, and at least 10 Mbit/s.
        (edge(bandwidth_mbps=1000.0), edge(bandwidth_mbps=1500.0), False),
        (edge(bandwidth_mbps=1000.0), edge(bandwidth_mbps=1501.0), True),
        (edge(bandwidth_mbps=1000.0), edge(bandwidth_mbps=499.0), True),
        (edge(bandwidth_mbps=5.0), edge(bandwidth_mbps=15.0), False),
        (edge(bandwidth_mbps=5.0), edge(bandwidth_mbps=15.1), True),
        (edge(), edge(), False),
    ],
)
def test_only_large_changes_are_worth_reporting(
    old: TopologyEdge, new: TopologyEdge, expected: bool
) -> None:
    assert worth_reporting(old, new) is expected


def peer_api(node_id: str) -> FastAPI:
    """The two routes of exo's API that peers probe."""
    app = FastAPI()

    @app.get("/node_id")
    async def get_node_id() -> str:
        return node_id

    @app.get("/bandwidth_probe")
    async def bandwidth_probe(size_bytes: int = Query(ge=1)) -> Response:
        return Response(bytes(size_bytes), media_type="application/octet-stream")

    return app


@asynccontextmanager
async def serving(app: FastAPI) -> AsyncIterator[int]:
    """Serve `app` on 127.0.0.1 and yield its port; stops the server on exit."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port: int = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    try:
        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(server.serve, [listener])
                while not server.started:
                    await anyio.sleep(0.01)
                try:
                    yield port
                finally:
                    server.should_exit = True
    finally:
        listener.close()


@asynccontextmanager
async def refused_port() -> AsyncIterator[int]:
    """A port bound but not listening: connections are refused, and nobody else takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as bound:
        bound.bind(("127.0.0.1", 0))
        port: int = bound.getsockname()[1]
        yield port


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=2.0, trust_env=False)


async def test_measure_link_to_the_expected_node() -> None:
    async with serving(peer_api(PEER)) as port, client() as http:
        with anyio.fail_after(DEADLINE_S):
            measured = await measure_link(http, "127.0.0.1", port, PEER)
    assert measured is not None
    latency_ms, bandwidth_mbps = measured
    assert 0 < latency_ms < 2000
    # At least the probe's size over the whole deadline.
    assert bandwidth_mbps > BANDWIDTH_PROBE_BYTES * 8 / DEADLINE_S / 1e6


async def test_measure_link_to_another_node_is_none() -> None:
    async with serving(peer_api("someone-else")) as port, client() as http:
        with anyio.fail_after(DEADLINE_S):
            assert await measure_link(http, "127.0.0.1", port, PEER) is None


async def test_measure_link_to_something_else_is_none() -> None:
    app = FastAPI()  # answers 404 everywhere, like a web server that is not exo
    async with serving(app) as port, client() as http:
        with anyio.fail_after(DEADLINE_S):
            assert await measure_link(http, "127.0.0.1", port, PEER) is None


async def test_measure_link_to_an_unreachable_port_is_none() -> None:
    async with refused_port() as port, client() as http:
        with anyio.fail_after(DEADLINE_S):
            assert await measure_link(http, "127.0.0.1", port, PEER) is None


def state_with_peer(port: int, known: TopologyEdge | None = None) -> State:
    info = make_node_info(1024).model_copy(
        update={"api_port": port, "api_addresses": ("127.0.0.1",)}
    )
    topology = {SELF: {PEER: known}} if known is not None else {}
    return State(
        node_info={SELF: make_node_info(1024), PEER: info},
        topology=topology,
        last_event_applied_idx=1,
    )


def prober(state: list[State]) -> tuple[TopologyProber, Subscription[ForwarderEvent]]:
    topic: Topic[ForwarderEvent] = Topic("local_events")
    outbox = topic.subscribe()
    return TopologyProber(SELF, lambda: state[0], LocalEventSender(SELF, topic.sender())), outbox


def drain(outbox: Subscription[ForwarderEvent]) -> list[object]:
    events: list[object] = []
    while True:
        try:
            events.append(outbox.receive_nowait().event)
        except anyio.WouldBlock:
            return events


async def test_prober_reports_a_new_link_once_then_its_loss() -> None:
    async with serving(peer_api(PEER)) as port, client() as http:
        state = [state_with_peer(port)]
        topology_prober, outbox = prober(state)
        with anyio.fail_after(DEADLINE_S):
            await topology_prober.probe_all(http)
        [measured] = drain(outbox)
        assert isinstance(measured, TopologyEdgeMeasured)
        assert (measured.edge.source, measured.edge.sink) == (SELF, PEER)
        assert measured.edge.address == "127.0.0.1"
        # Once the state holds the edge, only a large change is news (here: it got faster).
        known = measured.edge.model_copy(update={"latency_ms": 1000.0})
        state[0] = state_with_peer(port, known)
        with anyio.fail_after(DEADLINE_S):
            await topology_prober.probe_all(http)
        [remeasured] = drain(outbox)
        assert isinstance(remeasured, TopologyEdgeMeasured)
        state[0] = state_with_peer(port, remeasured.edge)
    async with refused_port() as dead_port, client() as http:
        state[0] = state_with_peer(dead_port, remeasured.edge)
        with anyio.fail_after(DEADLINE_S):
            for _ in range(FAILURES_BEFORE_REMOVAL - 1):
                await topology_prober.probe_all(http)
            assert drain(outbox) == []
            await topology_prober.probe_all(http)
            assert drain(outbox) == [TopologyEdgeRemoved(source=SELF, sink=PEER)]
            await topology_prober.probe_all(http)
            assert drain(outbox) == []
