"""`GET /metrics` (`exo.api.serving.metrics`): parsed with prometheus_client's own text parser, its
counters move with traffic, each app keeps its own registry, and the state's gauges follow
the cluster state."""

from __future__ import annotations

from collections.abc import AsyncIterator

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from exo.api.tests.serving import scripted_app
from exo.shared.types.chunks import Chunk, TokenChunk, Usage
from exo.shared.types.common import CommandId, NodeId, RunnerId
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.nodes import DownloadOngoing, TopologyEdge
from exo.shared.types.runners import (
    KVCacheUse,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    SpeculationStats,
)
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import ScriptedCluster

CHAT = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}


class ThreeChunkCluster(ScriptedCluster):
    """Every generation: three token chunks (one of them two tokens), then the finish."""

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        model = SMOLLM2
        yield TokenChunk(command_id=command_id, model=model, text="Hi", token_ids=(1,))
        yield TokenChunk(command_id=command_id, model=model, text=" the", token_ids=(2, 3))
        yield TokenChunk(
            command_id=command_id,
            model=model,
            text="re.",
            token_ids=(4,),
            finish_reason="stop",
            usage=Usage(prompt_tokens=5, completion_tokens=4),
        )


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of `GET /metrics`: (name, sorted labels) -> value."""
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_move_with_traffic() -> None:
    client = TestClient(scripted_app(ThreeChunkCluster()))
    before = scrape(client)
    requests = ("exo_http_requests_total",)
    chat_ok = {"method": "POST", "route": "/v1/chat/completions", "status": "200"}
    assert value(before, *requests, **chat_ok) == 0
    for stream in (False, True):
        response = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200
    assert client.post("/v1/chat/completions", json={"model": 3}).status_code == 400
    assert client.get("/v1/models/no-such/model").status_code == 404
    after = scrape(client)
    assert value(after, *requests, **chat_ok) == 2
    assert value(after, *requests, method="POST", route="/v1/chat/completions", status="400") == 1
    # The route template, never the raw path (ids would multiply the series).
    template = {"method": "GET", "route": "/v1/models/{model_id:path}", "status": "404"}
    assert value(after, *requests, **template) == 1
    assert value(after, "exo_prompt_tokens_total", model=SMOLLM2) == 10
    assert value(after, "exo_generation_tokens_total", model=SMOLLM2) == 8
    assert value(after, "exo_time_to_first_token_seconds_count", model=SMOLLM2) == 2
    # After the first token: 1 gap split over the 2-token chunk, then 1 more, per request.
    assert value(after, "exo_inter_token_latency_seconds_count", model=SMOLLM2) == 6
    assert value(after, "exo_api_generations_in_flight") == 0
    assert (
        value(after, "exo_http_request_duration_seconds_count", route="/v1/chat/completions") == 3
    )


def test_each_app_keeps_its_own_registry() -> None:
    first = TestClient(scripted_app(ScriptedCluster()))
    second = TestClient(scripted_app(ScriptedCluster()))
    assert first.post("/v1/chat/completions", json=CHAT).status_code == 200
    chat_ok = {"method": "POST", "route": "/v1/chat/completions", "status": "200"}
    assert value(scrape(first), "exo_http_requests_total", **chat_ok) == 1
    assert value(scrape(second), "exo_http_requests_total", **chat_ok) == 0


def test_state_gauges_follow_the_cluster_state() -> None:
    cluster = ScriptedCluster()
    node_a, node_b = NodeId("node-a"), NodeId("node-b")
    instance = make_instance(node_a)
    (runner_id,) = instance.shard_assignments.runner_to_shard
    progress = DownloadProgress(
        downloaded_bytes=1000, total_bytes=4000, speed_bytes_per_second=100.0
    )
    cluster.state = make_state(instances=[instance]).model_copy(
        update={
            "runners": {
                runner_id: RunnerReady(),
                RunnerId("r-2"): RunnerLoading(layers_loaded=1, total_layers=30),
            },
            "runner_nodes": {runner_id: node_a, RunnerId("r-2"): node_b},
            "downloads": {node_b: {SMOLLM2: DownloadOngoing(progress=progress)}},
            "topology": {
                node_a: {
                    node_b: TopologyEdge(
                        source=node_a,
                        sink=node_b,
                        address="10.0.0.2",
                        latency_ms=2.0,
                        bandwidth_mbps=800.0,
                    )
                }
            },
            "last_event_applied_idx": 41,
        }
    )
    samples = scrape(TestClient(scripted_app(cluster)))
    assert value(samples, "exo_runners", node="node-a", status="RunnerReady") == 1
    assert value(samples, "exo_runners", node="node-b", status="RunnerLoading") == 1
    assert value(samples, "exo_download_downloaded_bytes", node="node-b", model=SMOLLM2) == 1000
    assert value(samples, "exo_download_total_bytes", node="node-b", model=SMOLLM2) == 4000
    assert value(samples, "exo_link_latency_seconds", source="node-a", sink="node-b") == 0.002
    assert (
        value(samples, "exo_link_bandwidth_bytes_per_second", source="node-a", sink="node-b") == 1e8
    )
    assert value(samples, "exo_event_index") == 41
    assert value(samples, "exo_requests_queued", model=SMOLLM2) == 0
    assert value(samples, "exo_api_admitted_generations", model=SMOLLM2) == 0


def test_speculation_gauges_show_each_runners_counts_from_the_state() -> None:
    cluster = ScriptedCluster()
    instance = make_instance(NodeId("node-a"))
    (runner_id,) = instance.shard_assignments.runner_to_shard
    stats = SpeculationStats(
        decode_rounds=40, decode_tokens=100, verify_rounds=20, drafted_tokens=80,
        accepted_tokens=60, acceptance_rate=0.75, tokens_per_step=2.5,
    )  # fmt: skip
    cluster.state = make_state(instances=[instance]).model_copy(
        update={"runners": {runner_id: RunnerRunning(speculation=stats)}}
    )
    samples = scrape(TestClient(scripted_app(cluster)))
    labels = {"runner": str(runner_id), "model": SMOLLM2, "draft": "ngram"}
    assert value(samples, "exo_speculative_acceptance_rate", **labels) == 0.75
    assert value(samples, "exo_speculative_tokens_per_step", **labels) == 2.5
    assert value(samples, "exo_speculative_drafted_tokens", **labels) == 80
    assert value(samples, "exo_speculative_accepted_tokens", **labels) == 60
    # A runner drafting with a draft model names it as the source.
    drafting = RunnerRunning(speculation=stats, draft_model="Qwen/Qwen3-0.6B")
    cluster.state = cluster.state.model_copy(update={"runners": {runner_id: drafting}})
    samples = scrape(TestClient(scripted_app(cluster)))
    labels["draft"] = "Qwen/Qwen3-0.6B"
    assert value(samples, "exo_speculative_acceptance_rate", **labels) == 0.75
    assert value(samples, "exo_speculative_accepted_tokens", draft="ngram", runner=str(runner_id),
                 model=SMOLLM2) == 0  # fmt: skip
    cluster.state = cluster.state.model_copy(update={"runners": {runner_id: RunnerReady()}})
    samples = scrape(TestClient(scripted_app(cluster)))
    assert not any(name.startswith("exo_speculative") for name, _ in samples)


def test_kv_cache_gauges_show_this_nodes_runners() -> None:
    cluster = ScriptedCluster()
    client = TestClient(scripted_app(cluster))
    assert not any(name.startswith("exo_kv_cache") for name, _ in scrape(client))
    cluster.kv_cache = [KVCacheUse("runner-1", SMOLLM2, 120, 1500, 8192)]
    samples = scrape(client)
    labels = {"runner": "runner-1", "model": SMOLLM2}
    assert value(samples, "exo_kv_cache_tokens", holder="running", **labels) == 120
    assert value(samples, "exo_kv_cache_tokens", holder="prefix_cache", **labels) == 1500
    assert value(samples, "exo_kv_cache_budget_tokens", **labels) == 8192
