"""`POST /place_instance` through the app, a real cluster client and a real master:
exo's own spelling of `sharding`, and placements sent before any node has reported."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.api.serving import cluster_client as cluster_module
from exo.shared.types.commands import PlaceInstance
from exo.shared.types.events import InstanceCreated, NodeGatheredInfo
from exo.testing.builders import SMOLLM2, make_node_info, make_node_speed, smollm2_card
from exo.testing.in_process import NODE, InProcessCluster, in_process_cluster

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
        ("Pipeline", "pipeline"),  # exo's API and dashboard
        ("Tensor", "tensor"),
        ("pipeline", "pipeline"),
        ("tensor", "tensor"),
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
    assert instance["sharding"] == instance_kind
    [created] = [e for e in cluster.logged_events() if isinstance(e, InstanceCreated)]
    assert created.instance.sharding == instance_kind


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


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"node_ids": []}, "node_ids", "node_ids is empty"),
        ({"sharding": "expert"}, "sharding", "not a mixture-of-experts model"),
    ],
)
async def test_placement_refusals_name_their_field(
    cluster: InProcessCluster, body: dict[str, object], param: str, words: str
) -> None:
    cluster.report_node()
    async with http_client(cluster) as http:
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/place_instance", json={"model_id": SMOLLM2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], words in error["message"]) == (param, True), error
    assert cluster.state.instances == {}


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


async def test_previews_carry_the_predicted_speed_once_the_node_measured_it(
    cluster: InProcessCluster,
) -> None:
    async def preview(prompt_tokens: int) -> dict[str, object]:
        with anyio.fail_after(DEADLINE_SECONDS):
            while NODE not in cluster.client.state.node_info:
                await anyio.sleep(0.01)
        async with http_client(cluster) as http:
            answer = await http.get(
                "/instance/previews", params={"model_id": SMOLLM2, "prompt_tokens": prompt_tokens}
            )
        assert answer.status_code == 200, answer.text
        first: dict[str, object] = answer.json()[0]
        assert (first["sharding"], first["node_count"], first["error"]) == ("pipeline", 1, None)
        return first

    cluster.report_node()
    unmeasured = await preview(128)
    assert unmeasured["predicted_decode_tokens_per_second"] is None
    assert unmeasured["predicted_ttft_seconds"] is None
    speed = make_node_speed()
    info = make_node_info(4096).model_copy(update={"speed": speed})
    cluster.emit_local(NodeGatheredInfo(node_id=NODE, info=info))
    with anyio.fail_after(DEADLINE_SECONDS):
        while cluster.client.state.node_info[NODE].speed is None:
            await anyio.sleep(0.01)
    short, long = await preview(128), await preview(4096)
    assert short["prediction_prompt_tokens"] == 128 and long["prediction_prompt_tokens"] == 4096
    short_rate, long_rate = (
        short["predicted_decode_tokens_per_second"],
        long["predicted_decode_tokens_per_second"],
    )
    assert isinstance(short_rate, float) and isinstance(long_rate, float)
    assert short_rate > long_rate > 0
    assert isinstance(short["predicted_ttft_seconds"], float)
    assert isinstance(long["predicted_ttft_seconds"], float)
    assert 0 < short["predicted_ttft_seconds"] < long["predicted_ttft_seconds"]
    async with http_client(cluster) as http:
        refused = await http.get(
            "/instance/previews", params={"model_id": SMOLLM2, "prompt_tokens": 0}
        )
    assert refused.status_code == 400 and "prompt_tokens" in refused.text


async def test_previews_refuse_a_prompt_beyond_the_context_length(
    cluster: InProcessCluster,
) -> None:
    context = smollm2_card().context_length
    async with http_client(cluster) as http:
        with anyio.fail_after(DEADLINE_SECONDS):
            fits = await http.get(
                "/instance/previews", params={"model_id": SMOLLM2, "prompt_tokens": context}
            )
            beyond = await http.get(
                "/instance/previews", params={"model_id": SMOLLM2, "prompt_tokens": context + 1}
            )
    assert fits.status_code == 200, fits.text
    assert beyond.status_code == 400, beyond.text
    error = beyond.json()["error"]
    assert error["param"] == "prompt_tokens"
    assert f"context length of {context} tokens" in error["message"]
