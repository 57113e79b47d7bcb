"""Models already on this machine: the Hugging Face cache and read-only directories used
in place with no request, writable directories chosen by room, offline mode naming the
files it lacks."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from exo.download.locations import (
    ModelLocations,
    choose_download_directory,
    delete_downloaded_model,
)
from exo.download.pypi_gguf import ModelPreparationError, prepare_model
from exo.shared.types.models import HuggingFaceSource, ModelCard
from exo.testing.builders import make_card, make_shard
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout

REPO = "someone/tiny-local"
EMBEDDING_FILE = "model-00001-of-00004.safetensors"
LAYERS_0_1 = "model-00002-of-00004.safetensors"
LAYERS_2_3 = "model-00003-of-00004.safetensors"
CARD: ModelCard = make_card(n_layers=6, model_id=REPO).model_copy(
    update={"source": HuggingFaceSource(repo_id=REPO)}
)
FIRST = make_shard(CARD, device_rank=0, world_size=3)
MIDDLE = make_shard(CARD, device_rank=1, world_size=3)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_layered_checkout(tmp_path_factory.mktemp("local") / "repo")


@pytest.fixture
def hub(checkout: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(REPO, checkout)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
        for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "EXO_MODELS_DIRS", "EXO_MODELS_READ_ONLY_DIRS"):
            monkeypatch.delenv(name, raising=False)
        yield server


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` with its size and modification time (ns)."""
    return {
        str(path.relative_to(root)): (path.lstat().st_size, path.lstat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
    }


def test_a_model_in_the_hugging_face_cache_is_used_in_place_with_no_request(
    hub: HubServer, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    # The cache as huggingface_hub itself lays it out (blobs, refs, snapshot links).
    snapshot = Path(snapshot_download(REPO, cache_dir=str(tmp_path / "hf-cache"), endpoint=hub.url))
    before = len(hub.requests)
    directory = prepare_model(CARD, tmp_path / "models", offline=False, shard=FIRST)
    assert directory == snapshot
    assert hub.requests[before:] == []
    assert not (tmp_path / "models").exists()


def test_a_cache_snapshot_missing_the_shards_file_is_not_used(
    hub: HubServer, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    cache = tmp_path / "hf-cache"
    snapshot_download(REPO, cache_dir=str(cache), endpoint=hub.url, ignore_patterns=[LAYERS_2_3])
    assert prepare_model(CARD, tmp_path / "models", offline=False, shard=FIRST).parent == cache / (
        "models--someone--tiny-local/snapshots"
    )
    with pytest.raises(ModelPreparationError, match=f"lacks {LAYERS_2_3}"):
        prepare_model(CARD, tmp_path / "models", offline=True, shard=MIDDLE)


def test_a_read_only_directory_is_used_and_never_written(
    hub: HubServer, checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_only = tmp_path / "shared-models"
    shutil.copytree(checkout, read_only / "someone--tiny-local")
    incomplete = tmp_path / "other-models"
    shutil.copytree(checkout, incomplete / "someone" / "tiny-local")
    (incomplete / "someone" / "tiny-local" / LAYERS_2_3).unlink()
    writable = tmp_path / "models"
    monkeypatch.setenv("EXO_MODELS_DIRS", str(writable))
    # The incomplete copy comes first: the middle shard lacks its file there.
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", f"{incomplete}:{read_only}")
    before = {root: tree(root) for root in (read_only, incomplete)}
    directory = prepare_model(CARD, tmp_path / "unused", offline=False, shard=MIDDLE)
    assert directory == read_only / "someone--tiny-local"
    assert hub.requests == []
    # Without the complete copy the shard's file is downloaded into the writable one.
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(incomplete))
    directory = prepare_model(CARD, tmp_path / "unused", offline=False, shard=MIDDLE)
    assert directory == writable / "someone--tiny-local"
    assert {name for name in hub.files_downloaded(REPO) if name.endswith(".safetensors")} == {
        LAYERS_2_3
    }
    assert {root: tree(root) for root in (read_only, incomplete)} == before
    assert not (tmp_path / "unused").exists()


def test_offline_names_exactly_the_files_missing_and_sends_nothing(
    hub: HubServer, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    with pytest.raises(ModelPreparationError, match="is not on this node") as caught:
        prepare_model(CARD, models, offline=True, shard=MIDDLE)
    assert str(models / "someone--tiny-local") in str(caught.value)
    prepare_model(CARD, models, offline=False, shard=MIDDLE)
    requests = len(hub.requests)
    assert prepare_model(CARD, models, offline=True, shard=MIDDLE) == models / (
        "someone--tiny-local"
    )
    with pytest.raises(ModelPreparationError) as caught:
        prepare_model(CARD, models, offline=True, shard=FIRST)
    assert f"lacks {EMBEDDING_FILE}, {LAYERS_0_1}" in str(caught.value)
    assert len(hub.requests) == requests


def test_the_first_writable_directory_with_room_wins_and_a_partial_one_resumes(
    tmp_path: Path,
) -> None:
    full, roomy = tmp_path / "full", tmp_path / "roomy"
    locations = ModelLocations((full, roomy), (), tmp_path / "cache")
    free = {full: 10, roomy: 10_000}
    assert choose_download_directory(locations, REPO, 1000, free.__getitem__) == (
        roomy / "someone--tiny-local"
    )
    assert choose_download_directory(locations, REPO, 100_000, free.__getitem__) == (
        full / "someone--tiny-local"
    )
    (full / "someone--tiny-local").mkdir(parents=True)
    (full / "someone--tiny-local" / "config.json.partial").write_text("{")
    assert choose_download_directory(locations, REPO, 1000, free.__getitem__) == (
        full / "someone--tiny-local"
    )


def test_locations_come_from_the_environment(tmp_path: Path) -> None:
    environment = {
        "EXO_MODELS_DIRS": f"{tmp_path / 'a'}:{tmp_path / 'b'}",
        "EXO_MODELS_READ_ONLY_DIRS": str(tmp_path / "c"),
        "HF_HOME": str(tmp_path / "hf"),
    }
    locations = ModelLocations.from_environment(tmp_path / "default", environment)
    assert locations.writable == (tmp_path / "a", tmp_path / "b")
    assert locations.read_only == (tmp_path / "c",)
    assert locations.hub_cache == tmp_path / "hf" / "hub"
    fallback = ModelLocations.from_environment(tmp_path / "default", {"HF_HUB_CACHE": "/x"})
    assert fallback.writable == (tmp_path / "default",)
    assert fallback.hub_cache == Path("/x")


def test_a_model_in_the_hugging_face_cache_counts_as_downloaded(
    hub: HubServer, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    from exo.api.serving.cluster_client import ClusterClient
    from exo.api.serving.model_lookup import is_downloaded
    from exo.shared.types.state import State

    cluster = cast(ClusterClient, SimpleNamespace(state=State()))
    assert not is_downloaded(cluster, CARD, tmp_path / "models")
    snapshot_download(REPO, cache_dir=str(tmp_path / "hf-cache"), endpoint=hub.url)
    before = len(hub.requests)
    assert is_downloaded(cluster, CARD, tmp_path / "models")
    assert hub.requests[before:] == []


def test_exo_offline_in_the_environment_turns_offline_mode_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from exo.node_options import parse_args

    monkeypatch.delenv("EXO_OFFLINE", raising=False)
    assert not parse_args([]).offline
    assert parse_args(["--offline"]).offline
    for value, offline in (("1", True), ("true", True), ("0", False), ("false", False)):
        monkeypatch.setenv("EXO_OFFLINE", value)
        assert parse_args([]).offline is offline


def test_delete_skips_a_file_that_vanishes_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A download renaming its `.partial` file while the model is deleted (found by the
    long fuzz: DELETE /ollama/api/delete racing POST /download/start answered 500)."""
    target = tmp_path / "models" / "org--m"
    target.mkdir(parents=True)
    (target / "weights.safetensors.partial").write_bytes(b"x")
    (target / "config.json").write_bytes(b"{}")
    real_unlink = os.unlink
    vanished: list[str] = []

    def racing_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        real_unlink(path, *args, **kwargs)
        if str(path).endswith(".partial"):  # the downloader got there first
            vanished.append(str(path))
            raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(os, "unlink", racing_unlink)
    monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
    assert delete_downloaded_model(tmp_path / "models", "org/m") == [target]
    assert vanished and not target.exists()
