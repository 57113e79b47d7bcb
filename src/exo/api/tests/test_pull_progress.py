"""Ollama's pull lines made from a Hub download's progress, and a pull of a Hub model
through the API streaming them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from exo.api.app import create_app
from exo.api.ollama.file_routes import pull_progress_lines
from exo.shared.types.commands import AddCustomModel
from exo.shared.types.common import CommandId
from exo.shared.types.downloads import DownloadProgress, FileProgress
from exo.shared.types.models import HuggingFaceSource
from exo.testing.builders import make_card
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.in_process import in_process_cluster

WEIGHTS_SHA256 = "ab" * 32
REPO = "someone/tiny-pull"


def test_each_file_is_one_pulling_line_with_its_digest_and_bytes() -> None:
    progress = DownloadProgress(
        downloaded_bytes=1500,
        total_bytes=5000,
        speed_bytes_per_second=100.0,
        eta_seconds=35.0,
        files=(
            FileProgress(path="config.json", downloaded_bytes=500, total_bytes=500),
            FileProgress(
                path="model.safetensors",
                downloaded_bytes=1000,
                total_bytes=4500,
                sha256=WEIGHTS_SHA256,
            ),
        ),
    )
    lines = [line.model_dump(exclude_none=True) for line in pull_progress_lines(progress)]
    assert lines == [
        {"status": "pulling config.json", "total": 500, "completed": 500},
        {
            "status": f"pulling {WEIGHTS_SHA256[:12]}",
            "digest": f"sha256:{WEIGHTS_SHA256}",
            "total": 4500,
            "completed": 1000,
        },
    ]


def _use_hub(monkeypatch: pytest.MonkeyPatch, hub: HubServer, tmp_path: Path) -> None:
    """This process's downloads go to the stand-in Hub, into `tmp_path`'s models directory."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_TOKEN_PATH", "/nonexistent/exo-test-token")
    monkeypatch.setenv("EXO_MODELS_DIR", str(tmp_path / "models"))
    for name in ("HF_TOKEN", "EXO_MODELS_DIRS", "EXO_MODELS_READ_ONLY_DIRS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.anyio
async def test_pulling_a_hub_model_streams_each_files_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    card = make_card(n_layers=6, model_id=REPO).model_copy(
        update={"source": HuggingFaceSource(repo_id=REPO)}
    )
    with HubServer() as hub:
        hub.add_directory(REPO, save_layered_checkout(tmp_path / "checkout"))
        _use_hub(monkeypatch, hub, tmp_path)
        async with in_process_cluster(tmp_path) as cluster:
            await cluster.client.submit(AddCustomModel(command_id=CommandId.new(), card=card))
            transport = httpx.ASGITransport(app=create_app(cluster.client))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
                response = await http.post("/ollama/api/pull", json={"model": REPO})
    assert response.status_code == 200
    lines = [json.loads(line) for line in response.text.splitlines() if line]
    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-1] == {"status": "success"}
    weights = [line for line in lines if str(line.get("digest", "")).startswith("sha256:")]
    assert weights, lines
    finals: dict[str, dict[str, int]] = {}
    for line in weights:
        finals[line["digest"]] = line
    assert len(finals) >= 4  # one digest per weight file (and the summary line)
    assert all(line["completed"] == line["total"] for line in finals.values())
    assert (tmp_path / "models" / "someone--tiny-pull" / ".exo-complete").is_file()


@pytest.mark.anyio
async def test_concurrent_pulls_and_deletes_of_one_model_never_answer_5xx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the long fuzz: two pulls of one model wrote the same `.partial` files (one
    answered 500 when the other renamed them away) and a delete removed files a pull was
    verifying. Now the model's lock orders them: every pull succeeds (a streamed one ends
    with its success line), every delete is 200 or 404, or 409 while a pull holds the
    files."""
    import anyio

    card = make_card(n_layers=6, model_id=REPO).model_copy(
        update={"source": HuggingFaceSource(repo_id=REPO)}
    )
    with HubServer() as hub:
        hub.add_directory(REPO, save_layered_checkout(tmp_path / "checkout"))
        _use_hub(monkeypatch, hub, tmp_path)
        answers: list[tuple[str, int, str]] = []
        async with in_process_cluster(tmp_path) as cluster:
            await cluster.client.submit(AddCustomModel(command_id=CommandId.new(), card=card))
            transport = httpx.ASGITransport(app=create_app(cluster.client))
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1", timeout=60
            ) as http:

                async def send(kind: str) -> None:
                    if kind == "delete":
                        response = await http.request(
                            "DELETE", "/ollama/api/delete", json={"model": REPO}
                        )
                    else:
                        body = {"model": REPO, "stream": kind == "stream"}
                        response = await http.post("/ollama/api/pull", json=body)
                    answers.append((kind, response.status_code, response.text))

                kinds = ["pull", "stream", "delete", "pull", "stream", "pull"] * 4
                async with anyio.create_task_group() as task_group:
                    for kind in kinds:
                        task_group.start_soon(send, kind)
    assert len(answers) == len(kinds)
    for kind, status, text in answers:
        if kind == "delete":
            assert status in (200, 404, 409), (status, text)
        else:
            assert status == 200, (kind, status, text)
            last = json.loads(text.splitlines()[-1])
            assert last == {"status": "success"}, (kind, text[-300:])
