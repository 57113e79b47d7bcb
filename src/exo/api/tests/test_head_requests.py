"""HEAD on the API's GET routes (`exo.api.routes.head_requests`): answered as GET without a
body on every route, and at once on an endless stream. Through the real app with a stand-in
cluster."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.testing.scripted_cluster import ScriptedCluster


@pytest.fixture
def http() -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, ScriptedCluster()))) as client:
        yield client


@pytest.mark.parametrize(
    "path",
    ["/", "/api/version", "/api/tags", "/ollama", "/ollama/api/ps", "/v1/models", "/state",
     "/models", "/node_id", "/openapi.json"],
)  # fmt: skip
def test_head_is_answered_on_every_get_route(http: TestClient, path: str) -> None:
    get = http.get(path)
    head = http.head(path)
    assert head.status_code == get.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_every_get_route_answers_head() -> None:
    from fastapi.routing import APIRoute

    app = create_app(cast(ClusterClient, ScriptedCluster()))
    get_paths = [
        route.path
        for route in app.routes
        if isinstance(route, APIRoute) and "GET" in (route.methods or ()) and "{" not in route.path
    ]
    with TestClient(app) as http:
        for path in get_paths:
            if path == "/events":
                continue  # needs a live cluster state: the endless stream is checked below
            assert http.head(path).status_code != 405, path


def test_head_on_an_endless_stream_ends_once_its_headers_are_out() -> None:
    import anyio
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from exo.api.routes.head_requests import HeadAsGetMiddleware

    app = FastAPI()

    @app.get("/forever")
    async def forever() -> StreamingResponse:
        async def lines() -> AsyncIterator[str]:
            while True:
                yield "tick\n"
                await anyio.sleep(0.01)

        return StreamingResponse(lines(), media_type="text/event-stream")

    app.add_middleware(HeadAsGetMiddleware)
    with TestClient(app) as http:
        answer = http.head("/forever")
    assert answer.status_code == 200 and answer.content == b""
    assert answer.headers["content-type"].startswith("text/event-stream")
