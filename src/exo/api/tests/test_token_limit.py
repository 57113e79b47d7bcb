"""The token limit the API caps `max_tokens` at: the model's context and the KV-cache budget
its instance's runners really hold (`exo.api.serving.token_limit`)."""

from __future__ import annotations

from typing import cast

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
