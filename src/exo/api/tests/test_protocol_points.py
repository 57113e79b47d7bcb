"""Small protocol points the session-41 trial found: Ollama's `/api/show` gives a MoE
model's expert counts as Ollama's `model_info` does; a 405 carries `Allow` (RFC 9110), with
every method some route takes at the path; `/v1/models` and `/v1/models/{id}` agree on
`created`, the time this node's copy of the model was written (0 without a copy)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.ollama.model_listings import show_response
from exo.api.routes.session import SESSION_PATH
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.nodes import DownloadCompleted
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import ScriptedCluster

CARDS = load_builtin_cards()


@pytest.fixture
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture
def http(cluster: ScriptedCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client


@pytest.mark.parametrize(
    ("model_id", "family", "experts", "used", "width"),
    [
        ("Qwen/Qwen3-30B-A3B", "qwen3moe", 128, 8, 768),
        ("openai/gpt-oss-20b", "gptoss", 32, 4, 2880),
    ],
)
def test_show_gives_a_moe_models_expert_counts(
    model_id: str, family: str, experts: int, used: int, width: int
) -> None:
    info = show_response(CARDS[ModelId(model_id)], "", "x", False).model_info
    assert info[f"{family}.expert_count"] == experts
    assert info[f"{family}.expert_used_count"] == used
    assert info[f"{family}.expert_feed_forward_length"] == width


def test_show_gives_no_expert_keys_for_a_dense_model(http: TestClient) -> None:
    info = http.post("/ollama/api/show", json={"model": SMOLLM2}).json()["model_info"]
    assert not [key for key in info if ".expert_" in key]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/models", "GET, HEAD"),
        ("GET", "/v1/messages", "POST"),
        ("GET", "/ollama/api/chat", "POST"),
        ("POST", "/api/tags", "GET, HEAD"),  # Ollama's root path
        ("PUT", "/ollama/api/version", "GET, HEAD"),  # a GET route and a HEAD route
        ("PUT", SESSION_PATH, "POST, DELETE"),  # two routes share the path
    ],
)
def test_a_405_says_which_methods_the_path_takes(
    http: TestClient, method: str, path: str, allow: str
) -> None:
    response = http.request(method, path)
    assert response.status_code == 405
    assert response.headers["Allow"] == allow


def test_models_list_and_retrieve_agree_on_created(
    cluster: ScriptedCluster, http: TestClient, tmp_path: Path
) -> None:
    def created() -> tuple[int, int]:
        listed = {model["id"]: model for model in http.get("/v1/models").json()["data"]}
        retrieved = http.get(f"/v1/models/{SMOLLM2}").json()
        return listed[SMOLLM2]["created"], retrieved["created"]

    assert created() == (0, 0)  # no copy on this node: nothing known
    copy = tmp_path / "smollm2"
    copy.mkdir()
    written = 1_780_000_000
    os.utime(copy, (written, written))
    cluster.state = make_state(
        instances=[make_instance(cluster.node_id)],
        downloads={cluster.node_id: {SMOLLM2: DownloadCompleted(path=str(copy))}},
    )
    assert created() == (written, written)
    show = http.post("/ollama/api/show", json={"model": SMOLLM2}).json()
    assert show["modified_at"].startswith("2026-05-28T")  # the same time, as Ollama's
