"""`exo bench` prints the cluster's prediction next to what it measured; when the previews
predict nothing it says why (it printed `predicted {}` silently before) and waits for the
nodes' speed only once."""

from __future__ import annotations

from typing import Any

import pytest

from exo.benchmark import cluster as bench_cluster
from exo.benchmark.client import ApiTarget
from exo.benchmark.cluster import BenchNodes, Placement

NODE = "node-aaaaaaaaaaaa"
SINGLE = Placement("pipeline", 1)


class FakeNodes(BenchNodes):
    """Answers `/instance/previews` from `previews` and `/state` with `node_info`."""

    def __init__(self, previews: list[list[dict[str, Any]]], node_info: dict[str, Any]) -> None:
        super().__init__(ApiTarget("http://127.0.0.1:1"), [NODE])
        self.previews = previews
        self.node_info = node_info
        self.asked = 0

    def get(self, path: str, **params: Any) -> Any:
        if path == "/state":
            return {"node_info": self.node_info}
        self.asked += 1
        return self.previews[min(self.asked, len(self.previews)) - 1]


def preview(decode: float | None, ttft: float | None) -> dict[str, Any]:
    return {
        "sharding": "pipeline",
        "node_count": 1,
        "node_ids": [NODE],
        "error": None,
        "predicted_decode_tokens_per_second": decode,
        "predicted_ttft_seconds": ttft,
    }


def test_figures_once_the_node_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_cluster.time, "sleep", lambda seconds: None)
    nodes = FakeNodes([[preview(None, None)], [preview(25.0, 0.5)]], {NODE: {"speed": None}})
    assert nodes.predicted("model", SINGLE, 16) == {"decode_tok_s": 25.0, "ttft_s": 0.5}
    assert nodes.no_prediction_reason is None and nodes.asked == 2


def test_no_settled_speed_is_explained_and_waited_for_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_cluster, "PREDICTION_TIMEOUT_SECONDS", 0.0)
    nodes = FakeNodes([[preview(None, None)]], {NODE: {"speed": None}})
    assert nodes.predicted("model", SINGLE, 16) == {}
    reason = nodes.no_prediction_reason
    assert reason is not None and "node(s) node-aaa report no settled speed figures" in reason
    # A later prompt length does not wait again.
    monkeypatch.setattr(bench_cluster, "PREDICTION_TIMEOUT_SECONDS", 3600.0)
    assert nodes.predicted("model", SINGLE, 128) == {} and nodes.asked == 2


def test_a_placement_without_a_valid_preview_is_explained() -> None:
    nodes = FakeNodes([[{**preview(None, None), "error": "not enough memory"}]], {})
    assert nodes.predicted("model", SINGLE, 16) == {}
    assert nodes.no_prediction_reason == "no valid single preview"
