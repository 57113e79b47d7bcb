"""Ollama's pull and delete of one model, forced into the interleaving that raced: the
preparation has returned (the model's file lock is free again) and the pull has not yet
measured and reported the files when the delete arrives. The preparation is a stand-in
that writes the files and then waits for the test; each step waits on an event or on a
condition with a deadline, never on a fixed sleep."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from exo.api.ollama import file_routes
from exo.api.tests.serving import scripted_app
from exo.download.pypi_gguf import COMPLETION_MARKER, model_directory_name
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadCompleted, DownloadPending
from exo.testing.builders import SMOLLM2, make_state
from exo.testing.scripted_cluster import ScriptedCluster

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 10.0
WEIGHTS = b"\0" * 1000


class StandInPreparation:
    """`prepare_model` as a pull calls it: writes the model's directory (a weights file and
    the completion marker), runs `after_writing`, says so on `prepared`, then returns once
    `resume` is set."""

    def __init__(self, after_writing: Callable[[Path], None] = lambda _path: None) -> None:
        self.prepared = threading.Event()
        self.resume = threading.Event()
        self.after_writing = after_writing

    def __call__(self, card: ModelCard, models_dir: Path, *_args: Any, **_kwargs: Any) -> Path:
        path = models_dir / model_directory_name(card.model_id)
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(WEIGHTS)
        (path / COMPLETION_MARKER).write_text("{}")
        self.after_writing(path)
        self.prepared.set()
        if not self.resume.wait(DEADLINE_SECONDS):
            raise TimeoutError("the test never let the preparation return")
        return path


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EXO_MODELS_DIR", str(tmp_path / "models"))
    for name in ("EXO_MODELS_DIRS", "EXO_MODELS_READ_ONLY_DIRS"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "models"


def unplaced_cluster() -> ScriptedCluster:
    cluster = ScriptedCluster()
    cluster.state = make_state()  # no instance of the model, so a delete is allowed
    return cluster


async def wait_until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(DEADLINE_SECONDS):
        while not condition():
            await anyio.sleep(0.01)


async def test_a_delete_arriving_between_preparation_and_report_waits_for_the_pull(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preparation = StandInPreparation()
    monkeypatch.setattr(file_routes, "prepare_model", preparation)
    cluster = unplaced_cluster()
    app = scripted_app(cluster)
    answers: dict[str, httpx.Response] = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:

        async def pull() -> None:
            answers["pull"] = await http.post("/ollama/api/pull", json={"model": SMOLLM2})

        async def delete() -> None:
            body = {"model": SMOLLM2}
            answers["delete"] = await http.request("DELETE", "/ollama/api/delete", json=body)

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(pull)
            await wait_until(preparation.prepared.is_set)
            # The files are written and nothing holds the model's file lock: the delete
            # must still wait until the pull has measured and reported them.
            task_group.start_soon(delete)
            files_lock = file_routes.model_files_lock(app.state, SMOLLM2)
            await wait_until(lambda: files_lock.statistics().tasks_waiting == 1)
            assert "delete" not in answers
            preparation.resume.set()

    pull_lines = [json.loads(line) for line in answers["pull"].text.splitlines()]
    assert answers["pull"].status_code == 200
    assert pull_lines[-2]["total"] == pull_lines[-2]["completed"] == len(WEIGHTS) + 2
    assert pull_lines[-1] == {"status": "success"}
    assert answers["delete"].status_code == 200, answers["delete"].text
    assert not (models_dir / model_directory_name(SMOLLM2)).exists()
    recorded = [(model_id, type(status)) for model_id, status in cluster.downloads_recorded]
    assert recorded == [(SMOLLM2, DownloadCompleted), (SMOLLM2, DownloadPending)]


async def test_a_delete_waiting_longer_than_its_bound_for_a_pull_is_409(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preparation = StandInPreparation()
    monkeypatch.setattr(file_routes, "prepare_model", preparation)
    monkeypatch.setattr(file_routes, "DELETE_WAIT_SECONDS", 0.05)
    cluster = unplaced_cluster()
    transport = httpx.ASGITransport(app=scripted_app(cluster))
    answers: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:

        async def pull() -> None:
            body = {"model": SMOLLM2, "stream": False}
            answers["pull"] = await http.post("/ollama/api/pull", json=body)

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(pull)
            await wait_until(preparation.prepared.is_set)
            with anyio.fail_after(DEADLINE_SECONDS):
                body = {"model": SMOLLM2}
                deleted = await http.request("DELETE", "/ollama/api/delete", json=body)
            preparation.resume.set()
    assert deleted.status_code == 409
    assert "is being pulled" in deleted.json()["error"]
    assert answers["pull"].json() == {"status": "success"}
    assert (models_dir / model_directory_name(SMOLLM2) / "model.safetensors").is_file()
    recorded = [(model_id, type(status)) for model_id, status in cluster.downloads_recorded]
    assert recorded == [(SMOLLM2, DownloadCompleted)]


@pytest.mark.parametrize("stream", [True, False])
async def test_files_deleted_past_the_api_during_a_pull_answer_not_found(
    models_dir: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """Another deleter (this node's worker, a node sharing the models directory) removes
    the files right after the preparation: the pull answers Ollama's not-found error and
    reports nothing complete."""

    def delete_behind_the_api(path: Path) -> None:
        for file in path.iterdir():
            file.unlink()
        path.rmdir()

    preparation = StandInPreparation(after_writing=delete_behind_the_api)
    preparation.resume.set()
    monkeypatch.setattr(file_routes, "prepare_model", preparation)
    cluster = unplaced_cluster()
    transport = httpx.ASGITransport(app=scripted_app(cluster))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        with anyio.fail_after(DEADLINE_SECONDS):
            answer = await http.post("/ollama/api/pull", json={"model": SMOLLM2, "stream": stream})
    expected = {
        "error": f"model '{SMOLLM2}' not found: its files were deleted while it was being "
        "pulled; pull it again"
    }
    if stream:
        assert answer.status_code == 200
        assert json.loads(answer.text.splitlines()[-1]) == expected
    else:
        assert answer.status_code == 404
        assert answer.json() == expected
    assert cluster.downloads_recorded == []
