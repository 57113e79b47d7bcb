"""Model names and listings through the real app: short names in every dialect and in the
cluster routes, `GET /v1/models` (servable now), `GET /v1/models/{id}` (OpenAI's
`models.retrieve`), `GET /models` (the catalog) and Ollama's listings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.download.pypi_gguf import COMPLETION_MARKER, model_directory_name
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import Command, PlaceInstance
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.events import InstanceCreated
from exo.shared.types.nodes import DownloadCompleted
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

QWEN3 = ModelId("Qwen/Qwen3-0.6B")
LLAMA = ModelId("meta-llama/Llama-3.2-1B-Instruct")


class CatalogCluster(ScriptedCluster):
    """The scripted cluster with the whole catalog, SmolLM2 placed, and placements that
    succeed (recording the command)."""

    def __init__(self) -> None:
        super().__init__()
        self.cards = {str(model_id): card for model_id, card in load_builtin_cards().items()}
        self.placed: list[PlaceInstance] = []

    async def wait_for_node_reports(self, node_ids: frozenset[NodeId] | None = None) -> None:
        return None

    async def submit(self, command: Any, timeout: float = 0.0) -> Any:
        if isinstance(command, PlaceInstance):
            self.placed.append(command)
            card = self.cards[command.model_id]
            return InstanceCreated(
                instance=make_instance(self.node_id, card, instance_id="instance-2"),
                command_id=command.command_id,
            )
        return await super().submit(command, timeout)

    def send_and_forget(self, command: Command) -> None:
        self.sent.append(command)


@pytest.fixture
def cluster() -> CatalogCluster:
    return CatalogCluster()


@pytest.fixture
def http(cluster: CatalogCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client


@pytest.fixture
def openai_client(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
    )


@pytest.mark.parametrize("name", ["smollm2:135m", "smollm2-135m", "SmolLM2-135M-Instruct"])
def test_short_names_in_chat_and_responses(
    openai_client: openai.OpenAI, cluster: CatalogCluster, name: str
) -> None:
    chat = openai_client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content == SCRIPTED_ANSWER
    # OpenAI names the model an alias resolved to; so do we.
    assert chat.model == SMOLLM2 and cluster.last_params.model == SMOLLM2
    response = openai_client.responses.create(model=name, input="hi", max_output_tokens=16)
    assert response.output_text == SCRIPTED_ANSWER
    assert response.model == SMOLLM2 and cluster.last_params.model == SMOLLM2


def test_short_name_in_claude_messages(http: TestClient, cluster: CatalogCluster) -> None:
    client = anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )
    message = client.messages.create(
        model="smollm2:135m", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].type == "text" and message.content[0].text == SCRIPTED_ANSWER
    assert message.model == SMOLLM2 and cluster.last_params.model == SMOLLM2


@pytest.mark.parametrize("name", ["smollm2:135m", "smollm2:135m:latest", "smollm2-135m"])
def test_short_names_in_ollama_echo_the_name_sent(
    http: TestClient, cluster: CatalogCluster, name: str
) -> None:
    answer = http.post(
        "/ollama/api/chat",
        json={"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": False},
    )
    assert answer.status_code == 200, answer.text
    # Ollama answers with the name the client used.
    assert answer.json()["model"] == name and cluster.last_params.model == SMOLLM2


def test_unknown_short_name_is_a_404_in_each_dialect(http: TestClient) -> None:
    chat = http.post(
        "/v1/chat/completions",
        json={"model": "smollm2:999m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404 and chat.json()["error"]["param"] == "model"
    claude = http.post(
        "/v1/messages",
        json={
            "model": "qwen3:0.7b",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x"}],
        },
    )
    assert claude.status_code == 404 and claude.json()["type"] == "error"
    ollama = http.post("/ollama/api/show", json={"model": "qwen3:0.7b"})
    assert ollama.status_code == 404 and "qwen3:0.7b" in ollama.json()["error"]


def test_short_names_in_cluster_routes(http: TestClient, cluster: CatalogCluster) -> None:
    previews = http.get("/instance/previews", params={"model_id": "qwen3:0.6b"})
    assert previews.status_code == 200, previews.text
    placed = http.post("/place_instance", json={"model_id": "qwen3-0.6b"})
    assert placed.status_code == 200, placed.text
    assert placed.json()["model_id"] == QWEN3
    assert [command.model_id for command in cluster.placed] == [QWEN3]
    unknown = http.post("/place_instance", json={"model_id": "qwen3:0.7b"})
    assert unknown.status_code == 400 and "qwen3:0.7b" in unknown.json()["error"]["message"]


@pytest.mark.parametrize(
    "name", [SMOLLM2, "smollm2:135m", "qwen3-0.6b", "meta-llama/Llama-3.2-1B-Instruct"]
)
def test_retrieve_model_with_the_sdk(openai_client: openai.OpenAI, name: str) -> None:
    model = openai_client.models.retrieve(name)
    expected = load_builtin_cards()
    assert model.object == "model" and model.id in expected and model.owned_by == "exo"


def test_retrieve_model_with_an_encoded_slash_and_under_ollama(http: TestClient) -> None:
    for path in ("/v1/models/HuggingFaceTB%2FSmolLM2-135M-Instruct", "/ollama/v1/models/qwen3:8b"):
        answer = http.get(path)
        assert answer.status_code == 200, (path, answer.text)
    assert http.get("/ollama/v1/models/qwen3:8b").json()["id"] == "Qwen/Qwen3-8B"


def test_retrieve_unknown_model_is_openais_404(openai_client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.models.retrieve("nope/not-a-model")
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and body["type"] == "invalid_request_error"
    assert "nope/not-a-model" in body["message"]


def _prepare(models_directory: Path, model_id: str) -> None:
    directory = models_directory / model_directory_name(model_id)
    directory.mkdir(parents=True)
    (directory / COMPLETION_MARKER).write_text("{}")


def test_servable_models_and_the_catalog(
    http: TestClient,
    openai_client: openai.OpenAI,
    cluster: CatalogCluster,
    empty_models_directory: Path,
) -> None:
    assert [model.id for model in openai_client.models.list()] == [SMOLLM2]
    catalog = http.get("/models").json()
    assert len(catalog) == len(cluster.cards) >= 30
    qwen3 = next(card for card in catalog if card["model_id"] == QWEN3)
    assert qwen3["short_name"] == "qwen3:0.6b" and qwen3["sources"]
    assert http.get("/models", params={"status": "downloaded"}).json() == []

    # Downloaded: on this node's disk, or reported complete by another node.
    _prepare(empty_models_directory, QWEN3)
    cluster.state = make_state(
        instances=[make_instance(cluster.node_id)],
        downloads={NodeId("node-b"): {LLAMA: DownloadCompleted(path="/models/llama")}},
    )
    served = [model.id for model in openai_client.models.list()]
    assert served[0] == SMOLLM2 and set(served) == {SMOLLM2, QWEN3, LLAMA}
    downloaded = http.get("/models", params={"status": "downloaded"}).json()
    assert {card["model_id"] for card in downloaded} == {QWEN3, LLAMA}
    assert http.get("/models", params={"status": "lost"}).status_code in (400, 422)

    tags = http.get("/ollama/api/tags").json()["models"]
    assert {tag["model"] for tag in tags} == {SMOLLM2, QWEN3, LLAMA}
    qwen3_tag = next(tag for tag in tags if tag["model"] == QWEN3)
    assert qwen3_tag["details"]["parameter_size"] == "600M"
    assert qwen3_tag["details"]["quantization_level"] == "INT4"


def test_ollama_show_lists_what_the_model_can_do(http: TestClient) -> None:
    smollm2 = http.post("/ollama/api/show", json={"model": "smollm2:135m"}).json()
    assert smollm2["capabilities"] == ["completion", "tools"]
    assert smollm2["details"]["quantization_level"] == "Q4_1"  # its GGUF's file type
    qwen3 = http.post("/ollama/api/show", json={"model": "qwen3:0.6b"}).json()
    assert qwen3["capabilities"] == ["completion", "tools", "thinking"]
    assert qwen3["model_info"]["qwen3.attention.key_length"] == 128
    ps = http.get("/ollama/api/ps").json()["models"]
    assert [(model["model"], model["details"]["quantization_level"]) for model in ps] == [
        (SMOLLM2, "Q4_1")
    ]


def test_the_catalog_shows_what_a_runner_found_against_its_card(
    http: TestClient, cluster: CatalogCluster
) -> None:
    """`card_mismatches` of a ready (or running) runner reach its model's card in `/models`;
    other cards list none."""
    from exo.shared.types.runners import RunnerReady, RunnerRunning

    instance = make_instance(cluster.node_id)
    (runner_id,) = instance.shard_assignments.runner_to_shard
    found = ("num_key_value_heads: card 3, config.json 5",)
    for status in (RunnerReady(card_mismatches=found), RunnerRunning(card_mismatches=found)):
        cluster.state = make_state(
            instances=[instance], runners={runner_id: (cluster.node_id, status)}
        )
        catalog = {card["model_id"]: card for card in http.get("/models").json()}
        assert catalog[SMOLLM2]["card_mismatches"] == list(found)
        assert all(not c["card_mismatches"] for m, c in catalog.items() if m != SMOLLM2)
