"""Hub downloads against the loopback Hub server: only the shard's files, resumed from
partial files, verified, retried, refused clearly, checked for disk first, progress in
order; and what each file-selection rule picks."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from exo.download.completion import missing_files, read_marker
from exo.download.fetch import (
    DownloadCancelledError,
    DownloadError,
    ExpectedFile,
    RetryPolicy,
    fetch_file,
    parse_retry_after,
    partial_path,
)
from exo.download.hub_download import HubDownload, download_from_hub
from exo.download.hub_listing import HubDownloadError
from exo.download.shard_files import small_files, tensor_on_shard, weight_files_for_shard
from exo.shared.types.downloads import DownloadProgress
from exo.testing.builders import make_card, make_shard
from exo.testing.hf_file_serving import corrupt_byte, cut_transfer, too_many_requests
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout

REPO = "someone/tiny-layered"
GATED = "someone/tiny-layered-gated"
TOKEN = "hf_good_token"
SMALL = {"config.json", "generation_config.json", "model.safetensors.index.json"}
SMALL |= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
# 6 layers, 2 per file: embedding | layers 0-1 | 2-3 | 4-5 + final norm.
EMBEDDING_FILE = "model-00001-of-00004.safetensors"
LAYERS_0_1 = "model-00002-of-00004.safetensors"
LAYERS_2_3 = "model-00003-of-00004.safetensors"
LAYERS_4_5 = "model-00004-of-00004.safetensors"
NO_WAIT = RetryPolicy(max_attempts=4, base_delay_seconds=0.0)
CARD = make_card(n_layers=6, model_id=REPO)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_layered_checkout(tmp_path_factory.mktemp("layered") / "repo")


@pytest.fixture
def hub(checkout: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_directory(REPO, checkout)
        server.add_directory(GATED, checkout, gated="manual", tokens={TOKEN})
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
        yield server


def download(directory: Path, shard_rank: int | None = 1, repo: str = REPO) -> HubDownload:
    shard = None if shard_rank is None else make_shard(CARD, device_rank=shard_rank, world_size=3)
    return HubDownload(REPO, repo, "main", shard, directory)


def weight_requests(hub: HubServer, repo: str = REPO) -> set[str]:
    return {name for name in hub.files_downloaded(repo) if name.endswith(".safetensors")}


def same_bytes(left: Path, right: Path) -> bool:
    return hashlib.sha256(left.read_bytes()).digest() == hashlib.sha256(right.read_bytes()).digest()


def test_a_middle_pipeline_rank_fetches_only_its_layers_file(
    hub: HubServer, checkout: Path, tmp_path: Path
) -> None:
    directory = download_from_hub(download(tmp_path / "model"), policy=NO_WAIT)
    assert weight_requests(hub) == {LAYERS_2_3}
    assert hub.files_downloaded(REPO) == SMALL | {LAYERS_2_3}
    assert same_bytes(directory / LAYERS_2_3, checkout / LAYERS_2_3)
    assert not (directory / LAYERS_0_1).exists()
    assert missing_files(directory, make_shard(CARD, device_rank=1, world_size=3)) == []
    # The first rank needs the embedding and its own layers, which are not there yet.
    first = make_shard(CARD, device_rank=0, world_size=3)
    assert missing_files(directory, first) == [EMBEDDING_FILE, LAYERS_0_1]


def test_a_second_shard_adds_its_files_and_a_ready_one_asks_for_no_file(
    hub: HubServer, tmp_path: Path
) -> None:
    directory = tmp_path / "model"
    download_from_hub(download(directory, 1), policy=NO_WAIT)
    download_from_hub(download(directory, 0), policy=NO_WAIT)
    assert weight_requests(hub) == {EMBEDDING_FILE, LAYERS_0_1, LAYERS_2_3}
    before = len(hub.requests)
    download_from_hub(download(directory, 0), policy=NO_WAIT)
    after = hub.requests[before:]
    assert [request for request in after if "/resolve/" in request.path] == []
    marker = read_marker(directory)
    assert marker is not None
    assert set(marker["files"]) == SMALL | {EMBEDDING_FILE, LAYERS_0_1, LAYERS_2_3}


def test_the_whole_model_fetches_every_weight_file(hub: HubServer, tmp_path: Path) -> None:
    download_from_hub(download(tmp_path / "model", None), policy=NO_WAIT)
    assert weight_requests(hub) == {EMBEDDING_FILE, LAYERS_0_1, LAYERS_2_3, LAYERS_4_5}


def test_a_cut_transfer_resumes_from_its_partial_file(
    hub: HubServer, checkout: Path, tmp_path: Path
) -> None:
    hub.hooks.append(cut_transfer(REPO, LAYERS_2_3, after_bytes=5000))
    directory = download_from_hub(download(tmp_path / "model"), policy=NO_WAIT)
    ranges = [r.range for r in hub.requests if r.filename == LAYERS_2_3 and r.method == "GET"]
    assert ranges == [None, "bytes=5000-"]
    assert same_bytes(directory / LAYERS_2_3, checkout / LAYERS_2_3)
    assert not partial_path(directory / LAYERS_2_3).exists()


def test_a_partial_file_left_by_a_stopped_node_is_resumed(
    hub: HubServer, checkout: Path, tmp_path: Path
) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    half = (checkout / LAYERS_2_3).stat().st_size // 2
    partial_path(directory / LAYERS_2_3).write_bytes((checkout / LAYERS_2_3).read_bytes()[:half])
    download_from_hub(download(directory), policy=NO_WAIT)
    ranges = [r.range for r in hub.requests if r.filename == LAYERS_2_3 and r.method == "GET"]
    assert ranges == [f"bytes={half}-"]
    assert same_bytes(directory / LAYERS_2_3, checkout / LAYERS_2_3)


def test_a_corrupted_file_is_detected_and_fetched_again(
    hub: HubServer, checkout: Path, tmp_path: Path
) -> None:
    hub.hooks.append(corrupt_byte(REPO, LAYERS_2_3, offset=1234))
    hub.hooks.append(corrupt_byte(REPO, "config.json", offset=3))  # a git-blob-checked file
    directory = download_from_hub(download(tmp_path / "model"), policy=NO_WAIT)
    assert hub.file_requests(REPO, LAYERS_2_3) == 2
    assert hub.file_requests(REPO, "config.json") == 2
    assert same_bytes(directory / LAYERS_2_3, checkout / LAYERS_2_3)
    assert same_bytes(directory / "config.json", checkout / "config.json")


def test_429_and_503_are_retried(hub: HubServer, checkout: Path, tmp_path: Path) -> None:
    hub.hooks.append(too_many_requests(REPO, LAYERS_2_3, retry_after="0", times=2))
    hub.hooks.append(too_many_requests(REPO, "config.json", times=1, status_code=503))
    directory = download_from_hub(download(tmp_path / "model"), policy=NO_WAIT)
    assert hub.file_requests(REPO, LAYERS_2_3) == 3
    assert hub.file_requests(REPO, "config.json") == 2
    assert same_bytes(directory / LAYERS_2_3, checkout / LAYERS_2_3)


def test_retry_after_is_honoured_and_attempts_are_bounded(
    hub: HubServer, checkout: Path, tmp_path: Path
) -> None:
    hub.hooks.append(too_many_requests(REPO, LAYERS_2_3, retry_after="7", times=100))
    data = (checkout / LAYERS_2_3).read_bytes()
    expected = ExpectedFile(len(data), "sha256", hashlib.sha256(data).hexdigest())
    waits: list[float] = []
    with httpx.Client() as client, pytest.raises(DownloadError, match="3 attempts failed"):
        fetch_file(
            client,
            f"{hub.url}/{REPO}/resolve/main/{LAYERS_2_3}",
            tmp_path / LAYERS_2_3,
            expected,
            policy=RetryPolicy(max_attempts=3),
            sleep=waits.append,
        )
    assert waits == [7.0, 7.0]
    assert hub.file_requests(REPO, LAYERS_2_3) == 3
    assert not (tmp_path / LAYERS_2_3).exists()


def test_parse_retry_after() -> None:
    assert parse_retry_after("12") == 12.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:30 GMT", now=1445412500.0) == 10.0


def test_a_failed_download_leaves_no_directory_that_looks_complete(
    hub: HubServer, tmp_path: Path
) -> None:
    hub.hooks.append(cut_transfer(REPO, LAYERS_2_3, after_bytes=100, times=100))
    directory = tmp_path / "model"
    with pytest.raises(HubDownloadError, match="attempts failed") as caught:
        download_from_hub(download(directory), policy=RetryPolicy(2, base_delay_seconds=0.0))
    assert caught.value.status_code == 503
    assert read_marker(directory) is None
    assert missing_files(directory, None) is None
    assert not (directory / LAYERS_2_3).exists()
    assert partial_path(directory / LAYERS_2_3).stat().st_size == 200


def test_a_gated_model_without_a_token_is_401_and_with_a_wrong_one_403(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(HubDownloadError, match="set HF_TOKEN") as caught:
        download_from_hub(download(tmp_path / "a", repo=GATED), policy=NO_WAIT)
    assert caught.value.status_code == 401
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(HubDownloadError, match="has no access") as caught:
        download_from_hub(download(tmp_path / "b", repo=GATED), policy=NO_WAIT)
    assert caught.value.status_code == 403
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    download_from_hub(download(tmp_path / "c", repo=GATED), policy=NO_WAIT)
    assert weight_requests(hub, GATED) == {LAYERS_2_3}


def test_an_unknown_repository_is_404(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubDownloadError) as caught:
        download_from_hub(download(tmp_path / "model", repo="someone/absent"))
    assert caught.value.status_code == 404


def test_a_disk_too_small_fails_before_downloading_weights(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubDownloadError, match="not enough disk space") as caught:
        download_from_hub(download(tmp_path / "model"), free_bytes=lambda _path: 10 * 2**20)
    assert caught.value.status_code == 507
    assert weight_requests(hub) == set()


def test_progress_arrives_in_order_and_ends_complete(hub: HubServer, tmp_path: Path) -> None:
    reports: list[DownloadProgress] = []
    lock = threading.Lock()

    def record(progress: DownloadProgress) -> None:
        with lock:
            reports.append(progress)

    download_from_hub(download(tmp_path / "model", None), on_progress=record, policy=NO_WAIT)
    assert reports, "no progress reported"
    totals = [report.downloaded_bytes for report in reports]
    assert totals == sorted(totals)
    assert [report.complete for report in reports] == [False] * (len(reports) - 1) + [True]
    final = reports[-1]
    assert final.downloaded_bytes == final.total_bytes > 0
    assert {file.path for file in final.files} >= {EMBEDDING_FILE, LAYERS_4_5}


def test_a_cancelled_download_keeps_its_partial_files(hub: HubServer, tmp_path: Path) -> None:
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(DownloadCancelledError):
        download_from_hub(download(tmp_path / "model"), cancelled=cancelled, policy=NO_WAIT)
    assert read_marker(tmp_path / "model") is None


def test_which_tensors_each_rank_loads() -> None:
    card = make_card(n_layers=6)
    first, middle, last = (make_shard(card, device_rank=rank, world_size=3) for rank in range(3))
    assert tensor_on_shard("model.embed_tokens.weight", first)
    assert not tensor_on_shard("model.embed_tokens.weight", middle)
    assert tensor_on_shard("model.embed_tokens.weight", last)  # a tied LM head
    assert tensor_on_shard("lm_head.weight", last) and not tensor_on_shard("lm_head.weight", first)
    assert tensor_on_shard("model.norm.weight", last)
    assert not tensor_on_shard("model.norm.weight", middle)
    assert tensor_on_shard("model.layers.3.mlp.up_proj.weight", middle)
    assert not tensor_on_shard("model.layers.4.mlp.up_proj.weight", middle)
    assert tensor_on_shard("language_model.model.layers.2.self_attn.q_proj.weight", middle)
    # A text card's shards read no vision tower; the whole model (no shard) has it.
    tower = "vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight"
    assert not any(tensor_on_shard(tower, shard) for shard in (first, middle, last))
    assert tensor_on_shard(tower, None)
    assert tensor_on_shard("model.layers.5.mlp.up_proj.weight", None)


def test_weight_files_without_an_index_and_with_a_broken_one() -> None:
    files = ["model.safetensors", "config.json", "sub/model.safetensors", "README.md"]
    assert weight_files_for_shard(files, None, None) == ("model.safetensors",)
    assert small_files(files) == ("config.json",)
    with pytest.raises(ValueError, match="weight_map"):
        weight_files_for_shard(files, {"metadata": {}}, None)
    with pytest.raises(ValueError, match=r"lacks: other\.safetensors"):
        weight_files_for_shard(files, {"weight_map": {"lm_head.weight": "other.safetensors"}}, None)


def test_a_kimi_checkout_fetches_its_tiktoken_ranks_but_not_its_code() -> None:
    """Kimi-K2's tokenizer is `tiktoken.model` plus `tokenizer_config.json` (exo builds it
    from them); its Python files are never fetched, as exo never runs them."""
    files = [
        "config.json", "tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py",
        "modeling_deepseek.py", "chat_template.jinja", "model-00001-of-00002.safetensors",
    ]  # fmt: skip
    assert small_files(files) == (
        "chat_template.jinja", "config.json", "tiktoken.model", "tokenizer_config.json",
    )  # fmt: skip
