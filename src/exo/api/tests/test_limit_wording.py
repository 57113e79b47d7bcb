"""A value past a limit (too many choices, too many stop strings, a seed past 64 bits, too
many logprob alternatives) is a 400 worded as each dialect's reference API words it, with
exo's own limit where exo allows more than the reference (16 stop strings, unsigned 64-bit
seeds)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

MESSAGES = [{"role": "user", "content": "Hi"}]
OPENAI_BODIES = [
    ("/v1/chat/completions", {"model": SMOLLM2, "messages": MESSAGES}),
    ("/v1/completions", {"model": SMOLLM2, "prompt": "Hi"}),
]
HUGE = 2**70


@pytest.fixture
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture
def http(cluster: ScriptedCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as test_client:
        yield test_client


def _openai_error(message: str, param: str, code: str | None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


@pytest.mark.parametrize(("path", "body"), OPENAI_BODIES)
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"n": 200},
            _openai_error(
                "Invalid 'n': integer above maximum value. Expected a value <= 128, but got "
                "200 instead.",
                "n",
                "integer_above_max_value",
            ),
        ),
        (
            {"stop": [f"s{index}" for index in range(17)]},
            _openai_error(
                "Invalid 'stop': array too long. Expected an array with maximum length 16, but "
                "got an array with length 17 instead.",
                "stop",
                "array_above_max_length",
            ),
        ),
        (
            {"seed": HUGE},
            _openai_error(
                "Invalid 'seed': integer above maximum value. Expected a value <= "
                f"{2**64 - 1}, but got {HUGE} instead.",
                "seed",
                "integer_above_max_value",
            ),
        ),
    ],
)
def test_openai_limits_answer_in_openais_words(
    http: TestClient, path: str, body: dict[str, Any], extra: dict[str, Any], expected: Any
) -> None:
    response = http.post(path, json={**body, **extra})
    assert response.status_code == 400, response.text
    assert response.json() == expected


@pytest.mark.parametrize(("path", "body"), OPENAI_BODIES)
def test_openai_values_inside_the_limits_keep_their_meaning(
    http: TestClient, cluster: ScriptedCluster, path: str, body: dict[str, Any]
) -> None:
    # n within OpenAI's range is exo's own refusal (one choice per request), not a schema error.
    refused = http.post(path, json={**body, "n": 128})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "n"
    assert "n=128 is not supported" in refused.json()["error"]["message"]
    stops = [f"s{index}" for index in range(16)]
    accepted = http.post(path, json={**body, "seed": 2**64 - 1, "stop": stops})
    assert accepted.status_code == 200, accepted.text
    assert (cluster.last_params.seed, cluster.last_params.stop) == (2**64 - 1, tuple(stops))


def test_responses_limits_answer_in_openais_words(http: TestClient) -> None:
    response = http.post(
        "/v1/responses", json={"model": SMOLLM2, "input": "Hi", "top_logprobs": 25}
    )
    assert response.status_code == 400, response.text
    assert response.json() == _openai_error(
        "Invalid 'top_logprobs': integer above maximum value. Expected a value <= 20, but got 25 "
        "instead.",
        "top_logprobs",
        "integer_above_max_value",
    )


@pytest.mark.parametrize("path", ["/ollama/api/chat", "/ollama/api/generate"])
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"logprobs": True, "top_logprobs": 25}, "top_logprobs must be between 0 and 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs must be between 0 and 20"),
        (
            {"logprobs": True, "top_logprobs": HUGE},
            f"json: cannot unmarshal number {HUGE} into Go struct field {{struct}}.top_logprobs "
            "of type int",
        ),
        ({"options": {"seed": HUGE}}, f'option "seed" must be at most {2**64 - 1}'),
        ({"options": {"seed": -HUGE}}, f'option "seed" must be at least {-(2**63)}'),
    ],
)
def test_ollama_limits_answer_in_ollamas_words(
    http: TestClient, path: str, extra: dict[str, Any], message: str
) -> None:
    body = {"messages": MESSAGES} if path.endswith("chat") else {"prompt": "Hi"}
    response = http.post(path, json={"model": SMOLLM2, "stream": False, **body, **extra})
    assert response.status_code == 400, response.text
    struct = "ChatRequest" if path.endswith("chat") else "GenerateRequest"
    assert response.json() == {"error": message.format(struct=struct)}


def test_ollama_takes_any_number_of_stop_strings_and_a_64_bit_seed(
    http: TestClient, cluster: ScriptedCluster
) -> None:
    stops = [f"s{index}" for index in range(17)]
    options = {"seed": 2**64 - 1, "stop": stops}
    response = http.post(
        "/ollama/api/chat",
        json={"model": SMOLLM2, "messages": MESSAGES, "stream": False, "options": options},
    )
    assert response.status_code == 200, response.text
    assert (cluster.last_params.seed, cluster.last_params.stop) == (2**64 - 1, tuple(stops))


def test_claude_limits_keep_anthropics_shape(http: TestClient) -> None:
    response = http.post(
        "/v1/messages",
        json={"model": SMOLLM2, "max_tokens": 8, "messages": MESSAGES, "temperature": 3},
    )
    assert response.status_code == 400, response.text
    assert response.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "temperature: Input should be less than or equal to 1",
        },
    }
