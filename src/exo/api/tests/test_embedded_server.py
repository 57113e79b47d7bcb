"""The node's uvicorn server wakes once a second when idle, not ten times, and still stops
as soon as it is told to and refreshes the `date` header every second."""

from __future__ import annotations

import anyio
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from exo.api import main as api_main
from exo.api.main import _EmbeddedServer, bind_api_socket


def hello_app() -> Starlette:
    async def hello(_: object) -> PlainTextResponse:
        return PlainTextResponse("hi")

    return Starlette(routes=[Route("/", hello)])


@pytest.mark.anyio
async def test_should_exit_stops_the_server_without_waiting_for_a_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a tick of an hour, only the wake-up on `should_exit` can end the loop in time.
    monkeypatch.setattr(api_main, "SERVER_TICK_SECONDS", 3600.0)
    listener = bind_api_socket("127.0.0.1", 0)
    port = listener.getsockname()[1]
    server = _EmbeddedServer(uvicorn.Config(hello_app(), lifespan="off", log_level="warning"))
    ticks: list[int] = []
    on_tick = server.on_tick

    async def recording_on_tick(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    monkeypatch.setattr(server, "on_tick", recording_on_tick)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(server.serve, [listener])
            while not server.started:
                await anyio.sleep(0.01)
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://127.0.0.1:{port}/")
            assert response.text == "hi"
            assert any(name == b"date" for name, _ in server.server_state.default_headers)
            server.should_exit = True
    assert ticks == [0, 10]  # the first tick, then the one that saw `should_exit`


@pytest.mark.anyio
async def test_every_tick_refreshes_the_date_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvicorn refreshes `date` on ticks that are multiples of 10 (once a second)."""
    monkeypatch.setattr(api_main, "SERVER_TICK_SECONDS", 0.01)
    server = _EmbeddedServer(uvicorn.Config(hello_app(), lifespan="off", log_level="warning"))
    ticks: list[int] = []

    async def recording_on_tick(counter: int) -> bool:
        ticks.append(counter)
        return len(ticks) == 5

    monkeypatch.setattr(server, "on_tick", recording_on_tick)
    with anyio.fail_after(30):
        await server.main_loop()
    assert ticks == [0, 10, 20, 30, 40]
