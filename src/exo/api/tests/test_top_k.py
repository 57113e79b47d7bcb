"""One `top_k` rule across the dialects (README, "Sampling"): k >= 1 keeps the k most likely
tokens, 0 is no top-k filter everywhere, and below 0 each dialect does what its upstream
does — the OpenAI-shaped routes (vLLM's extension) take -1 as "no filter" and refuse less,
Claude refuses any negative (Anthropic: top_k >= 0), Ollama takes any negative as "no
filter" (as Ollama and llama.cpp do). A refusal is a 400 in the dialect's shape naming
`top_k`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.api.tests.field_decisions import (
    BASE_BODIES,
    CHAT,
    CLAUDE,
    COMPLETIONS,
    OLLAMA_CHAT,
    OLLAMA_GENERATE,
    RESPONSES,
)
from exo.testing.scripted_cluster import ScriptedCluster

OPENAI_CHAT_ON_OLLAMA = "/ollama/v1/chat/completions"


@pytest.fixture(scope="module")
def app() -> Iterator[tuple[TestClient, ScriptedCluster]]:
    cluster = ScriptedCluster()
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client, cluster


def with_top_k(endpoint: str, top_k: int) -> dict[str, Any]:
    if endpoint in (OLLAMA_CHAT, OLLAMA_GENERATE):
        base = BASE_BODIES[endpoint]
        return {**base, "options": {**base["options"], "top_k": top_k}}
    base = BASE_BODIES[CHAT if endpoint == OPENAI_CHAT_ON_OLLAMA else endpoint]
    return {**base, "top_k": top_k}


@pytest.mark.parametrize(
    ("endpoint", "top_k", "internal"),
    [
        *[
            (endpoint, top_k, internal)
            for endpoint in (CHAT, OPENAI_CHAT_ON_OLLAMA, COMPLETIONS, RESPONSES)
            for top_k, internal in ((5, 5), (0, 0), (-1, 0))
        ],
        (CLAUDE, 5, 5),
        (CLAUDE, 0, 0),
        *[
            (endpoint, top_k, internal)
            for endpoint in (OLLAMA_CHAT, OLLAMA_GENERATE)
            for top_k, internal in ((5, 5), (0, 0), (-1, 0), (-40, 0))
        ],
    ],
)
def test_accepted_top_k_reaches_the_engine(
    app: tuple[TestClient, ScriptedCluster], endpoint: str, top_k: int, internal: int
) -> None:
    client, cluster = app
    response = client.post(endpoint, json=with_top_k(endpoint, top_k))
    assert response.status_code == 200, response.text
    assert cluster.last_params.top_k == internal


@pytest.mark.parametrize(
    ("endpoint", "top_k"),
    [
        *[
            (endpoint, top_k)
            for endpoint in (CHAT, OPENAI_CHAT_ON_OLLAMA, COMPLETIONS, RESPONSES)
            for top_k in (-2, -1000)
        ],
        (CLAUDE, -1),
        (CLAUDE, -2),
    ],
)
def test_refused_top_k_is_a_400_in_the_dialects_shape_naming_it(
    app: tuple[TestClient, ScriptedCluster], endpoint: str, top_k: int
) -> None:
    client, cluster = app
    submitted = len(cluster.submitted)
    response = client.post(endpoint, json=with_top_k(endpoint, top_k))
    assert response.status_code == 400, response.text
    body = response.json()
    if endpoint == CLAUDE:
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("top_k:")
    else:
        assert body["error"]["type"] == "invalid_request_error"
        assert body["error"]["param"] == "top_k"
        assert "top_k" in body["error"]["message"]
    assert len(cluster.submitted) == submitted
