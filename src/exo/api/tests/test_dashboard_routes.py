"""The dashboard's routes through a real uvicorn server on loopback, a real cluster client and
a real master: the page and its files under the Content-Security-Policy, the page for
browser navigations and JSON 404s for the API, and the `/events` stream."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import jsonpatch
import pytest
import uvicorn
from fastapi import FastAPI

from exo.api.app import create_app
from exo.api.main import bind_api_socket
from exo.api.routes.dashboard import (
    CONTENT_SECURITY_POLICY,
    STATIC_DIR,
    DashboardFiles,
    close_event_streams,
)
from exo.shared.types.common import NodeId
from exo.testing.builders import SMOLLM2
from exo.testing.in_process import InProcessCluster, in_process_cluster

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 10
HTML = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}


@dataclass
class Served:
    cluster: InProcessCluster
    app: FastAPI
    url: str


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    """The app on a real server (streams are read as a browser reads them)."""
    async with in_process_cluster(tmp_path) as cluster:
        app = create_app(cluster.client)
        listener = bind_api_socket("127.0.0.1", 0)  # the node's own listening socket
        port = listener.getsockname()[1]
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        )
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(server.serve, [listener])
            with anyio.fail_after(DEADLINE_SECONDS):
                while not server.started:
                    await anyio.sleep(0.01)
            yield Served(cluster, app, f"http://127.0.0.1:{port}")
            close_event_streams(app)
            server.should_exit = True
        listener.close()


def client(served: Served) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=served.url, timeout=DEADLINE_SECONDS)


def assert_secured(response: httpx.Response) -> None:
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["referrer-policy"] == "no-referrer"


def test_the_policy_allows_nothing_inline() -> None:
    directives = dict(
        part.strip().partition(" ")[::2] for part in CONTENT_SECURITY_POLICY.split(";")
    )
    assert directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'"
    assert directives["object-src"] == "'none'"
    assert directives["frame-ancestors"] == "'none'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY


async def test_the_page_is_served_at_the_root_with_the_policy(served: Served) -> None:
    async with client(served) as http:
        page = await http.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        assert page.headers["cache-control"] == "no-cache"
        assert page.text == (STATIC_DIR / "index.html").read_text(encoding="utf-8")
        assert_secured(page)
        # Revalidation: unchanged, it is a 304 with the policy still on it.
        again = await http.get("/", headers={"if-none-match": page.headers["etag"]})
        assert again.status_code == 304
        assert_secured(again)
        head = await http.head("/")
        assert head.status_code == 200
        assert head.content == b""
        assert_secured(head)


def referenced_files(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(/static/[^"]+)"', html)


async def test_every_file_the_page_names_is_served_with_its_type(served: Served) -> None:
    """The files the installed package ships: what `index.html` references exists."""
    html = (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    names = referenced_files(html)
    assert any(name.endswith(".js") for name in names), names
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    async with client(served) as http:
        for name in names:
            response = await http.get(name)
            assert response.status_code == 200, name
            suffix = Path(name).suffix
            if suffix in types:
                assert response.headers["content-type"].split(";")[0] == types[suffix], name
            assert_secured(response)


async def test_file_types_are_fixed_and_missing_files_are_plain_404s(
    served: Served, tmp_path: Path
) -> None:
    directory = tmp_path / "static"
    (directory / "sub").mkdir(parents=True)
    (directory / "index.html").write_text("<!doctype html><title>t</title>")
    files = {
        "app.js": "text/javascript; charset=utf-8",
        "sub/module.mjs": "text/javascript; charset=utf-8",
        "app.css": "text/css; charset=utf-8",
        "icon.svg": "image/svg+xml",
        "data.json": "application/json",
        "font.woff2": "font/woff2",
        "LICENSE.txt": "text/plain; charset=utf-8",
    }
    for name in files:
        (directory / name).write_bytes(b"x")
    (tmp_path / "secret.txt").write_text("outside the static directory")
    served.app.state.dashboard_files = DashboardFiles(directory=directory)
    async with client(served) as http:
        for name, media_type in files.items():
            response = await http.get(f"/static/{name}")
            assert response.status_code == 200, name
            assert response.headers["content-type"] == media_type
            assert response.headers["cache-control"] == "no-cache"
            assert "etag" in response.headers
            assert_secured(response)
        missing = await http.get("/static/nothing.js", headers=HTML)
        assert missing.status_code == 404
        assert missing.headers["content-type"].startswith("text/plain")
        assert_secured(missing)
        escaped = await http.get("/static/%2e%2e/secret.txt")
        assert escaped.status_code == 404
        assert "outside" not in escaped.text
        posted = await http.post("/static/app.js")
        assert posted.status_code == 405


async def test_large_files_are_gzipped_for_clients_that_accept_it(
    served: Served, tmp_path: Path
) -> None:
    script = "export const answer = 42;\n" * 400  # 10 KB
    (tmp_path / "big.js").write_text(script)
    (tmp_path / "index.html").write_text("<!doctype html>")
    served.app.state.dashboard_files = DashboardFiles(directory=tmp_path)
    async with client(served) as http:
        compressed = await http.get("/static/big.js", headers={"accept-encoding": "gzip"})
        assert compressed.headers["content-encoding"] == "gzip"
        assert int(compressed.headers["content-length"]) < len(script) / 10
        assert compressed.text == script  # httpx decodes it
        assert compressed.headers["content-type"] == "text/javascript; charset=utf-8"
        assert_secured(compressed)
        plain = await http.get("/static/big.js", headers={"accept-encoding": "identity"})
        assert "content-encoding" not in plain.headers
        assert plain.text == script


@pytest.mark.parametrize("path", ["/chat", "/ui/cluster/node-1", "/a/b/c", "/favicon-x"])
async def test_browser_navigations_get_the_page(served: Served, path: str) -> None:
    async with client(served) as http:
        response = await http.get(path, headers=HTML)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "<html" in response.text.lower()
    assert_secured(response)


@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        # Under an API route's first segment: the API's 404 even for a browser.
        ("GET", "/v1/nothing", HTML),
        ("GET", "/ollama/api/nothing", HTML),
        ("GET", "/models/nothing/here", HTML),
        ("GET", "/state/x", HTML),
        ("GET", "/cluster/node-1", HTML),
        ("GET", "/peer/nothing", HTML),
        # Not a browser navigation.
        ("GET", "/chat", {"accept": "application/json"}),
        ("GET", "/chat", {}),
        ("POST", "/chat", HTML),
        ("DELETE", "/somewhere", HTML),
    ],
)
async def test_api_404s_keep_their_json_shape(
    served: Served, method: str, path: str, headers: dict[str, str]
) -> None:
    async with client(served) as http:
        response = await http.request(method, path, headers=headers)
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]  # each dialect's own shape: OpenAI's, Ollama's
    assert "Not Found" in json.dumps(error)


async def test_routes_added_after_the_dashboard_are_the_apis(served: Served) -> None:
    """The API's segments are read from the app's routes when a 404 happens."""

    @served.app.get("/later/known")
    async def later() -> dict[str, str]:
        return {"ok": "yes"}

    async with client(served) as http:
        response = await http.get("/later/unknown", headers=HTML)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "Not Found"


async def test_cors_answers_are_unchanged_beside_the_policy(served: Served) -> None:
    origin = "http://localhost:3000"
    async with client(served) as http:
        preflight = await http.options(
            "/v1/chat/completions",
            headers={"origin": origin, "access-control-request-method": "POST"},
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        page = await http.get("/", headers={"origin": origin})
        assert page.headers["access-control-allow-origin"] == origin
        assert_secured(page)
        refused = await http.get("/", headers={"origin": "https://evil.example"})
        assert refused.status_code == 403


class EventReader:
    """The messages of one `/events` response, as a browser's EventSource sees them:
    ("snapshot" | "patch", data), ("comment", line), ("retry", milliseconds)."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()
        self.messages: list[tuple[str, Any]] = []

    async def next_data(self) -> tuple[str, Any]:
        """The next snapshot or patch (comments and `retry` are kept in `messages`)."""
        event = ""
        async for line in self._lines:
            if line.startswith(":"):
                self.messages.append(("comment", line))
            elif line.startswith("retry:"):
                self.messages.append(("retry", int(line.removeprefix("retry:"))))
            elif line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                self.messages.append((event, json.loads(line.removeprefix("data: "))))
                return self.messages[-1]
        raise EOFError("the stream ended")

    async def rest(self) -> list[str]:
        return [line async for line in self._lines]


async def test_events_stream_a_snapshot_then_patches_that_rebuild_the_state(
    served: Served,
) -> None:
    async with client(served) as http, http.stream("GET", "/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        assert "content-length" not in response.headers
        assert_secured(response)
        reader = EventReader(response)
        with anyio.fail_after(DEADLINE_SECONDS):
            name, snapshot = await reader.next_data()
            assert reader.messages[0] == ("retry", 2000)
            assert name == "snapshot"
            assert snapshot["state"] == (await http.get("/state")).json()
            assert snapshot["index"] == snapshot["state"]["last_event_applied_idx"]
            held = snapshot["state"]

            # A node reports and a model is placed on it: the state changes several times.
            served.cluster.report_node()
            placed = await http.post("/place_instance", json={"model_id": SMOLLM2})
            assert placed.status_code == 200, placed.text
            instance_id = placed.json()["instance_id"]
            while instance_id not in held["instances"]:
                name, data = await reader.next_data()
                assert name == "patch"
                held = jsonpatch.apply_patch(held, data["patch"])
                assert held["last_event_applied_idx"] == data["index"]
        assert held == (await http.get("/state")).json()
        assert NodeId("node-1") in held["node_info"]


async def test_a_client_that_leaves_ends_its_stream(served: Served) -> None:
    streams = served.app.state.event_streams
    async with client(served) as http:
        async with http.stream("GET", "/events") as response:
            with anyio.fail_after(DEADLINE_SECONDS):
                await EventReader(response).next_data()
            assert len(streams) == 1
        # Left while the server waits for the next change (none comes).
        with anyio.fail_after(DEADLINE_SECONDS):
            while streams:
                await anyio.sleep(0.02)


async def test_a_stopping_server_ends_open_streams_cleanly(served: Served) -> None:
    async with client(served) as http, http.stream("GET", "/events") as response:
        reader = EventReader(response)
        with anyio.fail_after(DEADLINE_SECONDS):
            await reader.next_data()
            close_event_streams(served.app)
            # The response ends properly: the client reads to the end of the body.
            assert [line for line in await reader.rest() if line] == []
    assert not served.app.state.event_streams


async def test_a_client_that_does_not_read_gets_coalesced_patches(served: Served) -> None:
    """While a client is not reading, changes do not queue up per event: it gets at most
    one patch per interval, and they still rebuild the state."""
    async with client(served) as http, http.stream("GET", "/events") as response:
        reader = EventReader(response)
        with anyio.fail_after(DEADLINE_SECONDS):
            _, snapshot = await reader.next_data()
        before = served.cluster.state.last_event_applied_idx
        started = anyio.current_time()
        for available_mb in range(1000, 1200):
            served.cluster.report_node(available_mb=available_mb)
        with anyio.fail_after(DEADLINE_SECONDS):
            while served.cluster.state.last_event_applied_idx < before + 200:
                await anyio.sleep(0.01)
        held = snapshot["state"]
        target = (await http.get("/state")).json()
        with anyio.fail_after(DEADLINE_SECONDS):
            while held != target:
                name, data = await reader.next_data()
                assert name == "patch"
                held = jsonpatch.apply_patch(held, data["patch"])
        elapsed = anyio.current_time() - started
    patches = [message for message in reader.messages if message[0] == "patch"]
    # 200 events; one patch per 200 ms at most (plus the first, sent at once).
    assert len(patches) <= elapsed / 0.2 + 2, (len(patches), elapsed)
