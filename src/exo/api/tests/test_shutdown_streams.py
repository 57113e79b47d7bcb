"""A node that stops while generations stream ends every open stream with its dialect's
in-band error ("the node is shutting down") within uvicorn's graceful-shutdown timeout,
cancels those generations on the cluster, and logs no ASGI exception: the node's API
(`exo.api.main.Api`) over a real `ClusterClient`, a stand-in master and runner, and real
HTTP streams on 127.0.0.1 (`exo.api.tests.stopping_node`)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from exo.api.main import SHUTTING_DOWN_MESSAGE
from exo.api.tests.stopping_node import (
    FIRST_TEXT,
    NODE,
    STREAMS,
    StandIn,
    error_of,
    node,
)
from exo.testing.builders import make_instance, make_state

pytestmark = pytest.mark.anyio

# uvicorn's `timeout_graceful_shutdown` (2 s, `server_config`) plus room for a busy machine.
SHUTDOWN_BOUND_SECONDS = 10.0


async def read_stream(
    client: httpx.AsyncClient, dialect: str, bodies: dict[str, str], started: anyio.Event
) -> None:
    """Stream `dialect`'s request into `bodies[dialect]`; `started` once its first text
    arrived."""
    path, body = STREAMS[dialect]
    bodies[dialect] = ""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for text in response.aiter_text():
            bodies[dialect] += text
            if FIRST_TEXT in bodies[dialect]:
                started.set()


async def test_open_streams_end_with_their_dialects_error_when_the_node_stops() -> None:
    stand_in = StandIn(make_state(instances=[make_instance(NODE)]))
    bodies: dict[str, str] = {}
    async with node(stand_in) as running, anyio.create_task_group() as streams:
        for dialect in STREAMS:
            started = anyio.Event()
            streams.start_soon(read_stream, running.client, dialect, bodies, started)
            await started.wait()
        took = await running.stop()
    assert took < SHUTDOWN_BOUND_SECONDS
    for dialect, body in bodies.items():
        assert FIRST_TEXT in body, dialect
        assert error_of(dialect, body) == SHUTTING_DOWN_MESSAGE, (dialect, body)
    assert len(stand_in.cancelled) == len(STREAMS)  # no generation runs on for a client gone
    assert running.warnings == []
