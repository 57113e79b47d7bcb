"""Ollama's `/api/pull` of a Hugging Face repository no card names adds it as `POST
/models/add` does, then prepares it: on an `--offline` node from a whole copy in the Hugging
Face cache or a models directory (issue 39 item 6: the pull said "not found" where
`/models/add` of the same id worked), and a repository with no copy on disk is a clear
offline error in Ollama's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from exo.api.app import create_app
from exo.api.serving.cluster_client import LoadOnRequest
from exo.api.tests.test_custom_models_routes import hub_cache_copy
from exo.shared.types.common import ModelId
from exo.shared.types.models import HuggingFaceSource
from exo.testing.in_process import InProcessCluster, in_process_cluster
from exo.testing.tiny_models import save_tiny_checkout

pytestmark = pytest.mark.anyio

CACHED = "someone/tiny-cached"
IN_MODELS_DIR = "someone/tiny-copied"
ABSENT = "someone/tiny-absent"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@asynccontextmanager
async def offline_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[InProcessCluster, httpx.AsyncClient, Path]]:
    """An `--offline` node whose Hugging Face cache holds `CACHED` and whose models
    directory holds `IN_MODELS_DIR` (as `<org>--<name>`); yields the cluster, a client of
    its API and the cache."""
    checkout = save_tiny_checkout(tmp_path / "checkout")
    cache = tmp_path / "hf-cache"
    hub_cache_copy(cache, CACHED, checkout, COMMIT)
    models = tmp_path / "models"
    copy = models / IN_MODELS_DIR.replace("/", "--")
    copy.mkdir(parents=True)
    for path in checkout.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("EXO_MODELS_DIRS", str(models))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing may reach a Hub
    offline = LoadOnRequest(offline=True)
    async with in_process_cluster(tmp_path / "node", load_on_request=offline) as running:
        transport = httpx.ASGITransport(app=create_app(running.client))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            yield running, http, cache


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line]


async def test_an_offline_pull_adds_a_repository_from_the_hugging_face_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with offline_node(tmp_path, monkeypatch) as (cluster, http, _cache):
        streamed = await http.post("/ollama/api/pull", json={"model": CACHED})
        assert streamed.status_code == 200, streamed.text
        progress = lines(streamed)
        assert progress[0] == {"status": "pulling manifest"}, progress
        assert progress[-1] == {"status": "success"}, progress
        [files] = [line for line in progress if "digest" in line]
        assert files["total"] == files["completed"] > 0
        card = cluster.client.state.custom_cards[ModelId(CACHED)]
        # Pinned to the cached commit: the files are used where they are.
        assert card.source == HuggingFaceSource(repo_id=CACHED, revision=COMMIT)
        again = await http.post("/ollama/api/pull", json={"model": CACHED, "stream": False})
        assert again.status_code == 200 and again.json() == {"status": "success"}


async def test_an_offline_pull_adds_a_repository_from_a_models_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with offline_node(tmp_path, monkeypatch) as (cluster, http, _cache):
        whole = await http.post("/ollama/api/pull", json={"model": IN_MODELS_DIR, "stream": False})
        assert whole.status_code == 200, whole.text
        assert whole.json() == {"status": "success"}
        assert ModelId(IN_MODELS_DIR) in cluster.client.state.custom_cards


async def test_an_offline_pull_of_a_repository_not_on_disk_says_why_in_ollamas_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with offline_node(tmp_path, monkeypatch) as (cluster, http, cache):
        for body in ({"model": ABSENT}, {"model": ABSENT, "stream": False}):
            refused = await http.post("/ollama/api/pull", json=body)
            assert refused.status_code == 400, refused.text
            (message,) = refused.json().values()
            assert set(refused.json()) == {"error"}
            assert "--offline" in message and "no whole copy" in message, message
            assert str(cache) in message, message
        assert ModelId(ABSENT) not in cluster.client.state.custom_cards
        # A name that is no repository id stays Ollama's plain "not found".
        unknown = await http.post("/ollama/api/pull", json={"model": "no-such-model"})
        assert unknown.status_code == 404
        assert unknown.json() == {"error": "model 'no-such-model' not found"}
