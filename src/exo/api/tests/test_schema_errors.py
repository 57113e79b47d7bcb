"""A body that does not match the schema is a 400 in every dialect (OpenAI's own answer is
400 `invalid_request_error`, not FastAPI's 422), and the OpenAPI document says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    # Validation runs before any handler: no request below reaches the cluster.
    with TestClient(create_app(cast(ClusterClient, object()))) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
        ("/ollama/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/responses", {"model": MODEL}, "input"),
        ("/v1/responses", {"model": MODEL, "input": 42}, "input"),
        ("/place_instance", {}, "model_id"),
        ("/place_instance", {"model_id": MODEL, "min_nodes": 0}, "min_nodes"),
        ("/place_instance", {"model_id": MODEL, "min_nodes": "2"}, "min_nodes"),
    ],
)
def test_openai_shaped_routes_answer_400_invalid_request_error(
    http: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/messages", {"model": MODEL, "max_tokens": 8}), ("/ollama/api/chat", {"messages": []})],
)
def test_other_dialects_keep_their_400(http: TestClient, path: str, body: dict[str, Any]) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text


def test_openapi_documents_400_and_never_422(http: TestClient) -> None:
    document = http.get("/openapi.json").json()
    assert '"422"' not in json.dumps(document)
    assert "HTTPValidationError" not in document.get("components", {}).get("schemas", {})
    paths = document["paths"]
    expected_shapes = {
        "/v1/chat/completions": {"error"},
        "/v1/responses": {"error"},
        "/ollama/v1/chat/completions": {"error"},
        "/place_instance": {"error"},
        "/v1/messages": {"type", "error"},
        "/ollama/api/chat": {"error"},
    }
    for path, shape in expected_shapes.items():
        bad_request = paths[path]["post"]["responses"]["400"]
        example = bad_request["content"]["application/json"]["example"]
        assert set(example) == shape, path
    assert paths["/v1/chat/completions"]["post"]["responses"]["400"]["content"]["application/json"][
        "example"
    ]["error"]["type"] == ("invalid_request_error")


def test_messages_from_validators_carry_no_pydantic_prefix() -> None:
    from exo.api.wire.errors import describe_validation_errors

    message, param = describe_validation_errors(
        [{"loc": ("body", "logit_bias"), "msg": "Value error, bias 500 is outside [-100, 100]"}]
    )
    assert message == "logit_bias: bias 500 is outside [-100, 100]"
    assert param == "logit_bias"
