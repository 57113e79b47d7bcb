"""`POST /models/add`, `DELETE /models/custom/{id}` and `GET /models/search` through the
app, a real cluster client and a real master, with the loopback Hub test server; encoder
models (embedding, rerank) are added and searched as supported, as placement serves them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.api.serving.cluster_client import LoadOnRequest
from exo.node_options import parse_args
from exo.shared.types.common import ModelId
from exo.shared.types.events import CustomModelAdded, CustomModelDeleted, InstanceCreated
from exo.testing.builders import SMOLLM2, make_instance
from exo.testing.hf_server import HubServer
from exo.testing.in_process import NODE, InProcessCluster, in_process_cluster
from exo.testing.processes import free_port
from exo.testing.random_moe_gguf import MoeGgufShape, write_random_moe_gguf
from exo.testing.tiny_encoders import save_tiny_embedding_model, save_tiny_reranker
from exo.testing.tiny_gguf import save_tiny_gguf
from exo.testing.tiny_models import save_tiny_checkout

pytestmark = pytest.mark.anyio

REPO = "someone/tiny-llama"
GATED_REPO = "someone/tiny-gated"
CUSTOM_CODE_REPO = "someone/tiny-custom-code"
FOREIGN_REPO = "someone/tiny-foreign"
# Another organisation's copy of a catalog model: same bare repository name.
NAMESAKE = "someone/SmolLM2-135M-Instruct"
# Catalog encoders (BertModel, XLMRobertaForSequenceClassification) on the loopback Hub.
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
BGE_RERANKER = "BAAI/bge-reranker-v2-m3"


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkouts")
    auto_map = {"auto_map": {"AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}}
    return {
        REPO: save_tiny_checkout(root / "llama"),
        CUSTOM_CODE_REPO: save_tiny_checkout(root / "custom", config_update=auto_map),
        FOREIGN_REPO: save_tiny_checkout(
            root / "foreign", config_update={"architectures": ["FalconForCausalLM"]}
        ),
        MINILM: save_tiny_embedding_model(root / "bert", "bert"),
        BGE_RERANKER: save_tiny_reranker(root / "reranker"),
    }


@pytest.fixture(scope="module")
def hub(checkouts: dict[str, Path]) -> Iterator[HubServer]:
    with HubServer() as server:
        for repo_id, directory in checkouts.items():
            server.add_directory(repo_id, directory)
        server.add_directory(GATED_REPO, checkouts[REPO], gated="manual", tokens={"hf_good"})
        # A repository under a catalog model's id: search marks it as that catalog model.
        server.add_directory(SMOLLM2, checkouts[REPO])
        server.add_directory(NAMESAKE, checkouts[REPO])
        yield server


@pytest.fixture
async def cluster(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[InProcessCluster]:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    async with in_process_cluster(tmp_path) as running:
        yield running


def http_client(cluster: InProcessCluster) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(cluster.client))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:52415")


def openai_error(response: httpx.Response, status_code: int, error_type: str) -> str:
    assert response.status_code == status_code, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == error_type
    message: str = error["message"]
    return message


async def test_an_added_model_is_in_the_state_and_listed(cluster: InProcessCluster) -> None:
    async with http_client(cluster) as client:
        response = await client.post("/models/add", json={"model_id": REPO})
        assert response.status_code == 200, response.text
        assert response.json()["model_id"] == REPO
        assert response.json()["card"]["source"]["repo_id"] == REPO
        assert REPO in cluster.state.custom_cards
        listed = [card["model_id"] for card in (await client.get("/models")).json()]
        assert listed[0] == SMOLLM2
        assert REPO in listed
        # It resolves like a catalog model: by id in any case and by its bare name.
        for name in (REPO, REPO.upper(), "tiny-llama"):
            retrieved = await client.get(f"/v1/models/{name}")
            assert retrieved.status_code == 200, retrieved.text
            assert retrieved.json()["id"] == REPO
        previews = await client.get("/instance/previews", params={"model_id": "tiny-llama"})
        assert previews.status_code == 200, previews.text
    added = [e for e in cluster.logged_events() if isinstance(e, CustomModelAdded)]
    assert [event.card.model_id for event in added] == [REPO]


async def test_the_catalogs_names_stay_the_catalogs(cluster: InProcessCluster) -> None:
    async with http_client(cluster) as client:
        assert (await client.post("/models/add", json={"model_id": NAMESAKE})).status_code == 200
        for name, meant in (
            ("SmolLM2-135M-Instruct", SMOLLM2),
            ("smollm2:135m", SMOLLM2),
            (NAMESAKE, NAMESAKE),
            (NAMESAKE.lower(), NAMESAKE),
        ):
            retrieved = await client.get(f"/v1/models/{name}")
            assert retrieved.status_code == 200, retrieved.text
            assert retrieved.json()["id"] == meant, name


async def test_adding_it_again_replaces_the_card(cluster: InProcessCluster) -> None:
    async with http_client(cluster) as client:
        for _ in range(2):
            response = await client.post("/models/add", json={"model_id": REPO})
            assert response.status_code == 200, response.text
    assert list(cluster.state.custom_cards) == [REPO]


async def test_a_local_directory_is_added_under_its_path(
    cluster: InProcessCluster, checkouts: dict[str, Path]
) -> None:
    directory = str(checkouts[REPO])
    async with http_client(cluster) as client:
        response = await client.post("/models/add", json={"model_id": directory})
        assert response.status_code == 200, response.text
        assert response.json()["card"]["source"] == {
            "kind": "LocalDirectorySource",
            "path": directory,
        }
        # The id is a path, written after `models/` with its slash or without.
        for url in (f"/v1/models/{directory}", f"/v1/models{directory}"):
            retrieved = await client.get(url)
            assert retrieved.status_code == 200, (url, retrieved.text)
            assert retrieved.json()["id"] == directory
        # The route's `{model_id:path}` takes its slashes.
        deleted = await client.delete(f"/models/custom/{directory}")
        assert deleted.status_code == 200, deleted.text
        assert cluster.state.custom_cards == {}
        # A user writes the path with one slash after `custom`: the same directory.
        again = await client.post("/models/add", json={"model_id": directory})
        assert again.status_code == 200, again.text
        deleted = await client.delete(f"/models/custom{directory}")
        assert deleted.status_code == 200, deleted.text
        missing = await client.delete(f"/models/custom{directory}")
        assert missing.status_code == 404
        assert "ModelId(" not in missing.json()["error"]["message"]
    assert cluster.state.custom_cards == {}


async def test_ollamas_delete_forgets_a_local_directory_and_leaves_its_files(
    cluster: InProcessCluster, checkouts: dict[str, Path]
) -> None:
    """`ollama rm` of a model added from a directory: gone from the list (as Ollama's delete
    leaves it), its directory untouched (the session-41 trial got a 404 "not found")."""
    directory = checkouts[REPO]
    files = sorted(path.name for path in directory.iterdir())
    async with http_client(cluster) as client:
        added = await client.post("/models/add", json={"model_id": str(directory)})
        assert added.status_code == 200, added.text
        tags = (await client.get("/ollama/api/tags")).json()["models"]
        assert str(directory) in [tag["model"] for tag in tags]
        deleted = await client.request(
            "DELETE", "/ollama/api/delete", json={"model": str(directory)}
        )
        assert deleted.status_code == 200, deleted.text
        await _until_applied(cluster)
        assert cluster.state.custom_cards == {}
        tags = (await client.get("/ollama/api/tags")).json()["models"]
        assert str(directory) not in [tag["model"] for tag in tags]
        again = await client.request("DELETE", "/ollama/api/delete", json={"model": str(directory)})
        assert again.status_code == 404
        assert again.json() == {"error": f"model '{directory}' not found"}
    assert sorted(path.name for path in directory.iterdir()) == files


async def test_refusals_in_openai_error_shape(cluster: InProcessCluster) -> None:
    async with http_client(cluster) as client:
        add = "/models/add"
        message = openai_error(
            await client.post(add, json={"model_id": GATED_REPO}), 401, "authentication_error"
        )
        assert "HF_TOKEN" in message
        message = openai_error(
            await client.post(add, json={"model_id": FOREIGN_REPO}), 400, "invalid_request_error"
        )
        assert "FalconForCausalLM" in message
        message = openai_error(
            await client.post(add, json={"model_id": CUSTOM_CODE_REPO}),
            400,
            "invalid_request_error",
        )
        assert "--trust-remote-code" in message
        message = openai_error(
            await client.post(add, json={"model_id": "nobody/nothing"}),
            404,
            "invalid_request_error",
        )
        assert "nobody/nothing" in message
        message = openai_error(
            await client.post(add, json={"model_id": "smollm2:135m"}), 409, "conflict_error"
        )
        assert SMOLLM2 in message
        message = openai_error(
            await client.post(add, json={"model_id": "not a repository"}),
            400,
            "invalid_request_error",
        )
        assert "org/name" in message
        openai_error(await client.post(add, json={}), 400, "invalid_request_error")
    assert cluster.state.custom_cards == {}


async def test_custom_code_with_the_flag(cluster: InProcessCluster) -> None:
    cluster.client.trust_remote_code = True
    async with http_client(cluster) as client:
        response = await client.post("/models/add", json={"model_id": CUSTOM_CODE_REPO})
        assert response.status_code == 200, response.text
        # The flag lets custom code in, not architectures without a family file.
        refused = await client.post("/models/add", json={"model_id": FOREIGN_REPO})
        assert refused.status_code == 400, refused.text


async def test_an_offline_node_adds_no_hub_model(tmp_path: Path, hub: HubServer) -> None:
    offline = LoadOnRequest(offline=True)
    async with (
        in_process_cluster(tmp_path, load_on_request=offline) as running,
        http_client(running) as client,
    ):
        response = await client.post("/models/add", json={"model_id": REPO})
    assert "--offline" in openai_error(response, 400, "invalid_request_error")


def hub_cache_copy(cache: Path, repo_id: str, checkout: Path, commit: str) -> Path:
    """`checkout` laid out as the Hugging Face cache keeps `repo_id` at `commit`: blobs,
    a snapshot of links to them, and `refs/main` naming the commit."""
    repository = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repository / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repository / "blobs").mkdir()
    for path in checkout.iterdir():
        blob = repository / "blobs" / f"{path.name}.blob"
        blob.write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(blob)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(commit)
    return snapshot


async def test_an_offline_node_adds_a_hub_model_it_has_on_disk(
    tmp_path: Path, checkouts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    cache = tmp_path / "hf-cache"
    hub_cache_copy(cache, REPO, checkouts[REPO], commit)
    models = tmp_path / "models"
    incomplete = models / FOREIGN_REPO.replace("/", "--")  # config.json only: not a copy
    incomplete.mkdir(parents=True)
    (incomplete / "config.json").write_bytes((checkouts[REPO] / "config.json").read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("EXO_MODELS_DIRS", str(models))
    offline = LoadOnRequest(offline=True)
    async with (
        in_process_cluster(tmp_path / "node", load_on_request=offline) as running,
        http_client(running) as client,
    ):
        response = await client.post("/models/add", json={"model_id": REPO})
        assert response.status_code == 200, response.text
        card = running.client.state.custom_cards[ModelId(REPO)]
        # Named as the repository, pinned to the cached commit: the download step finds
        # the same snapshot and uses it in place.
        assert card.source.model_dump() == {
            "kind": "HuggingFaceSource",
            "repo_id": REPO,
            "revision": commit,
        }
        assert card.architecture == "LlamaForCausalLM" and card.storage_size_bytes > 0
        missing = await client.post("/models/add", json={"model_id": FOREIGN_REPO})
        message = openai_error(missing, 400, "invalid_request_error")
        assert "--offline" in message and "no whole copy" in message and str(cache) in message


async def test_a_node_without_the_hub_points_to_offline_when_it_has_a_copy(
    tmp_path: Path, checkouts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not `--offline`, no Hub: a 503 either way, which names `--offline` and the copy's
    place only when a whole copy of the repository is on the node."""
    cache = tmp_path / "hf-cache"
    snapshot = hub_cache_copy(cache, REPO, checkouts[REPO], "0123456789abcdef" * 2 + "01234567")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("EXO_MODELS_DIRS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    async with in_process_cluster(tmp_path / "node") as running, http_client(running) as client:
        cached = await client.post("/models/add", json={"model_id": REPO})
        absent = await client.post("/models/add", json={"model_id": FOREIGN_REPO})
    message = openai_error(cached, 503, "service_unavailable_error")
    assert "cannot reach" in message and "--offline" in message and str(snapshot) in message
    other = openai_error(absent, 503, "service_unavailable_error")
    assert "cannot reach" in other and "--offline" not in other


async def test_delete_refusals(cluster: InProcessCluster) -> None:
    async with http_client(cluster) as client:
        assert (await client.post("/models/add", json={"model_id": REPO})).status_code == 200
        message = openai_error(
            await client.delete(f"/models/custom/{SMOLLM2}"), 400, "invalid_request_error"
        )
        assert "catalog model" in message
        openai_error(
            await client.delete("/models/custom/nobody/nothing"), 404, "invalid_request_error"
        )
        # A placed instance keeps its model.
        card = cluster.state.custom_cards[ModelId(REPO)]
        instance = make_instance(NODE, card, instance_id="custom-instance")
        cluster.master.emit([InstanceCreated(instance=instance)])
        await _until_applied(cluster)
        message = openai_error(
            await client.delete("/models/custom/tiny-llama"), 409, "conflict_error"
        )
        assert "custom-instance" in message
        deleted_instance = await client.delete("/instance/custom-instance")
        assert deleted_instance.status_code == 200, deleted_instance.text
        deleted = await client.delete(f"/models/custom/{REPO}")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {"model_id": REPO, "status": "deleted"}
        listed = [card["model_id"] for card in (await client.get("/models")).json()]
        assert REPO not in listed
        assert (await client.get(f"/v1/models/{REPO}")).status_code == 404
    assert any(isinstance(e, CustomModelDeleted) for e in cluster.logged_events())


async def _until_applied(cluster: InProcessCluster) -> None:
    """Wait (bounded) until the replica holds every event the master logged."""
    with anyio.fail_after(5):
        while cluster.state.last_event_applied_idx < len(cluster.event_log.events) - 1:
            await anyio.sleep(0.01)


async def test_search_marks_catalog_custom_and_supported(cluster: InProcessCluster) -> None:
    async with http_client(cluster) as client:
        assert (await client.post("/models/add", json={"model_id": REPO})).status_code == 200
        response = await client.get("/models/search", params={"query": "tiny", "limit": 10})
        assert response.status_code == 200, response.text
        results = {result["model_id"]: result for result in response.json()}
        assert set(results) == {REPO, GATED_REPO, CUSTOM_CODE_REPO, FOREIGN_REPO}
        assert results[REPO]["custom"] and results[REPO]["supported"]
        assert results[FOREIGN_REPO]["supported"] is False
        assert results[FOREIGN_REPO]["architecture"] == "FalconForCausalLM"
        assert results[GATED_REPO]["gated"]
        catalog = (await client.get("/models/search", params={"query": "smollm2"})).json()
        assert [(r["model_id"], r["catalog_id"]) for r in catalog] == [
            (SMOLLM2, SMOLLM2),
            (NAMESAKE, None),  # the same bare name under another organisation is not it
        ]
        limited = await client.get("/models/search", params={"query": "tiny", "limit": 1})
        assert len(limited.json()) == 1
        too_many = await client.get("/models/search", params={"limit": 1000})
        assert too_many.status_code == 400


async def test_search_marks_catalog_encoders_supported(cluster: InProcessCluster) -> None:
    """Trial 42: all-MiniLM (BertModel) and the bge reranker were `supported: false` on a
    node that served them (the route knew only the decoder family files)."""
    async with http_client(cluster) as client:
        for query, repo_id in (("MiniLM", MINILM), ("bge-reranker", BGE_RERANKER)):
            response = await client.get("/models/search", params={"query": query})
            assert response.status_code == 200, response.text
            (result,) = [r for r in response.json() if r["model_id"] == repo_id]
            assert result["architecture"] != "LlamaForCausalLM", result
            assert result["supported"] is True, result


async def test_a_local_encoder_and_reranker_are_added_with_their_capability(
    cluster: InProcessCluster, checkouts: dict[str, Path]
) -> None:
    """Trial 42: a local sentence-transformers folder of a BERT was a 400 ("no model family
    file"). Its card says what the catalog's encoder cards say: the one capability, no chat
    template, one node, the tokens one input may have (RoBERTa: the positions after the
    padding index, 40 - 2)."""
    async with http_client(cluster) as client:
        for repo_id, capability, context in (
            (MINILM, "embedding", 512),
            (BGE_RERANKER, "rerank", 38),
        ):
            directory = str(checkouts[repo_id])
            response = await client.post("/models/add", json={"model_id": directory})
            assert response.status_code == 200, response.text
            card = response.json()["card"]
            assert card["capabilities"] == [capability], card
            assert card["has_chat_template"] is False and card["supports_tensor"] is False
            assert card["context_length"] == context, card
        await _until_applied(cluster)
        listed = {model["id"] for model in (await client.get("/v1/models")).json()["data"]}
        assert {str(checkouts[MINILM]), str(checkouts[BGE_RERANKER])} <= listed


async def test_search_without_a_hub_is_503(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    async with http_client(cluster) as client:
        response = await client.get("/models/search", params={"query": "tiny"})
    assert "cannot reach" in openai_error(response, 503, "service_unavailable_error")


def test_the_trust_remote_code_flag() -> None:
    assert parse_args(["--trust-remote-code"]).trust_remote_code
    assert not parse_args([]).trust_remote_code


async def test_local_path_refusals_say_what_was_found(
    cluster: InProcessCluster, checkouts: dict[str, Path], tmp_path: Path
) -> None:
    """A revision with a path, a GGUF without its extension, a directory named `*.gguf`, a
    directory of GGUF files and a MoE GGUF missing an expert tensor: each a 400 that says
    what it found."""
    gguf = save_tiny_gguf(tmp_path / "tiny.gguf")
    unnamed = tmp_path / "tiny-model"
    unnamed.write_bytes(gguf.read_bytes())
    folder = tmp_path / "folder.gguf"
    folder.mkdir()
    gguf_only = tmp_path / "gguf-only"  # a directory of GGUF files, no config.json
    gguf_only.mkdir()
    for name in ("d.gguf", "c.gguf", "b.gguf"):
        (gguf_only / name).write_bytes(gguf.read_bytes())
    (gguf_only / "a.gguf").write_bytes(b"")  # sorts first, but is no example to give
    moe = write_random_moe_gguf(tmp_path / "moe.gguf", MoeGgufShape(), "F32")[0]
    moe.write_bytes(moe.read_bytes().replace(b"blk.1.ffn_up_exps", b"blk.1.ffn_up_expx"))
    async with http_client(cluster) as client:
        add = "/models/add"
        for path in (str(checkouts[REPO]), str(gguf)):
            response = await client.post(add, json={"model_id": path, "revision": "main"})
            message = openai_error(response, 400, "invalid_request_error")
            assert response.json()["error"]["param"] == "revision"
            assert "not a Hub repository" in message
        message = openai_error(
            await client.post(add, json={"model_id": str(unnamed)}), 400, "invalid_request_error"
        )
        assert "GGUF file without the .gguf extension" in message
        message = openai_error(
            await client.post(add, json={"model_id": str(folder)}), 400, "invalid_request_error"
        )
        assert "is a directory, not a GGUF file" in message
        message = openai_error(
            await client.post(add, json={"model_id": str(gguf_only)}), 400, "invalid_request_error"
        )
        assert "holds GGUF files (a.gguf, b.gguf, c.gguf and 1 more)" in message, message
        assert f"add one GGUF file by its path, e.g. {gguf_only / 'b.gguf'}" in message
        message = openai_error(
            await client.post(add, json={"model_id": str(moe)}), 400, "invalid_request_error"
        )
        assert "blk.1.ffn_up_exps.weight" in message
        # The whole GGUF is added as before.
        added = await client.post(add, json={"model_id": str(gguf)})
        assert added.status_code == 200, added.text
    assert list(cluster.state.custom_cards) == [ModelId(str(gguf))]
