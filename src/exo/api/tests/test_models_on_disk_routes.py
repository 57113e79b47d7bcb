"""Models already on a node's disk through the API, with a real cluster client and master:
a catalog model in the Hugging Face cache is reported downloaded on the node (the event a
download ends with) and listed so by `/models`, `/v1/models` and Ollama's `/api/tags`;
models no card names are listed by `GET /models/on_disk`; an Ollama model is added by
`ollama:<name>`."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.download.locations import ModelLocations
from exo.download.on_disk import catalog_copies, download_reports
from exo.shared.constants import models_dir
from exo.shared.types.common import ModelId
from exo.shared.types.nodes import DownloadCompleted
from exo.testing.in_process import NODE, InProcessCluster, in_process_cluster
from exo.testing.models_on_disk import COMMIT, catalog_card, hub_cache_copy
from exo.testing.tiny_gguf import add_to_ollama_store, save_tiny_gguf

pytestmark = pytest.mark.anyio


def http_client(cluster: InProcessCluster) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(cluster.client))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:52415")


async def report_models_on_disk(cluster: InProcessCluster) -> int:
    """What a node does at start (`Node._report_models_on_disk`), then wait until the
    replica holds the reports."""
    locations = ModelLocations.from_environment(models_dir())
    copies = catalog_copies(locations, cluster.client.cards)
    reports = download_reports(NODE, cluster.state, copies)
    for event in reports:
        cluster.emit_local(event)
    with anyio.fail_after(5):
        while not all(
            isinstance(cluster.state.downloads.get(NODE, {}).get(model_id), DownloadCompleted)
            for model_id in copies
        ):
            await anyio.sleep(0.01)
    return len(reports)


async def test_models_on_disk_join_without_a_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "hf-cache"
    snapshot = hub_cache_copy(cache, "someorg/catalog-model")
    hub_cache_copy(cache, "someone/cached-llama")
    hub_cache_copy(cache, "someone/cached-falcon", architecture="FalconForCausalLM")
    hub_cache_copy(cache, "someone/cached-bert", architecture="BertModel")  # an encoder
    store = tmp_path / "ollama"
    add_to_ollama_store(store, "mytiny", "latest", save_tiny_gguf(tmp_path / "tiny.gguf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("EXO_MODELS_DIRS", str(tmp_path / "models"))
    monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    card = catalog_card()
    async with (
        in_process_cluster(tmp_path / "node", cards={card.model_id: card}) as cluster,
        http_client(cluster) as client,
    ):
        before = (await client.get("/models")).json()
        assert before[0]["downloaded_on"] == []
        assert await report_models_on_disk(cluster) == 1
        assert await report_models_on_disk(cluster) == 0  # a rescan repeats nothing
        assert cluster.state.downloads[NODE][card.model_id] == DownloadCompleted(path=str(snapshot))
        # Another node, whose disk lacks the model, lists it from the state alone.
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        [listed] = (await client.get("/models", params={"status": "downloaded"})).json()
        assert listed["model_id"] == card.model_id and listed["downloaded_on"] == [NODE]
        served = [model["id"] for model in (await client.get("/v1/models")).json()["data"]]
        assert served == [card.model_id]
        tags = (await client.get("/ollama/api/tags")).json()["models"]
        assert [tag["model"] for tag in tags] == [card.model_id]
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))

        on_disk = {
            entry["model_id"]: entry for entry in (await client.get("/models/on_disk")).json()
        }
        assert set(on_disk) == {
            "someone/cached-llama",
            "someone/cached-falcon",
            "someone/cached-bert",
            "ollama:mytiny:latest",
        }
        assert on_disk["someone/cached-llama"]["place"] == "hf_cache"
        assert on_disk["someone/cached-llama"]["path"].endswith(COMMIT)
        assert on_disk["someone/cached-llama"]["supported"] is True
        assert on_disk["someone/cached-bert"]["supported"] is True  # served as placement does
        falcon = on_disk["someone/cached-falcon"]
        assert falcon["supported"] is False and "FalconForCausalLM" in falcon["reason"]
        ollama = on_disk["ollama:mytiny:latest"]
        assert ollama["place"] == "ollama" and ollama["supported"] is True
        assert ollama["architecture"] == "LlamaForCausalLM"

        added = await client.post("/models/add", json={"model_id": "ollama:mytiny"})
        assert added.status_code == 200, added.text
        assert added.json()["model_id"] == "mytiny:latest"
        source = added.json()["card"]["source"]
        assert source["kind"] == "GgufFileSource" and source["path"] == ollama["path"]
        assert ModelId("mytiny:latest") in cluster.state.custom_cards
        remaining = {entry["model_id"] for entry in (await client.get("/models/on_disk")).json()}
        assert "ollama:mytiny:latest" not in remaining
        # The added Ollama model's blob is on this node: reported like the catalog model.
        assert await report_models_on_disk(cluster) == 1
        downloaded = {
            entry["model_id"]: entry["downloaded_on"]
            for entry in (await client.get("/models")).json()
        }
        assert downloaded["mytiny:latest"] == [NODE]

        missing = await client.post("/models/add", json={"model_id": "ollama:nothing:1b"})
        assert missing.status_code == 404, missing.text
        assert "Ollama store" in missing.json()["error"]["message"]
