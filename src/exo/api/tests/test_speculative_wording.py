"""A bad `speculative` value (exo's extension: `true`, `false` or `"auto"`) is refused in
every dialect with a sentence that says what it takes, in the dialect's own form: OpenAI's
"Invalid type for 'speculative': ..." (code `invalid_type`; a string other than "auto" is
its "Invalid value: ..." with code `invalid_value`), Anthropic's pydantic-style
sentence, Ollama's `Options.FromMap` sentence for an option of the wrong type."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

USER = [{"role": "user", "content": "hi"}]
ACCEPTED = 'true, false or "auto"'
OPENAI_ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": USER},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
}
BAD_VALUES = [("yes", "a string"), (2, "an integer"), ([True], "an array")]
BAD_TYPES = [(value, kind) for value, kind in BAD_VALUES if not isinstance(value, str)]


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, ScriptedCluster()))) as client:
        yield client


@pytest.mark.parametrize("route", list(OPENAI_ROUTES))
@pytest.mark.parametrize(("value", "kind"), BAD_TYPES)
def test_openai_routes_say_what_speculative_takes(
    http: TestClient, route: str, value: Any, kind: str
) -> None:
    body = {"model": SMOLLM2, "speculative": value, **OPENAI_ROUTES[route]}
    response = http.post(route, json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"Invalid type for 'speculative': expected {ACCEPTED}, but got {kind} instead.",
        "type": "invalid_request_error",
        "param": "speculative",
        "code": "invalid_type",
    }


@pytest.mark.parametrize("route", list(OPENAI_ROUTES))
def test_openai_routes_call_another_string_a_value_outside_the_set(
    http: TestClient, route: str
) -> None:
    """A string other than "auto" is the right type with a value outside the set: OpenAI's
    `invalid_value` sentence ("expected true, false or "auto", but got a string" read as if
    "auto" were not a string; trial 44)."""
    body = {"model": SMOLLM2, "speculative": "yes", **OPENAI_ROUTES[route]}
    response = http.post(route, json=body)
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": "Invalid value: 'yes'. Supported values are: true, false, and 'auto'.",
        "type": "invalid_request_error",
        "param": "speculative",
        "code": "invalid_value",
    }


@pytest.mark.parametrize(("value", "_kind"), BAD_VALUES)
def test_claude_and_ollama_say_what_speculative_takes(
    http: TestClient, value: Any, _kind: str
) -> None:
    claude = http.post(
        "/v1/messages",
        json={"model": SMOLLM2, "max_tokens": 4, "messages": USER, "speculative": value},
    )
    assert claude.status_code == 400
    assert claude.json()["error"]["message"] == f"speculative: Input should be {ACCEPTED}"
    for route in ("/ollama/api/chat", "/api/generate"):
        text = {"messages": USER} if route.endswith("chat") else {"prompt": "hi"}
        body = {"model": SMOLLM2, "stream": False, "options": {"speculative": value}, **text}
        ollama = http.post(route, json=body)
        assert ollama.status_code == 400
        assert ollama.json() == {"error": f'option "speculative" must be {ACCEPTED}'}


@pytest.mark.parametrize("value", [True, False, "auto"])
def test_the_values_it_takes_are_accepted(http: TestClient, value: Any) -> None:
    body = {"model": SMOLLM2, "speculative": value, "messages": USER}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
