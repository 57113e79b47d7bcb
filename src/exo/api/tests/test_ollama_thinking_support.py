"""`think` on a model that cannot think: Ollama's `/api/chat` and `/api/generate` answer
400 `"<model>" does not support thinking` (the model named as sent), as Ollama does for a
model without the "thinking" capability; `think: false` is accepted, and a thinking model
takes `true` or a level. The other dialects' switches stay no-ops on such a model
(docs/compatibility.md): agent clients send them on every request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

QWEN3 = "Qwen/Qwen3-0.6B"  # its card says "thinking"
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def app() -> Iterator[tuple[TestClient, ScriptedCluster]]:
    cluster = ScriptedCluster()
    cluster.add_model(load_builtin_cards()[ModelId(QWEN3)])
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client, cluster


def _body(route: str, model: str, think: Any) -> dict[str, Any]:
    text = {"messages": USER} if route.endswith("chat") else {"prompt": "Hi"}
    return {"model": model, "stream": False, "think": think, **text}


@pytest.mark.parametrize("route", ["/ollama/api/chat", "/api/generate", "/api/chat"])
@pytest.mark.parametrize("think", [True, "high"])
def test_think_on_a_model_that_cannot_think_is_ollamas_400(
    app: tuple[TestClient, ScriptedCluster], route: str, think: Any
) -> None:
    client, cluster = app
    for name in (SMOLLM2, "smollm2:135m"):
        response = client.post(route, json=_body(route, name, think))
        assert response.status_code == 400, response.text
        assert response.json() == {"error": f'"{name}" does not support thinking'}
    assert cluster.submitted == []


@pytest.mark.parametrize("route", ["/ollama/api/chat", "/ollama/api/generate"])
def test_think_false_or_a_thinking_model_is_served(
    app: tuple[TestClient, ScriptedCluster], route: str
) -> None:
    client, cluster = app
    assert client.post(route, json=_body(route, SMOLLM2, False)).status_code == 200
    assert cluster.last_params.enable_thinking is False
    assert client.post(route, json=_body(route, QWEN3, "low")).status_code == 200
    assert (cluster.last_params.enable_thinking, cluster.last_params.reasoning_effort) == (
        True,
        "low",
    )


def test_the_other_dialects_switches_are_no_ops_on_it(
    app: tuple[TestClient, ScriptedCluster],
) -> None:
    client, _cluster = app
    claude = {"model": SMOLLM2, "max_tokens": 8, "messages": USER}
    claude["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    assert client.post("/v1/messages", json=claude).status_code == 200
    chat = {"model": SMOLLM2, "messages": USER, "reasoning_effort": "high"}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
