"""Model files from a peer: node A (its API's file route, served on loopback) holds a model
it downloaded; node B fetches it from A with no request to the Hub, verified; when A stops
in the middle of a file, B finishes that file from the Hub, resuming where A stopped. A's
route serves only verified files, only to holders of the cluster's credential."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.download.completion import read_marker
from exo.download.fetch import RetryPolicy
from exo.download.hub_download import HubDownload, download_from_hub
from exo.download.peers import (
    PEER_CREDENTIAL_HEADER,
    PeerSource,
    peer_credential,
    peers_holding,
)
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.nodes import DownloadCompleted, TopologyEdge
from exo.testing.builders import make_node_info, make_state
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.scripted_cluster import ScriptedCluster

REPO = "someone/tiny-peer"
NAMESPACE = "test-cluster"
NODE_A = NodeId("node-a")
LAYERS_2_3 = "model-00003-of-00004.safetensors"
CUT_AFTER_BYTES = 5000
NO_WAIT = RetryPolicy(max_attempts=3, base_delay_seconds=0.0)
START_TIMEOUT_SECONDS = 10.0


@dataclass
class CutOnce:
    """ASGI wrapper: the first response for `path_suffix` stops after `after_bytes` bytes
    of its body and, from then on, the node is gone (its server shuts down and every
    request is dropped)."""

    app: Any
    path_suffix: str
    after_bytes: int
    server: uvicorn.Server | None = None
    gone: threading.Event = field(default_factory=threading.Event)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.gone.is_set():
            raise ConnectionAbortedError("node A is gone")
        if scope["type"] != "http" or not scope["path"].endswith(self.path_suffix):
            await self.app(scope, receive, send)
            return
        sent = 0

        async def cutting_send(message: Any) -> None:
            nonlocal sent
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if sent + len(body) >= self.after_bytes:
                    await send(
                        {**message, "body": body[: self.after_bytes - sent], "more_body": True}
                    )
                    self.gone.set()
                    if self.server is not None:
                        self.server.should_exit = True
                    raise ConnectionAbortedError("node A stopped mid-file")
                sent += len(body)
            await send(message)

        await self.app(scope, receive, cutting_send)


@dataclass
class ServedNode:
    url: str
    server: uvicorn.Server
    thread: threading.Thread


def serve(app: Any) -> ServedNode:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    if isinstance(app, CutOnce):
        app.server = server
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "node A did not start"
        time.sleep(0.01)
    return ServedNode(f"http://127.0.0.1:{port}", server, thread)


def node_a_app() -> FastAPI:
    """Node A's real API app (its cluster a stand-in: the file route does not use it)."""
    app = create_app(cast(ClusterClient, ScriptedCluster()))
    app.state.peer_namespace = NAMESPACE
    return app


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_layered_checkout(tmp_path_factory.mktemp("peer") / "repo")


@pytest.fixture
def hub(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(REPO, checkout)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield server


@pytest.fixture
def node_a_models(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Node A's models directory, holding the whole model (downloaded from the Hub)."""
    models = tmp_path / "node-a"
    download_from_hub(HubDownload(REPO, REPO, "main", None, models / "someone--tiny-peer"))
    monkeypatch.setenv("EXO_MODELS_DIRS", str(models))
    monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
    return models


def peer(url: str) -> PeerSource:
    return PeerSource(NODE_A, url, peer_credential(NAMESPACE))


def same_files(left: Path, right: Path, names: set[str]) -> bool:
    return all(
        hashlib.sha256((left / name).read_bytes()).digest()
        == hashlib.sha256((right / name).read_bytes()).digest()
        for name in names
    )


def test_b_gets_the_model_from_a_with_no_request_to_the_hub(
    hub: HubServer, node_a_models: Path, checkout: Path, tmp_path: Path
) -> None:
    node_a = serve(node_a_app())
    try:
        before = len(hub.requests)
        reports: list[DownloadProgress] = []
        target = tmp_path / "node-b" / "someone--tiny-peer"
        download_from_hub(
            HubDownload(REPO, REPO, "main", None, target),
            on_progress=reports.append,
            peers=[peer(node_a.url)],
            policy=NO_WAIT,
        )
    finally:
        node_a.server.should_exit = True
        node_a.thread.join(START_TIMEOUT_SECONDS)
    assert hub.requests[before:] == []
    marker = read_marker(target)
    assert marker is not None
    assert marker["files"] == read_marker(node_a_models / "someone--tiny-peer")["files"]  # type: ignore[index]
    assert same_files(target, checkout, set(marker["files"]))
    assert {file.source for file in reports[-1].files} == {"peer:node-a"}


def test_when_a_stops_mid_file_b_finishes_it_from_the_hub(
    hub: HubServer, node_a_models: Path, checkout: Path, tmp_path: Path
) -> None:
    cutting = CutOnce(node_a_app(), LAYERS_2_3, CUT_AFTER_BYTES)
    node_a = serve(cutting)
    try:
        before = len(hub.requests)
        target = tmp_path / "node-b" / "someone--tiny-peer"
        download_from_hub(
            HubDownload(REPO, REPO, "main", None, target),
            peers=[peer(node_a.url)],
            policy=NO_WAIT,
            max_parallel=1,
        )
    finally:
        node_a.server.should_exit = True
        node_a.thread.join(START_TIMEOUT_SECONDS)
    assert cutting.gone.is_set()
    from_hub = [r for r in hub.requests[before:] if r.method == "GET" and r.filename]
    # Files after the cut come from the Hub; the cut one resumes where A stopped.
    assert (LAYERS_2_3, f"bytes={CUT_AFTER_BYTES}-") in {(r.filename, r.range) for r in from_hub}
    marker = read_marker(target)
    assert marker is not None
    assert same_files(target, checkout, set(marker["files"]))


def test_files_come_from_several_peers_at_once(
    hub: HubServer, node_a_models: Path, checkout: Path, tmp_path: Path
) -> None:
    nodes = [serve(node_a_app()), serve(node_a_app())]  # two nodes holding the model
    sources = [
        PeerSource(NodeId(f"node-{index}"), node.url, peer_credential(NAMESPACE))
        for index, node in enumerate(nodes)
    ]
    try:
        before = len(hub.requests)
        reports: list[DownloadProgress] = []
        target = tmp_path / "node-b" / "someone--tiny-peer"
        download_from_hub(
            HubDownload(REPO, REPO, "main", None, target),
            on_progress=reports.append,
            peers=sources,
            policy=NO_WAIT,
        )
    finally:
        for node in nodes:
            node.server.should_exit = True
            node.thread.join(START_TIMEOUT_SECONDS)
    assert hub.requests[before:] == []
    weights = [file for file in reports[-1].files if file.path.endswith(".safetensors")]
    assert {file.source for file in weights} == {"peer:node-0", "peer:node-1"}
    marker = read_marker(target)
    assert marker is not None
    assert same_files(target, checkout, set(marker["files"]))


def test_a_serves_only_verified_files_and_only_to_the_cluster(
    node_a_models: Path,
) -> None:
    directory = node_a_models / "someone--tiny-peer"
    (directory / "notes.txt").write_text("not part of the download")
    (directory / (LAYERS_2_3 + ".partial")).write_bytes(b"half")
    node_a = serve(node_a_app())
    try:
        with httpx.Client(base_url=node_a.url) as client:
            good = {PEER_CREDENTIAL_HEADER: peer_credential(NAMESPACE)}
            wrong = {PEER_CREDENTIAL_HEADER: peer_credential("another-cluster")}
            url = f"/peer/files/someone--tiny-peer/{LAYERS_2_3}"
            assert client.get(url).status_code == 403
            assert client.get(url, headers=wrong).status_code == 403
            whole = client.get(url, headers=good)
            assert whole.status_code == 200
            assert whole.content == (directory / LAYERS_2_3).read_bytes()
            part = client.get(url, headers={**good, "Range": "bytes=10-19"})
            assert part.status_code == 206 and part.content == whole.content[10:20]
            for path in ("notes.txt", f"{LAYERS_2_3}.partial", "../../etc/passwd"):
                assert (
                    client.get(f"/peer/files/someone--tiny-peer/{path}", headers=good).status_code
                    == 404
                )
            assert (
                client.get("/peer/files/nobody--none/config.json", headers=good).status_code == 404
            )
    finally:
        node_a.server.should_exit = True
        node_a.thread.join(START_TIMEOUT_SECONDS)


def test_peers_are_the_nodes_holding_the_model_fastest_link_first() -> None:
    model = ModelId(REPO)
    nodes = {NodeId(name): make_node_info(1000) for name in ("me", "fast", "slow", "none", "far")}
    nodes = {
        node_id: info.model_copy(update={"api_port": 52415, "api_addresses": (f"10.0.0.{i}",)})
        for i, (node_id, info) in enumerate(nodes.items())
    }
    done = DownloadCompleted(path="/models/x")
    state = make_state(
        nodes=nodes,
        downloads={NodeId(name): {model: done} for name in ("me", "fast", "slow", "far")},
    )

    def edge(sink: str, mbps: float) -> TopologyEdge:
        return TopologyEdge(
            source=NodeId("me"), sink=NodeId(sink), address=f"10.1.0.{len(sink)}",
            latency_ms=1.0, bandwidth_mbps=mbps,
        )  # fmt: skip

    state = state.model_copy(
        update={
            "topology": {
                NodeId("me"): {NodeId(n): edge(n, b) for n, b in (("fast", 900.0), ("slow", 5.0))}
            }
        }
    )
    found = peers_holding(state, NodeId("me"), model, "credential", hub_mbps=50.0)
    assert [(p.node_id, p.base_url) for p in found] == [
        ("fast", "http://10.1.0.4:52415"),
        ("far", "http://10.0.0.4:52415"),
    ]
