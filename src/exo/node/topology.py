"""Measures this node's links to its peers and reports them as topology events.

Every `PROBE_INTERVAL_SECONDS` the node calls each peer's API (`GET /node_id`) on every
address the peer listens on: the answer must be that peer's id (a loopback address may
reach another node). Latency is the median round trip of a few calls; the bandwidth
estimate is one transfer of `BANDWIDTH_PROBE_BYTES` from `GET /bandwidth_probe`. Only
changes worth knowing become events, so the log does not grow with every probe.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import anyio
import httpx
from loguru import logger

from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId
from exo.shared.types.events import TopologyEdgeMeasured, TopologyEdgeRemoved
from exo.shared.types.nodes import NodeInfo, TopologyEdge
from exo.shared.types.state import State

PROBE_INTERVAL_SECONDS = 5.0
PROBE_TIMEOUT_SECONDS = 2.0
LATENCY_SAMPLES = 3
BANDWIDTH_PROBE_BYTES = 1 << 20
FAILURES_BEFORE_REMOVAL = 3
# Relative change that makes a new measurement worth an event.
REPORT_CHANGE_FRACTION = 0.5


def _url(address: str, port: int, path: str) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}{path}"


async def measure_link(
    client: httpx.AsyncClient, address: str, port: int, expected_node: NodeId
) -> tuple[float, float] | None:
    """(latency ms, bandwidth Mbit/s) to `expected_node` at `address`, or None when it does
    not answer there as that node."""
    round_trips = []
    try:
        for _ in range(LATENCY_SAMPLES):
            started = time.perf_counter()
            response = await client.get(_url(address, port, "/node_id"))
            round_trips.append(time.perf_counter() - started)
            if response.status_code != 200 or response.json() != expected_node:
                return None
        started = time.perf_counter()
        response = await client.get(
            _url(address, port, "/bandwidth_probe"), params={"size_bytes": BANDWIDTH_PROBE_BYTES}
        )
        elapsed = time.perf_counter() - started
        if response.status_code != 200:
            return None
    except (httpx.HTTPError, ValueError):
        return None
    latency_ms = statistics.median(round_trips) * 1000
    bandwidth_mbps = len(response.content) * 8 / max(elapsed, 1e-6) / 1e6
    return latency_ms, bandwidth_mbps


def worth_reporting(old: TopologyEdge | None, new: TopologyEdge) -> bool:
    if old is None or old.address != new.address:
        return True

    def moved(before: float, after: float, floor: float) -> bool:
        return abs(after - before) > max(floor, REPORT_CHANGE_FRACTION * before)

    return moved(old.latency_ms, new.latency_ms, 1.0) or moved(
        old.bandwidth_mbps, new.bandwidth_mbps, 10.0
    )


class TopologyProber:
    def __init__(
        self,
        node_id: NodeId,
        current_state: Callable[[], State],
        local_events: LocalEventSender,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.node_id = node_id
        self._current_state = current_state
        self._local_events = local_events
        self._failures: dict[NodeId, int] = {}
        # The cluster's peer credential: other nodes' APIs open the probed routes to it.
        self._headers = dict(headers or {})

    async def run(self) -> None:
        async with httpx.AsyncClient(
            timeout=PROBE_TIMEOUT_SECONDS, trust_env=False, headers=self._headers
        ) as client:
            while True:
                await self.probe_all(client)
                await anyio.sleep(PROBE_INTERVAL_SECONDS)

    async def probe_all(self, client: httpx.AsyncClient) -> None:
        state = self._current_state()
        for peer, info in list(state.node_info.items()):
            if peer != self.node_id and info.api_port:
                await self._probe(client, state, peer, info)

    async def _probe(
        self, client: httpx.AsyncClient, state: State, peer: NodeId, info: NodeInfo
    ) -> None:
        best: TopologyEdge | None = None
        for address in info.api_addresses:
            measured = await measure_link(client, address, info.api_port, peer)
            if measured is None:
                continue
            latency_ms, bandwidth_mbps = measured
            edge = TopologyEdge(
                source=self.node_id,
                sink=peer,
                address=address,
                latency_ms=round(latency_ms, 3),
                bandwidth_mbps=round(bandwidth_mbps, 1),
            )
            if best is None or edge.latency_ms < best.latency_ms:
                best = edge
        known = state.topology.get(self.node_id, {}).get(peer)
        if best is None:
            failures = self._failures.get(peer, 0) + 1
            self._failures[peer] = failures
            if known is not None and failures == FAILURES_BEFORE_REMOVAL:
                logger.info(f"topology: {peer} stopped answering")
                self._local_events.emit(TopologyEdgeRemoved(source=self.node_id, sink=peer))
            return
        self._failures.pop(peer, None)
        if worth_reporting(known, best):
            self._local_events.emit(TopologyEdgeMeasured(edge=best))
