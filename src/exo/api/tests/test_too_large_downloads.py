"""A model that needs more memory than the cluster's nodes have together is not downloaded:
`POST /download/start` (the dashboard's Download button) and Ollama's `/api/pull` answer
409 naming the sizes, before any file is fetched."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from exo.api.app import create_app
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.in_process import in_process_cluster

pytestmark = pytest.mark.anyio

GLM = ModelId("zai-org/GLM-4.5-Air")
NODE_MIB = 24 * 1024  # the trial's node: 24 GiB


async def test_a_model_no_node_set_can_hold_is_refused_before_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_MODELS_DIR", str(tmp_path / "models"))
    card = load_builtin_cards()[GLM]
    async with in_process_cluster(tmp_path, cards={GLM: card}) as cluster:
        cluster.report_node(available_mb=NODE_MIB)
        assert await cluster.client.wait_for_node_reports(timeout=10)
        transport = httpx.ASGITransport(app=create_app(cluster.client))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            started = await http.post("/download/start", json={"model": "glm-4.5-air:106b"})
            pulled = await http.post("/ollama/api/pull", json={"model": GLM})
    assert started.status_code == 409, started.text
    message = started.json()["error"]["message"]
    assert message.startswith(f"{GLM} does not fit this cluster: it needs 73.7 GiB")
    assert "(218 GB of files)" in message and "1 node(s) have 24.0 GiB in all" in message
    assert pulled.status_code == 409, pulled.text
    assert pulled.json() == {"error": message}
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
