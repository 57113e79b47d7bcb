"""The long fuzz (`pytest -m fuzz`, not in the default run): 20,000 bodies across every route
that takes a body, and schemathesis against the node's own OpenAPI document; 0 answers 5xx.

- Generation routes (every dialect, Ollama's OpenAI-compatible ones included) get bodies from
  `tests/test_api_fuzz.py`'s strategies (valid requests with one field mutated, removed or
  joined by an unknown one, hostile conversations, arbitrary JSON; and valid requests with
  declared fields set to arbitrary values) against a node serving the default model.
- State-changing routes (placing and deleting instances, adding models, downloads, Ollama
  pull/delete, sessions) get mutated bodies against a throwaway node whose Hub is a loopback
  stand-in serving one tiny model, so a body that is valid really places or downloads.
- Schemathesis generates requests (path, query and body) from `GET /openapi.json` for every
  read-only and generation operation against the serving node and for every state-changing
  one (and the Hub search) against the throwaway node.

Every length bound in a body (`max_tokens`, `max_completion_tokens`, `max_output_tokens`,
Ollama's `num_predict`) that is null or a number above 1 is capped at 1 before it is sent
(`max_output_tokens` at 16, the least the Responses API accepts), so an accepted request
generates one token (16 on `/v1/responses`). Hypothesis runs derandomized (pinned in
pyproject.toml): the same bodies on every run. Bodies are generated first, then sent by
`SENDERS` client threads (concurrent requests are part of the load). Counts per route and
status, and the time taken, are printed.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from tests.test_api_fuzz import (
    VALID_BODIES,
    _runners_once_idle,
    declared_field_bodies,
    mutated_bodies,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(7200)]

BODIES = int(os.environ.get("EXO_FUZZ_BODIES", "20000"))
# The share of the bodies that goes to the state-changing routes on the throwaway node.
STATE_CHANGING_SHARE = 0.2
# What the throwaway node reports as its memory: room for about six tiny-model runners
# (placement counts 320 MiB per runner process).
THROWAWAY_MEMORY_MB = 2048
SCHEMATHESIS_EXAMPLES = int(os.environ.get("EXO_FUZZ_SCHEMA_EXAMPLES", "50"))
SENDERS = 4
REQUEST_TIMEOUT_SECONDS = 120.0
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "num_predict")
TINY_REPO = "someone/tiny-fuzz"
USER_TURN = {"role": "user", "content": "Say hi."}

GENERATION_BODIES: dict[str, tuple[dict[str, Any], str | None]] = {
    **VALID_BODIES,
    "/ollama/v1/chat/completions": (
        {"model": DEFAULT_MODEL_ID, "messages": [USER_TURN], "max_tokens": 1},
        "max_tokens",
    ),
    "/ollama/v1/completions": (
        {"model": DEFAULT_MODEL_ID, "prompt": "Say hi.", "max_tokens": 1},
        "max_tokens",
    ),
    "/ollama/v1/responses": (
        {"model": DEFAULT_MODEL_ID, "input": "Say hi.", "max_output_tokens": 16},
        "max_output_tokens",
    ),
    "/v1/responses/input_tokens": ({"model": DEFAULT_MODEL_ID, "input": "Say hi."}, None),
    # Embeddings and rerank from the default (decoder) model's shard: no generation.
    "/v1/embeddings": ({"model": DEFAULT_MODEL_ID, "input": "Say hi."}, None),
    "/ollama/api/embed": ({"model": DEFAULT_MODEL_ID, "input": "Say hi."}, None),
    "/ollama/api/embeddings": ({"model": DEFAULT_MODEL_ID, "prompt": "Say hi."}, None),
    "/v1/rerank": (
        {"model": DEFAULT_MODEL_ID, "query": "Say hi.", "documents": ["Hi.", "Bye."]},
        None,
    ),
}
STATE_CHANGING_BODIES: dict[str, tuple[dict[str, Any], str | None]] = {
    "/place_instance": ({"model_id": TINY_REPO, "sharding": "pipeline", "min_nodes": 1}, None),
    "/models/add": ({"model_id": TINY_REPO, "revision": "main"}, None),
    "/download/start": ({"model": TINY_REPO}, None),
    "/download/cancel": ({"model": TINY_REPO}, None),
    "/ollama/api/show": ({"model": TINY_REPO, "verbose": False}, None),
    "/ollama/api/pull": ({"model": TINY_REPO, "stream": False}, None),
    "/ollama/api/delete": ({"model": TINY_REPO}, None),
    "/auth/session": ({"api_key": "not-the-key"}, None),
}
METHODS = {"/ollama/api/delete": "DELETE"}
# Operations that change the cluster (or the node's files or sessions); everything else in
# the OpenAPI document is read-only or a generation.
STATE_CHANGING_OPERATIONS = {
    ("POST", "/place_instance"),
    ("DELETE", "/instance/{instance_id}"),
    ("POST", "/models/add"),
    ("DELETE", "/models/custom/{model_id}"),
    ("POST", "/download/start"),
    ("POST", "/download/cancel"),
    ("DELETE", "/download/{node_id}/{model_id}"),
    ("POST", "/ollama/api/pull"),
    ("DELETE", "/ollama/api/delete"),
    ("POST", "/auth/session"),
    ("DELETE", "/auth/session"),
}
# Read-only operations that ask the Hub: sent to the throwaway node, whose Hub is the loopback
# stand-in (the serving node's Hub is the real one, which this machine cannot reach: 503).
HUB_OPERATIONS = {("GET", "/models/search")}


def _above_one(bound: Any) -> bool:
    """A number above 1, or a string that reads as one. The first 20,000-body run sent
    `"max_tokens": "8198623"`, which the API then parsed leniently (a generation to the end
    of the context, past the client's timeout); strict input now refuses such strings with a
    400, and capping them too keeps the fuzz fast whatever the API decides."""
    if isinstance(bound, str):
        try:
            bound = float(bound)
        except ValueError:
            return False
    return isinstance(bound, int | float) and not isinstance(bound, bool) and bound > 1


def cap_lengths(value: Any) -> Any:
    """`value` with every length bound that is null or a number above 1 (at the top or in
    Ollama's `options`; numeric strings too) set to 1 (`max_output_tokens` to 16, the least
    it may be)."""
    if not isinstance(value, dict):
        return value
    capped = dict(value)
    for name in LENGTH_FIELDS:
        bound = capped.get(name)
        # null means "no limit" (the model's context): a generation of minutes here.
        unbounded = name in capped and bound is None
        if unbounded or _above_one(bound):
            # The Responses API's least bound is 16 (OpenAI's minimum): lower is a 400.
            capped[name] = 16 if name == "max_output_tokens" else 1
    if "options" in capped and capped["options"] is None:  # Ollama's: no limit either
        capped["options"] = {"num_predict": 1}
    if isinstance(capped.get("options"), dict):
        capped["options"] = cap_lengths(capped["options"])
    return capped


def capped_bytes(body: bytes) -> bytes:
    try:
        value = json.loads(body)
    except ValueError:
        return body
    return json.dumps(cap_lengths(value)).encode()


def generate(strategy: st.SearchStrategy[tuple[str, bytes]], count: int) -> list[tuple[str, bytes]]:
    """`count` derandomized draws of `strategy`, lengths capped."""
    drawn: list[tuple[str, bytes]] = []

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def collect(case: tuple[str, bytes]) -> None:
        drawn.append((case[0], capped_bytes(case[1])))

    collect()
    return drawn[:count]


def send_all(url: str, bodies: list[tuple[str, bytes]]) -> list[tuple[str, int, bytes]]:
    """POST (or DELETE) every body with `SENDERS` concurrent clients; (route, status, first
    bytes of the body sent) for each."""

    def send(client: httpx.Client, endpoint: str, body: bytes) -> tuple[str, int, bytes]:
        try:
            response = client.request(
                METHODS.get(endpoint, "POST"),
                endpoint,
                content=body,
                headers={"content-type": "application/json"},
            )
            response.read()
            return endpoint, response.status_code, body[:300]
        except httpx.HTTPError as error:  # counted as a failure: no answer at all
            return endpoint, 0, f"{error!r} for {body[:300]!r}".encode()

    with (
        httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_SECONDS) as client,
        ThreadPoolExecutor(SENDERS) as pool,
    ):
        return list(pool.map(lambda case: send(client, *case), bodies))


def report(what: str, results: list[tuple[str, int, bytes]], seconds: float) -> None:
    by_route: dict[str, Counter[int]] = {}
    for endpoint, status, _ in results:
        by_route.setdefault(endpoint, Counter())[status] += 1
    print(f"{what}: {len(results)} requests in {seconds:.0f} s")
    for endpoint, statuses in sorted(by_route.items()):
        print(f"  {endpoint}: {dict(sorted(statuses.items()))}")


def failures(results: list[tuple[str, int, bytes]]) -> list[tuple[str, int, bytes]]:
    return [result for result in results if result[1] >= 500 or result[1] == 0]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(TINY_REPO, save_layered_checkout(tmp_path_factory.mktemp("tiny")))
        yield server


@pytest.fixture(scope="module")
def throwaway_node(tmp_path_factory: pytest.TempPathFactory, hub: HubServer) -> Iterator[ExoNode]:
    """A node with no model of its own whose Hub is the loopback stand-in, capped at
    `THROWAWAY_MEMORY_MB` so that the placements the fuzz makes start a few runners, not
    as many as the machine's memory holds (~60 tiny-model runners on 24 GiB)."""
    home = tmp_path_factory.mktemp("exo-fuzz-throwaway")
    node = ExoNode(
        home,
        home / "models",
        extra_args=("--no-default-model", "-q"),
        env={"HF_ENDPOINT": hub.url, "OVERRIDE_MEMORY_MB": str(THROWAWAY_MEMORY_MB)},
    )
    node.start()
    try:
        yield node
    finally:
        node.stop()


def test_every_route_with_a_body_is_fuzzed(default_node: ExoNode) -> None:
    """The routes here are every route of the OpenAPI document that takes a body."""
    spec = httpx.get(f"{default_node.url}/openapi.json", timeout=30).json()
    with_body = {
        path
        for path, operations in spec["paths"].items()
        for operation in operations.values()
        if isinstance(operation, dict) and "requestBody" in operation
    }
    assert with_body == set(GENERATION_BODIES) | set(STATE_CHANGING_BODIES)


def test_20000_bodies_never_answer_5xx(default_node: ExoNode, throwaway_node: ExoNode) -> None:
    state_changing = int(BODIES * STATE_CHANGING_SHARE)
    started = time.monotonic()
    generation_bodies = generate(
        mutated_bodies(GENERATION_BODIES) | declared_field_bodies(), BODIES - state_changing
    )
    other_bodies = generate(mutated_bodies(STATE_CHANGING_BODIES), state_changing)
    print(f"generated {len(generation_bodies) + len(other_bodies)} bodies in "
          f"{time.monotonic() - started:.0f} s")  # fmt: skip
    assert len(generation_bodies) + len(other_bodies) == BODIES

    started = time.monotonic()
    served = send_all(default_node.url, generation_bodies)
    report("generation routes (serving node)", served, time.monotonic() - started)
    started = time.monotonic()
    changed = send_all(throwaway_node.url, other_bodies)
    report("state-changing routes (throwaway node)", changed, time.monotonic() - started)

    found = failures(served) + failures(changed)
    assert found == [], found[:20]
    # Neither kind of answer is vacuous: every route both accepted and refused something.
    for results, routes in ((served, GENERATION_BODIES), (changed, STATE_CHANGING_BODIES)):
        assert {endpoint for endpoint, _, _ in results} == set(routes)
    assert any(status == 200 for _, status, _ in served)
    assert any(400 <= status < 500 for _, status, _ in served)
    with httpx.Client(base_url=default_node.url, timeout=REQUEST_TIMEOUT_SECONDS) as client:
        answer = client.post("/v1/chat/completions", json=VALID_BODIES["/v1/chat/completions"][0])
        assert answer.status_code == 200, answer.text
        runners = _runners_once_idle(client)
    assert all(status["kind"] == "RunnerReady" for status in runners.values()), runners
    assert throwaway_node.process is not None and throwaway_node.process.poll() is None


def checker(
    url: str, method: str, path: str, operation: Any, counts: Counter[str], found: list[str]
) -> Any:
    """A hypothesis test of one operation: its generated cases sent to `url` (lengths
    capped), each answer counted in `counts`, each 5xx or missing answer described in
    `found`."""

    @settings(
        max_examples=SCHEMATHESIS_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def check(case: Any) -> None:
        case.body = cap_lengths(case.body)
        try:
            response = case.call(base_url=url, timeout=REQUEST_TIMEOUT_SECONDS)
            status = response.status_code
        except Exception as error:  # a transport failure is a finding, not a crash here
            status = 0
            found.append(f"{method} {path}: no answer ({error!r}) to {case.as_curl_command()}")
        counts[f"{method} {path} {status}"] += 1
        if status >= 500:
            found.append(f"{method} {path}: {status} to {case.as_curl_command()[:600]}")

    return check


def schema_failures(url: str, operations: set[tuple[str, str]]) -> list[str]:
    """Run schemathesis's generated cases for `operations` (method, path) against `url`;
    every case answered 5xx (or not at all), described."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    found: list[str] = []
    counts: Counter[str] = Counter()
    for method, path in sorted(operations):
        checker(url, method, path, schema[path][method], counts, found)()
    print(f"schemathesis against {url}: " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    return found


def test_schemathesis_finds_no_5xx(default_node: ExoNode, throwaway_node: ExoNode) -> None:
    spec = httpx.get(f"{default_node.url}/openapi.json", timeout=30).json()
    every = {
        (method.upper(), path)
        for path, operations in spec["paths"].items()
        for method in operations
        if method in ("get", "post", "put", "patch", "delete")
    }
    assert every >= STATE_CHANGING_OPERATIONS
    started = time.monotonic()
    on_throwaway = STATE_CHANGING_OPERATIONS | HUB_OPERATIONS
    found = schema_failures(default_node.url, every - on_throwaway)
    found += schema_failures(throwaway_node.url, on_throwaway)
    print(f"schemathesis: {len(every)} operations in {time.monotonic() - started:.0f} s")
    assert found == [], found[:20]
