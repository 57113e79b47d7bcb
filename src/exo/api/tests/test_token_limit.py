"""The token limit the API caps `max_tokens` at: the model's context and the KV-cache budget
its instance's runners really hold (`exo.api.serving.token_limit`); and the one `max_tokens`
rule every dialect's limit field follows (capped and said in a header, a 400 naming the
field when not a positive integer) through the real app with a stand-in cluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.token_limit import held_kv_cache_tokens, token_limit
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerLoading, RunnerReady, RunnerRunning, RunnerStatus
from exo.shared.types.state import State
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import ScriptedCluster

NODES = (NodeId("node-a"), NodeId("node-b"))


def _two_ranks(placed: int) -> Instance:
    instance = make_instance(NODES)
    return instance.model_copy(update={"kv_cache_tokens": placed})


def _state(instance: Instance, statuses: tuple[RunnerStatus, RunnerStatus]) -> State:
    runners = dict(
        zip(
            instance.shard_assignments.runner_to_shard,
            zip(NODES, statuses, strict=True),
            strict=True,
        )
    )
    return make_state(instances=[instance], runners=runners)


def test_the_held_budget_is_the_smallest_a_loaded_runner_reports() -> None:
    instance = _two_ranks(placed=6_000)
    # Rank 1's node stores float32 KV: the placed bytes hold half the tokens.
    both = _state(
        instance, (RunnerReady(kv_cache_tokens=6_000), RunnerRunning(kv_cache_tokens=3_000))
    )
    assert held_kv_cache_tokens(both, instance) == 3_000


def test_the_placed_budget_counts_until_every_runner_reports() -> None:
    instance = _two_ranks(placed=6_000)
    loading = _state(
        instance,
        (RunnerReady(kv_cache_tokens=3_000), RunnerLoading(layers_loaded=3, total_layers=15)),
    )
    assert held_kv_cache_tokens(loading, instance) == 6_000


def test_the_api_limit_follows_the_held_budget() -> None:
    cluster = ScriptedCluster()
    instance = _two_ranks(placed=6_000)
    cluster.state = _state(
        instance, (RunnerReady(kv_cache_tokens=6_000), RunnerReady(kv_cache_tokens=3_000))
    )
    params = TextGenerationTaskParams(
        model=ModelId(SMOLLM2), messages=(ChatMessage(role="user", content="hi"),)
    )
    assert cluster.cards[SMOLLM2].context_length == 8_192
    assert token_limit(cast(ClusterClient, cluster), params) == 3_000


# ---------------------------------------------------------------- one max_tokens rule


@pytest.fixture
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture
def http(cluster: ScriptedCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client


HI = [{"role": "user", "content": "hi"}]
TOKEN_LIMIT_ROUTES = [
    ("/v1/chat/completions", "max_tokens", {"messages": HI}),
    ("/v1/chat/completions", "max_completion_tokens", {"messages": HI}),
    ("/v1/completions", "max_tokens", {"prompt": "hi"}),
    ("/v1/responses", "max_output_tokens", {"input": "hi"}),
    ("/v1/messages", "max_tokens", {"messages": HI}),
    ("/ollama/api/chat", "options.num_predict", {"messages": HI, "stream": False}),
    ("/api/generate", "options.num_predict", {"prompt": "hi", "stream": False}),
]


def _with_limit(field: str, value: Any, body: dict[str, Any]) -> dict[str, Any]:
    if field == "options.num_predict":
        return {"model": SMOLLM2, **body, "options": {"num_predict": value}}
    return {"model": SMOLLM2, **body, field: value}


@pytest.mark.parametrize(("route", "field", "body"), TOKEN_LIMIT_ROUTES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_limit_over_the_room_left_is_capped_and_said_in_a_header(
    http: TestClient, cluster: ScriptedCluster, route: str, field: str, body: dict[str, Any],
    stream: bool,
) -> None:  # fmt: skip
    for limit, header in ((32000, "8187"), (100, None)):  # context 8192, prompt 5 tokens
        answer = http.post(route, json={**_with_limit(field, limit, body), "stream": stream})
        assert answer.status_code == 200, answer.text
        assert answer.headers.get("x-exo-max-tokens-capped") == header
        assert cluster.last_params.max_tokens == limit  # the engine caps it where it stops


@pytest.mark.parametrize(("route", "field", "body"), TOKEN_LIMIT_ROUTES)
@pytest.mark.parametrize("value", [1.5, 2.0, "10", True, []])
def test_a_limit_that_is_not_an_integer_is_a_400_naming_the_field(
    http: TestClient, route: str, field: str, body: dict[str, Any], value: Any
) -> None:
    answer = http.post(route, json=_with_limit(field, value, body))
    assert answer.status_code == 400
    # Ollama names an option of the wrong type its own way: `option "num_predict" must be...`
    option = field.removeprefix("options.")
    assert field in answer.text or answer.json()["error"].startswith(f'option "{option}" ')


@pytest.mark.parametrize(("route", "field", "body"), TOKEN_LIMIT_ROUTES)
@pytest.mark.parametrize("value", [0, -1])
def test_a_limit_below_one_is_a_400_except_ollamas_no_limit(
    http: TestClient, cluster: ScriptedCluster, route: str, field: str, body: dict[str, Any],
    value: int,
) -> None:  # fmt: skip
    answer = http.post(route, json=_with_limit(field, value, body))
    if field == "options.num_predict":
        # Ollama's own meaning: -1 (and 0 in exo, as no limit) generate until the end.
        assert answer.status_code == 200 and cluster.last_params.max_tokens is None
    else:
        assert answer.status_code == 400 and field in answer.text
