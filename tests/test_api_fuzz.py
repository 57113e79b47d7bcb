"""Hostile and malformed request bodies against every generation endpoint of a live node:
no 500, no crashed runner, and the node still answers afterwards.

Bodies come from hypothesis: arbitrary JSON values, and valid requests of each dialect with
one field replaced by arbitrary JSON, removed, or joined by an unknown field. The field that
bounds the generation length is never removed (a mutated request that is still valid must
finish quickly), only replaced by values of the wrong kind.

Every body a fuzz run ever answered with a 500 is kept in `FOUND_BY_FUZZING` and replayed
first (as hypothesis `@example`s, and in process against the app without a node). The
default run is derandomized (hypothesis is pinned in pyproject.toml, so a fresh install
generates the same examples): `EXAMPLES` bodies against a live node and `IN_PROCESS_BODIES`
against the app in process; `-m slow` runs a longer random fuzz that also sets the
declared fields of each dialect's request model to arbitrary values, in process and
against a live node.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from exo.api.app import create_app
from exo.api.claude_messages.wire_types import CountTokensRequest, MessagesRequest
from exo.api.ollama.wire_types import OllamaChatRequest, OllamaGenerateRequest
from exo.api.openai_chat.wire_types import ChatCompletionRequest
from exo.api.openai_completions.wire_types import CompletionRequest
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.serving.cluster_client import ClusterClient
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from exo.testing.scripted_cluster import ScriptedCluster

EXAMPLES = 200
# The default run's in-process fuzz (`test_two_thousand_derandomized_bodies_in_process`).
IN_PROCESS_BODIES = 2000
REQUEST_TIMEOUT_SECONDS = 60.0
# Small enough that a still-valid mutated request finishes in well under a second.
MAX_TOKENS = 4
# The least `max_output_tokens` the Responses API accepts (OpenAI's minimum).
RESPONSES_MAX_TOKENS = 16
USER_TURN = {"role": "user", "content": "Say hi."}

# endpoint -> (a valid body, the field that bounds its generation length or None)
VALID_BODIES: dict[str, tuple[dict[str, Any], str | None]] = {
    "/v1/chat/completions": (
        {"model": DEFAULT_MODEL_ID, "messages": [USER_TURN], "max_tokens": MAX_TOKENS},
        "max_tokens",
    ),
    "/v1/completions": (
        {"model": DEFAULT_MODEL_ID, "prompt": "Say hi.", "max_tokens": MAX_TOKENS},
        "max_tokens",
    ),
    "/v1/messages": (
        {"model": DEFAULT_MODEL_ID, "messages": [USER_TURN], "max_tokens": MAX_TOKENS},
        "max_tokens",
    ),
    "/v1/messages/count_tokens": ({"model": DEFAULT_MODEL_ID, "messages": [USER_TURN]}, None),
    "/v1/responses": (
        {"model": DEFAULT_MODEL_ID, "input": "Say hi.", "max_output_tokens": RESPONSES_MAX_TOKENS},
        "max_output_tokens",
    ),
    "/ollama/api/chat": (
        {
            "model": DEFAULT_MODEL_ID,
            "messages": [USER_TURN],
            "stream": False,
            "options": {"num_predict": MAX_TOKENS},
        },
        "options",
    ),
    "/ollama/api/generate": (
        {
            "model": DEFAULT_MODEL_ID,
            "prompt": "Say hi.",
            "stream": False,
            "options": {"num_predict": MAX_TOKENS},
        },
        "options",
    ),
}

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated_bodies(
    draw: st.DrawFn,
    valid_bodies: dict[str, tuple[dict[str, Any], str | None]] = VALID_BODIES,
) -> tuple[str, bytes]:
    """A valid body of one endpoint of `valid_bodies` (endpoint -> (body, the field that
    bounds its generation length or None)) with one mutation, or any JSON value."""
    endpoint = draw(st.sampled_from(sorted(valid_bodies)))
    valid, length_field = valid_bodies[endpoint]
    body = json.loads(json.dumps(valid))
    mutation = draw(st.sampled_from(["replace", "remove", "add", "nested", "whole"]))
    field = draw(st.sampled_from(sorted(body)))
    if mutation == "whole":
        return endpoint, json.dumps(draw(json_values)).encode()
    if mutation == "replace" or (mutation == "remove" and field == length_field):
        replacement = draw(json_values)
        if field == length_field:  # never a longer generation, only a wrong type
            if isinstance(replacement, int | float):
                replacement = str(replacement)
            elif isinstance(replacement, dict):  # Ollama's options keep their bound
                replacement["num_predict"] = MAX_TOKENS
        body[field] = replacement
    elif mutation == "remove":
        del body[field]
    elif mutation == "add":
        body[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
    else:  # something hostile inside the conversation
        turn = draw(
            st.dictionaries(
                st.sampled_from(["role", "content", "type", "tool_calls", "name", "images"]),
                json_values,
                max_size=4,
            )
        )
        for key in ("messages", "input"):
            if key in body:
                body[key] = (
                    [turn]
                    if key == "messages"
                    else [turn, *draw(st.lists(json_values, max_size=2))]
                )
    return endpoint, json.dumps(body).encode()


def _nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# A lone surrogate is valid JSON (`"\ud800"`) but not valid Unicode text.
_SURROGATE = (
    '{"model": "' + DEFAULT_MODEL_ID + '", "messages": [{"role": "user", "content": "bad \\ud800"}]'
)
_DEEP_TOOL = {"type": "function", "function": {"name": "f", "parameters": _nested_schema(300)}}

HOSTILE_BODIES: list[tuple[str, bytes, dict[str, str]]] = [
    *(
        (endpoint, (_SURROGATE + ', "max_tokens": 4}').encode(), {})
        for endpoint in ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens")
    ),
    (
        "/v1/responses",
        b'{"model": "%s", "input": "bad \\ud800", "max_output_tokens": 16}'
        % DEFAULT_MODEL_ID.encode(),
        {},
    ),
    (
        "/ollama/api/chat",
        (_SURROGATE + ', "stream": false, "options": {"num_predict": 4}}').encode(),
        {},
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": DEFAULT_MODEL_ID,
                "messages": [USER_TURN],
                "max_tokens": MAX_TOKENS,
                "stop": ["\udc00"],
                "tools": [_DEEP_TOOL],
            }
        ).encode(),
        {},
    ),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": DEFAULT_MODEL_ID,
                "messages": [USER_TURN],
                "tools": [_DEEP_TOOL],
                "max_tokens": MAX_TOKENS,
            }
        ).encode(),
        {},
    ),
    ("/v1/chat/completions", b"", {}),
    ("/v1/chat/completions", b"{", {}),
    ("/v1/chat/completions", b"\xff\xfe\x00garbage", {}),
    ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, {}),
    ("/v1/chat/completions", b'{"model": NaN, "messages": []}', {}),
    ("/v1/chat/completions", b'{"max_tokens": 1e400}', {}),
    ("/v1/messages", b"null", {}),
    ("/v1/messages", b'{"model": "x"}', {"content-type": "text/plain"}),
    ("/v1/responses", b'"just a string"', {}),
    ("/ollama/api/chat", b"[]", {}),
    ("/ollama/api/generate", b'{"model": "' + b"a" * 100_000 + b'"}', {}),
    (
        "/v1/chat/completions",
        json.dumps(
            {
                "model": DEFAULT_MODEL_ID,
                "messages": [{"role": "user", "content": "word " * 200_000}],
                "max_tokens": MAX_TOKENS,
            }
        ).encode(),
        {},
    ),
]


# Bodies that once reached a 500, with the endpoint they were sent to. Append every new
# find here (and fix its cause).
FOUND_BY_FUZZING: list[tuple[str, bytes]] = [
    # A `type` that is a list reached a discriminator's set lookup (unhashable): 500.
    (
        "/v1/responses",
        json.dumps(
            {
                "model": DEFAULT_MODEL_ID,
                "input": [{"role": None, "content": None, "type": []}],
                "max_output_tokens": RESPONSES_MAX_TOKENS,
            }
        ).encode(),
    ),
    # Its siblings in the other discriminated unions (content parts, tools, Claude blocks).
    (
        "/v1/responses",
        json.dumps(
            {
                "model": DEFAULT_MODEL_ID,
                "input": [{"role": "user", "content": [{"type": {"a": 1}}]}],
                "tools": [{"type": []}],
                "tool_choice": {"type": [None]},
                "max_output_tokens": RESPONSES_MAX_TOKENS,
            }
        ).encode(),
    ),
    (
        "/v1/messages",
        json.dumps(
            {
                "model": DEFAULT_MODEL_ID,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": []},
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": {}}]},
                        ],
                    }
                ],
                "max_tokens": MAX_TOKENS,
            }
        ).encode(),
    ),
]

# endpoint -> the request model whose declared fields the slow fuzz sets to arbitrary values
REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
    "/ollama/api/chat": OllamaChatRequest,
    "/ollama/api/generate": OllamaGenerateRequest,
}

# Values of the right shape for some field somewhere, so that mutations get past the first
# layer of validation and reach the adapters' and the engine's checks.
PLAUSIBLE_VALUES: list[Any] = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "name": "f", "parameters": {"properties": {"a": {"type": "string"}}}},
    {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"enum": [1, "x"]}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    {"type": "json_schema", "name": "x", "schema": {"type": "array", "items": {}}},
    {"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "max"},
    {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    {"type": "any"},
    {"type": "tool", "name": "f"},
    {"type": "function", "function": {"name": "f"}},
    {"type": "function", "name": "f"},
    {"type": "enabled", "budget_tokens": 1024},
    {"effort": "high", "summary": "auto"},
    {"7042": -100, "2": 100},
    {"num_predict": 2, "temperature": 0, "stop": ["x"]},
    [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
    "auto",
    "required",
    "none",
    "json",
]


@st.composite
def declared_field_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body of one endpoint with one to four of its request model's declared
    fields set to arbitrary or plausible values (a plausible object may get one key
    replaced). The length bound keeps its valid value unless it is drawn itself."""
    endpoint = draw(st.sampled_from(sorted(REQUEST_MODELS)))
    body = json.loads(json.dumps(VALID_BODIES[endpoint][0]))
    names = sorted(REQUEST_MODELS[endpoint].model_fields)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        name = draw(st.sampled_from(names))
        value = json.loads(json.dumps(draw(json_values | st.sampled_from(PLAUSIBLE_VALUES))))
        if isinstance(value, dict) and value and draw(st.booleans()):
            value[draw(st.sampled_from(sorted(value)))] = draw(json_values)
        if name == VALID_BODIES[endpoint][1]:  # never a longer generation
            if isinstance(value, int | float):
                value = str(value)
            elif isinstance(value, dict):  # Ollama's options
                value["num_predict"] = MAX_TOKENS
        body[name] = value
    return endpoint, json.dumps(body).encode()


def _post(client: httpx.Client, endpoint: str, body: bytes, headers: dict[str, str]) -> int:
    response = client.post(
        endpoint, content=body, headers={"content-type": "application/json", **headers}
    )
    response.read()
    return response.status_code


def _assert_node_serves(client: httpx.Client) -> None:
    valid, _ = VALID_BODIES["/v1/chat/completions"]
    response = client.post("/v1/chat/completions", json=valid)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def _runners_once_idle(client: httpx.Client, deadline_s: float = 60.0) -> dict[str, Any]:
    """The runners' statuses once none is running, or as they are at the deadline. The last
    answer reaches the API before its runner's "ready" reaches the (event-sourced) state, so
    a runner may read "running" for a moment after every request has been answered."""
    give_up = time.monotonic() + deadline_s
    while True:
        runners: dict[str, Any] = client.get("/state").json()["runners"]
        idle = all(status["kind"] != "RunnerRunning" for status in runners.values())
        if idle or time.monotonic() > give_up:
            return runners
        time.sleep(0.2)


def test_malformed_and_hostile_bodies_never_break_the_node(default_node: ExoNode) -> None:
    statuses: list[tuple[str, int]] = []
    with httpx.Client(base_url=default_node.url, timeout=REQUEST_TIMEOUT_SECONDS) as client:
        _assert_node_serves(client)
        for endpoint, body, headers in HOSTILE_BODIES:
            status = _post(client, endpoint, body, headers)
            assert status < 500, f"{endpoint} answered {status} to a hostile body"
            statuses.append((endpoint, status))

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=mutated_bodies())
        def check(case: tuple[str, bytes]) -> None:
            endpoint, body = case
            status = _post(client, endpoint, body, {})
            assert status < 500, f"{endpoint} answered {status} to {body[:300]!r}"
            statuses.append((endpoint, status))

        for found in FOUND_BY_FUZZING:
            check = example(case=found)(check)
        check()
        _assert_node_serves(client)
        runners = _runners_once_idle(client)
    assert len(statuses) >= EXAMPLES + len(HOSTILE_BODIES) + len(FOUND_BY_FUZZING)
    # Every endpoint was reached with both accepted and refused bodies, so neither kind of
    # answer is vacuous.
    assert {endpoint for endpoint, _ in statuses} == set(VALID_BODIES)
    assert any(status == 200 for _, status in statuses)
    assert all(status["kind"] == "RunnerReady" for status in runners.values()), runners


def _in_process_client() -> TestClient:
    """The real app (routes, adapters, error handlers) over a scripted cluster."""
    return TestClient(
        create_app(cast(ClusterClient, ScriptedCluster())), raise_server_exceptions=False
    )


def _in_process_status(client: TestClient, endpoint: str, body: bytes) -> int:
    response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
    # count_tokens needs the model's tokenizer on this node; the scripted one has none (503).
    if endpoint == "/v1/messages/count_tokens" and response.status_code == 503:
        return 400
    return response.status_code


@pytest.mark.parametrize(("endpoint", "body"), FOUND_BY_FUZZING)
def test_bodies_found_by_fuzzing_are_refused_in_process(endpoint: str, body: bytes) -> None:
    with _in_process_client() as client:
        response = client.post(endpoint, content=body)
    assert 400 <= response.status_code < 500, response.text
    assert "type" in response.text  # the message names the field at fault


def test_two_thousand_derandomized_bodies_in_process() -> None:
    """The default run's short fuzz of every dialect's routes: `IN_PROCESS_BODIES`
    derandomized bodies (declared fields set to arbitrary values, and the mutations of the
    live test) against the app over a scripted cluster; none answered with a 5xx, and both
    refused and accepted bodies reached every endpoint (neither kind vacuous)."""
    statuses: list[tuple[str, int]] = []
    with _in_process_client() as client:

        @settings(
            max_examples=IN_PROCESS_BODIES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=declared_field_bodies() | mutated_bodies())
        def check(case: tuple[str, bytes]) -> None:
            endpoint, body = case
            status = _in_process_status(client, endpoint, body)
            assert status < 500, f"{endpoint} answered {status} to {body[:500]!r}"
            statuses.append((endpoint, status))

        check()
    assert len(statuses) >= IN_PROCESS_BODIES
    assert {endpoint for endpoint, _ in statuses} == set(VALID_BODIES)
    assert any(status == 200 for _, status in statuses)
    assert any(400 <= status < 500 for _, status in statuses)


@pytest.mark.slow
def test_long_random_fuzz_in_process() -> None:
    """Thousands of random bodies (other ones on every run) against the app; run on
    purpose with `-m slow`. A 500 found here goes into `FOUND_BY_FUZZING`."""
    failures: list[tuple[str, int, bytes]] = []
    with _in_process_client() as client:

        @settings(
            max_examples=5000,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=declared_field_bodies() | mutated_bodies())
        def check(case: tuple[str, bytes]) -> None:
            endpoint, body = case
            status = _in_process_status(client, endpoint, body)
            if status >= 500:
                failures.append((endpoint, status, body[:500]))

        check()
    assert not failures, failures[:10]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_long_random_fuzz_against_a_node(default_node: ExoNode) -> None:
    """As the default fuzz, with random (not derandomized) bodies that also set declared
    fields, against a live node; run on purpose with `-m slow`."""
    with httpx.Client(base_url=default_node.url, timeout=REQUEST_TIMEOUT_SECONDS) as client:

        @settings(
            max_examples=1500,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=declared_field_bodies() | mutated_bodies())
        def check(case: tuple[str, bytes]) -> None:
            endpoint, body = case
            status = _post(client, endpoint, body, {})
            assert status < 500, f"{endpoint} answered {status} to {body[:500]!r}"

        check()
        _assert_node_serves(client)
        runners = _runners_once_idle(client)
    assert all(status["kind"] == "RunnerReady" for status in runners.values()), runners


pytestmark = pytest.mark.timeout(900)
