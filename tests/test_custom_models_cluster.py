"""Two real `exo` nodes on loopback share a custom model: added through one node's API
from the loopback Hub test server, listed by the other, deleted through the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.testing.hf_server import HubServer
from exo.testing.processes import ExoNode, wait_until
from exo.testing.tiny_models import save_tiny_checkout

REPO = "someone/tiny-llama"
FORM_TIMEOUT_SECONDS = 30.0
SPREAD_TIMEOUT_SECONDS = 15.0
READY_TIMEOUT_SECONDS = 120.0


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(REPO, save_tiny_checkout(tmp_path / "checkout"))
        yield server


def listed(node: ExoNode) -> list[str]:
    response = httpx.get(f"{node.url}/models", timeout=10)
    response.raise_for_status()
    return [card["model_id"] for card in response.json()]


def test_a_custom_model_added_on_one_node_is_known_to_the_other(
    tmp_path: Path, hub: HubServer
) -> None:
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "0"}
    first = ExoNode(tmp_path / "a", extra_args=("--no-default-model",), env=env)
    second = ExoNode(
        tmp_path / "b",
        extra_args=("--no-default-model",),
        env=env,
        namespace=first.namespace,
        bootstrap=(first,),
    )
    try:
        for node in (first, second):
            node.launch()
        for node in (first, second):
            node.wait_api()
        wait_until(
            lambda: (
                len({n.cluster()["master"] for n in (first, second)} - {None}) == 1
                and len(second.state()["node_info"]) == 2
            ),
            FORM_TIMEOUT_SECONDS,
            what="one cluster",
        )
        added = httpx.post(f"{first.url}/models/add", json={"model_id": REPO}, timeout=60)
        assert added.status_code == 200, added.text
        wait_until(lambda: REPO in listed(second), SPREAD_TIMEOUT_SECONDS, what="listed on B")
        assert second.state()["custom_cards"][REPO]["architecture"] == "LlamaForCausalLM"
        # Only the asked node read the repository: one ranged read of the weights' header.
        assert hub.file_requests(REPO, "model.safetensors") == 1
        # B places it by its bare name, downloads it from the Hub and serves it.
        placed = httpx.post(
            f"{first.url}/place_instance",
            json={"model_id": "tiny-llama", "node_ids": [second.node_id()]},
            timeout=60,
        )
        assert placed.status_code == 200, placed.text
        second.wait_ready(REPO, timeout=READY_TIMEOUT_SECONDS)
        completion = httpx.post(
            f"{first.url}/v1/completions",
            json={"model": REPO, "prompt": "w1 w2 w3", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 4
        assert hub.file_requests(REPO, "model.safetensors") == 2  # B's download
        refused = httpx.delete(f"{second.url}/models/custom/{REPO}", timeout=60)
        assert refused.status_code == 409, refused.text
        instance_id = placed.json()["instance_id"]
        assert httpx.delete(f"{first.url}/instance/{instance_id}", timeout=60).status_code == 200
        deleted = httpx.delete(f"{second.url}/models/custom/{REPO}", timeout=60)
        assert deleted.status_code == 200, deleted.text
        wait_until(lambda: REPO not in listed(first), SPREAD_TIMEOUT_SECONDS, what="gone on A")
        again = httpx.delete(f"{first.url}/models/custom/{REPO}", timeout=60)
        assert again.status_code == 404, again.text
    finally:
        for node in (first, second):
            node.stop()
