"""Two real `exo` nodes on loopback: node A downloads a model from the loopback Hub; node
B, asked for the same model, gets every file from A with no request to the Hub, verified,
and serves it. (A stopping mid-file, with B finishing from the Hub, is checked against A's
real file route in `exo/download/tests/test_peer_transfer.py`.)"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.processes import ExoNode, wait_until

REPO = "someone/tiny-peer"
DIRECTORY = "someone--tiny-peer"
FORM_TIMEOUT_SECONDS = 30.0
DOWNLOAD_TIMEOUT_SECONDS = 60.0
READY_TIMEOUT_SECONDS = 120.0


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return save_layered_checkout(tmp_path / "checkout")


@pytest.fixture
def hub(checkout: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(REPO, checkout)
        yield server


def download_status(node: ExoNode, of: ExoNode) -> dict[str, Any] | None:
    status: dict[str, Any] | None = node.state()["downloads"].get(of.node_id(), {}).get(REPO)
    return status


def completed(node: ExoNode, of: ExoNode) -> bool:
    status = download_status(node, of)
    return status is not None and status["kind"] == "DownloadCompleted"


def test_b_gets_a_model_from_a_with_no_request_to_the_hub(
    tmp_path: Path, hub: HubServer, checkout: Path
) -> None:
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "OLLAMA_MODELS": str(tmp_path / "no-ollama"),
    }
    first = ExoNode(tmp_path / "a", tmp_path / "a-models", ("--no-default-model",), env=env)
    second = ExoNode(
        tmp_path / "b",
        tmp_path / "b-models",
        ("--no-default-model",),
        env=env,
        namespace=first.namespace,
        bootstrap=(first,),
    )
    try:
        for node in (first, second):
            node.launch()
        for node in (first, second):
            node.wait_api()
        wait_until(
            lambda: (
                len({n.cluster()["master"] for n in (first, second)} - {None}) == 1
                and len(second.state()["node_info"]) == 2
            ),
            FORM_TIMEOUT_SECONDS,
            what="one cluster",
        )
        added = httpx.post(f"{first.url}/models/add", json={"model_id": REPO}, timeout=60)
        assert added.status_code == 200, added.text
        started = httpx.post(f"{first.url}/download/start", json={"model": REPO}, timeout=30)
        assert started.status_code == 200, started.text
        wait_until(lambda: completed(second, first), DOWNLOAD_TIMEOUT_SECONDS, what="A's copy")
        hub_requests = len(hub.requests)
        on_b = httpx.post(
            f"{first.url}/download/start",
            json={"model": REPO, "node_id": second.node_id()},
            timeout=30,
        )
        assert on_b.status_code == 200, on_b.text
        wait_until(lambda: completed(first, second), DOWNLOAD_TIMEOUT_SECONDS, what="B's copy")
        assert hub.requests[hub_requests:] == []
        copied = tmp_path / "b-models" / DIRECTORY
        files = {path.name for path in checkout.iterdir() if path.is_file()}
        assert files <= {path.name for path in copied.iterdir()}
        for name in files:
            assert (
                hashlib.sha256((copied / name).read_bytes()).digest()
                == hashlib.sha256((checkout / name).read_bytes()).digest()
            ), name
        # B serves it from the files it got from A.
        placed = httpx.post(
            f"{first.url}/place_instance",
            json={"model_id": REPO, "node_ids": [second.node_id()]},
            timeout=60,
        )
        assert placed.status_code == 200, placed.text
        second.wait_ready(REPO, timeout=READY_TIMEOUT_SECONDS)
        completion = httpx.post(
            f"{second.url}/v1/completions",
            json={"model": REPO, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 4
        assert hub.requests[hub_requests:] == []
    finally:
        for node in (second, first):
            node.stop()
