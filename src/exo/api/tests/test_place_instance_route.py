"""`POST /place_instance` through the app, a real cluster client and a real master:
exo's own spelling of `sharding`, and placements sent before any node has reported."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from exo.api import cluster as cluster_module
from exo.api.app import create_app
from exo.shared.types.commands import PlaceInstance
from exo.shared.types.events import InstanceCreated
from exo.testing.builders import SMOLLM2
from exo.testing.in_process import InProcessCluster, in_process_cluster

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 10


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with in_process_cluster(tmp_path) as running:
        yield running


def http_client(cluster: InProcessCluster) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=create_app(cluster.client))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:52415")


@pytest.mark.parametrize(
    ("sharding", "instance_kind"),
    [
        ("Pipeline", "PipelineInstance"),  # exo's API and dashboard
        ("Tensor", "TensorInstance"),
        ("pipeline", "PipelineInstance"),
        ("tensor", "TensorInstance"),
    ],
)
async def test_sharding_is_taken_in_exo_spelling_and_ours(
    cluster: InProcessCluster, sharding: str, instance_kind: str
) -> None:
    cluster.report_node()
    async with http_client(cluster) as http:
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post(
                "/place_instance", json={"model_id": SMOLLM2, "sharding": sharding}
            )
    assert response.status_code == 200, response.text
    instance = response.json()["instance"]
    assert instance["kind"] == instance_kind
    [created] = [e for e in cluster.logged_events() if isinstance(e, InstanceCreated)]
    assert type(created.instance).__name__ == instance_kind


async def test_unknown_sharding_is_refused_naming_the_field(cluster: InProcessCluster) -> None:
    sent = cluster.commands.subscribe()
    async with http_client(cluster) as http:
        response = await http.post(
            "/place_instance", json={"model_id": SMOLLM2, "sharding": "Diagonal"}
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "sharding"
    with pytest.raises(anyio.WouldBlock):
        sent.receive_nowait()  # refused at the boundary: no command was sent


async def test_placement_sent_before_the_node_reported_waits_for_its_report(
    cluster: InProcessCluster,
) -> None:
    sent = cluster.commands.subscribe()
    responses: list[httpx.Response] = []
    async with http_client(cluster) as http:

        async def place() -> None:
            responses.append(await http.post("/place_instance", json={"model_id": SMOLLM2}))

        with anyio.fail_after(DEADLINE_SECONDS):
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(place)
                await anyio.wait_all_tasks_blocked()
                with pytest.raises(anyio.WouldBlock):
                    sent.receive_nowait()  # waiting for the report, not refused
                assert responses == []
                cluster.report_node()
                assert isinstance((await sent.receive()).command, PlaceInstance)
    [response] = responses
    assert response.status_code == 200, response.text
    assert list(cluster.state.instances) == [response.json()["instance_id"]]


async def test_wait_for_node_reports_is_bounded(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that never reports: after the bounded wait, the master's own reason."""
    monkeypatch.setattr(cluster_module, "NODE_REPORTS_TIMEOUT_SECONDS", 0.2)
    async with http_client(cluster) as http:
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/place_instance", json={"model_id": SMOLLM2})
    assert response.status_code == 400
    assert "no nodes are known" in response.json()["error"]["message"]
