"""Models already on disk, found by bounded scans of fake models directories, a fake Hugging
Face cache and a fake Ollama store built here; through the API in
`exo/api/tests/test_models_on_disk_routes.py`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from exo.download import on_disk
from exo.download.gguf_models import ollama_store, ollama_store_models
from exo.download.locations import ModelLocations
from exo.download.on_disk import (
    ScanBudget,
    catalog_copies,
    download_reports,
    known_repositories,
    scan_on_disk,
)
from exo.shared.apply import apply
from exo.shared.models.architectures import ENGINE_ARCHITECTURES
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.events import IndexedEvent
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.state import State
from exo.testing.models_on_disk import (
    CATALOG_REPO,
    COMMIT,
    catalog_card,
    hub_cache_copy,
    write_checkout,
)

NODE = NodeId("node-1")


@pytest.fixture
def places(tmp_path: Path) -> ModelLocations:
    models = tmp_path / "models"
    read_only = tmp_path / "read-only"
    cache = tmp_path / "hf-cache"
    hub_cache_copy(cache, CATALOG_REPO)
    hub_cache_copy(cache, "someone/cached-llama")
    hub_cache_copy(cache, "someone/cached-falcon", architecture="FalconForCausalLM")
    # A snapshot whose blob was never fetched (a dangling link): not whole.
    partial = hub_cache_copy(cache, "someone/cached-partial")
    next(partial.parent.parent.joinpath("blobs").glob("*")).unlink()
    write_checkout(models / "someone--dir-llama")
    write_checkout(read_only / "someone" / "nested-qwen", "Qwen3ForCausalLM")
    (models / "someone--config-only").mkdir(parents=True)
    (models / "someone--config-only" / "config.json").write_text("{}")
    # A link out of the models directory is not followed.
    outside = write_checkout(tmp_path / "elsewhere" / "linked")
    (models / "someone--linked").symlink_to(outside, target_is_directory=True)
    return ModelLocations((models,), (read_only,), cache)


def test_the_scan_lists_whole_copies_no_card_names(places: ModelLocations) -> None:
    found = scan_on_disk(places, {CATALOG_REPO}, ENGINE_ARCHITECTURES)
    listed = {model.repo_id: model for model in found}
    assert set(listed) == {
        "someone/dir-llama",
        "someone/nested-qwen",
        "someone/cached-llama",
        "someone/cached-falcon",
    }
    assert listed["someone/dir-llama"].place == "models_dir"
    assert listed["someone/cached-llama"].place == "hf_cache"
    assert listed["someone/cached-llama"].path.name == COMMIT
    assert listed["someone/nested-qwen"].architecture == "Qwen3ForCausalLM"
    assert listed["someone/cached-llama"].supported
    falcon = listed["someone/cached-falcon"]
    assert falcon.architecture == "FalconForCausalLM" and not falcon.supported


def test_the_scan_stops_at_its_budget(places: ModelLocations) -> None:
    budget = ScanBudget.start()
    budget.entries_left = 2
    found = scan_on_disk(places, set(), ENGINE_ARCHITECTURES, budget)
    assert budget.exhausted and len(found) <= 2
    assert scan_on_disk(places, set(), ENGINE_ARCHITECTURES, ScanBudget.start(-1.0)) == []


def test_the_scan_reads_at_most_max_entries_per_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = tmp_path / "models"
    for index in range(5):
        write_checkout(models / f"someone--model-{index}")
    monkeypatch.setattr(on_disk, "MAX_ENTRIES", 3)
    found = scan_on_disk(ModelLocations((models,), (), tmp_path / "no-cache"), set(), set())
    assert len(found) == 3


def test_catalog_models_found_whole_are_reported_downloaded_once(
    places: ModelLocations,
) -> None:
    card = catalog_card()
    absent = catalog_card("someorg/not-here")
    cards = {card.model_id: card, absent.model_id: absent}
    copies = catalog_copies(places, cards)
    assert copies == {
        card.model_id: places.hub_cache / "models--someorg--catalog-model" / "snapshots" / COMMIT
    }
    reports = download_reports(NODE, State(), copies)
    assert [(event.model_id, event.status) for event in reports] == [
        (card.model_id, DownloadCompleted(path=str(copies[card.model_id])))
    ]
    state = apply(State(), IndexedEvent(idx=0, event=reports[0]))
    assert download_reports(NODE, state, copies) == []  # already known: nothing again
    assert known_repositories(cards) == {CATALOG_REPO, "someorg/not-here"}


def test_a_catalog_model_in_a_models_directory_is_found(tmp_path: Path) -> None:
    models = tmp_path / "models"
    write_checkout(models / CATALOG_REPO.replace("/", "--"))
    card = catalog_card()
    copies = catalog_copies(
        ModelLocations((models,), (), tmp_path / "cache"), {card.model_id: card}
    )
    assert copies == {ModelId(CATALOG_REPO): models / "someorg--catalog-model"}


def test_ollama_store_scan_stays_in_the_store(tmp_path: Path) -> None:
    store = tmp_path / "store"
    library = store / "manifests" / "registry.ollama.ai" / "library"
    blob_data = b"GGUF-ish"
    digest = hashlib.sha256(blob_data).hexdigest()
    (store / "blobs").mkdir(parents=True)
    (store / "blobs" / f"sha256-{digest}").write_bytes(blob_data)

    def manifest(directory: Path, layer_digest: str) -> None:
        layer = {"mediaType": "application/vnd.ollama.image.model", "digest": layer_digest}
        directory.mkdir(parents=True)
        (directory / "latest").write_text(json.dumps({"layers": [layer]}))

    manifest(library / "good", f"sha256:{digest}")
    # A digest that would name a path outside the blobs directory.
    (store / "blobs" / "sha256-").mkdir()
    (store / "secret").write_bytes(b"not a blob")
    manifest(library / "traversal", "sha256:/../../secret")
    # A manifest directory linked from outside the store.
    manifest(tmp_path / "outside" / "linked", f"sha256:{digest}")
    (library / "linked").symlink_to(tmp_path / "outside" / "linked", target_is_directory=True)
    assert [model.name for model in ollama_store_models(store)] == ["good:latest"]


def test_the_ollama_store_of_the_linux_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    service = tmp_path / "usr-share-ollama"
    service.mkdir()
    assert ollama_store({}, service) == service
    (tmp_path / "home" / ".ollama" / "models").mkdir(parents=True)
    assert ollama_store({}, service) == tmp_path / "home" / ".ollama" / "models"
    assert ollama_store({"OLLAMA_MODELS": str(tmp_path / "x")}, service) == tmp_path / "x"
