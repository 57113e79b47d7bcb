"""`POST /download/start`, `POST /download/cancel` and `DELETE /download/{node}/{model}`
through the API, a real master and a real worker, against the loopback Hub: progress
events in order ending complete, cancel keeps the partial files, delete removes the files,
refusals in OpenAI's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.download.fetch import PARTIAL_SUFFIX
from exo.download.peers import HUB_ASSUMED_MBPS
from exo.shared.local_events import LocalEventSender
from exo.shared.types.events import NodeDownloadProgress
from exo.shared.types.models import HuggingFaceSource, ModelCard
from exo.shared.types.nodes import (
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
    DownloadStatus,
)
from exo.testing.builders import make_card
from exo.testing.hf_file_serving import too_many_requests
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.in_process import NODE, InProcessCluster, in_process_cluster
from exo.worker.main import Worker

REPO = "someone/tiny-control"
CARD: ModelCard = make_card(n_layers=6, model_id=REPO).model_copy(
    update={"source": HuggingFaceSource(repo_id=REPO)}
)
LAYERS_2_3 = "model-00003-of-00004.safetensors"
DEADLINE_SECONDS = 30.0
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_layered_checkout(tmp_path_factory.mktemp("control") / "repo")


@asynccontextmanager
async def node(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[InProcessCluster, httpx.AsyncClient, Path, Worker]]:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
    for name in ("HF_TOKEN", "EXO_MODELS_DIRS", "EXO_MODELS_READ_ONLY_DIRS"):
        monkeypatch.delenv(name, raising=False)
    models = tmp_path / "models"
    async with in_process_cluster(tmp_path, cards={CARD.model_id: CARD}) as cluster:
        assert cluster.applied is not None
        local_events = LocalEventSender(NODE, cluster.local_events.sender())
        worker = Worker(
            node_id=NODE,
            current_state=lambda: cluster.state,
            applied_events=cluster.applied.subscribe(),
            local_events=local_events,
            publish_chunk=lambda _node, _chunk: None,
            models_dir=models,
        )
        cluster.report_node()
        transport = httpx.ASGITransport(app=create_app(cluster.client))
        async with (
            anyio.create_task_group() as task_group,
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:52415") as http,
        ):
            task_group.start_soon(worker.run)
            task_group.start_soon(local_events.run)
            with anyio.fail_after(DEADLINE_SECONDS):
                while NODE not in cluster.state.node_info:
                    await anyio.sleep(0.02)
            yield cluster, http, models / "someone--tiny-control", worker
            task_group.cancel_scope.cancel()


async def status_becomes(cluster: InProcessCluster, kind: type[DownloadStatus]) -> DownloadStatus:
    with anyio.fail_after(DEADLINE_SECONDS):
        while True:
            status = cluster.state.downloads.get(NODE, {}).get(CARD.model_id)
            if isinstance(status, kind):
                return status
            await anyio.sleep(0.02)


def statuses(cluster: InProcessCluster) -> list[DownloadStatus]:
    return [
        event.status
        for event in cluster.logged_events()
        if isinstance(event, NodeDownloadProgress) and event.model_id == CARD.model_id
    ]


async def test_start_reports_progress_in_order_and_delete_removes_the_files(
    tmp_path: Path, checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HubServer() as hub:
        hub.add_directory(REPO, checkout)
        async with node(tmp_path, hub, monkeypatch) as (cluster, http, directory, worker):
            started = await http.post("/download/start", json={"model": REPO})
            assert started.status_code == 200, started.text
            assert started.json() == {"node_id": NODE, "model_id": REPO, "action": "start"}
            completed = await status_becomes(cluster, DownloadCompleted)
            assert isinstance(completed, DownloadCompleted)
            assert Path(completed.path) == directory
            assert (directory / LAYERS_2_3).is_file()
            reported = statuses(cluster)
            assert isinstance(reported[-1], DownloadCompleted)
            assert all(isinstance(status, DownloadOngoing) for status in reported[:-1])
            progress = [
                status.progress.downloaded_bytes
                for status in reported
                if isinstance(status, DownloadOngoing) and status.progress is not None
            ]
            assert progress == sorted(progress)
            # The Hub's speed, measured by this download, replaces the assumed one.
            assert worker._hub_mbps != HUB_ASSUMED_MBPS
            deleted = await http.delete(f"/download/{NODE}/{REPO}")
            assert deleted.status_code == 200, deleted.text
            await status_becomes(cluster, DownloadPending)
            assert not directory.exists()


async def test_cancel_stops_a_download_and_keeps_its_partial_files(
    tmp_path: Path, checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HubServer() as hub:
        hub.add_directory(REPO, checkout)
        # One weight file keeps answering 429 "come back in a minute".
        hub.hooks.append(too_many_requests(REPO, LAYERS_2_3, retry_after="60", times=1000))
        async with node(tmp_path, hub, monkeypatch) as (cluster, http, directory, _worker):
            assert (await http.post("/download/start", json={"model": REPO})).status_code == 200
            with anyio.fail_after(DEADLINE_SECONDS):
                while hub.file_requests(REPO, LAYERS_2_3) == 0:
                    await anyio.sleep(0.02)
            cancelled = await http.post("/download/cancel", json={"model": REPO, "node_id": NODE})
            assert cancelled.status_code == 200, cancelled.text
            failed = await status_becomes(cluster, DownloadFailed)
            assert isinstance(failed, DownloadFailed) and "cancelled" in failed.error_message
            assert hub.file_requests(REPO, LAYERS_2_3) == 1
            assert (directory / "config.json").is_file()
            assert not (directory / ".exo-complete").exists()
            assert not (directory / (LAYERS_2_3 + PARTIAL_SUFFIX)).exists()


async def test_refusals_come_in_openai_shape(
    tmp_path: Path, checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with HubServer() as hub:
        hub.add_directory(REPO, checkout)
        async with node(tmp_path, hub, monkeypatch) as (_cluster, http, _directory, _worker):
            unknown_node = await http.post(
                "/download/start", json={"model": REPO, "node_id": "no-such-node"}
            )
            assert unknown_node.status_code == 404
            assert unknown_node.json()["error"]["code"] == "node_not_found"
            unknown_model = await http.post("/download/start", json={"model": "no/such"})
            assert unknown_model.status_code == 404
            assert "not found" in unknown_model.json()["error"]["message"]
            assert hub.requests == []
