"""A model that can never load, through the app, a real cluster client and a real master
with stand-in runners: once the master deletes its instance after runner failures of the
model's own (`RunnerFailed.permanent`), every dialect answers a final 500 naming the reason,
and the next request is answered at once without placing it again, until the failure is
forgotten (its window, a completed download); a failure that may pass stays a 503.
(On the old code the request got a 503 and every retry placed the model again.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from exo.api.serving.cluster_client import LoadOnRequest
from exo.api.serving.load_on_request import LOAD_FAILED
from exo.api.tests.test_load_on_request import (
    DEADLINE_SECONDS,
    DIALECT_REQUESTS,
    placements,
    running,
    wait_for,
)
from exo.master.main import MAX_INSTANCE_FAILURES
from exo.shared.types.events import NodeDownloadProgress, RunnerStatusUpdated
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.runners import RunnerFailed
from exo.testing.builders import SMOLLM2
from exo.testing.in_process import NODE, InProcessCluster

pytestmark = pytest.mark.anyio

REASON = "loading failed: tensor model.layers.1.mlp.down_proj.weight has shape (64, 127)"
CHAT = "/v1/chat/completions"
# The dialects whose error has no code: Claude's says `api_error`, Ollama's is a string.
EXPECTED_CODE = {
    "/v1/messages": "api_error",
    "/ollama/api/chat": None,
    "/ollama/api/generate": None,
}


async def fail_loads(cluster: InProcessCluster, permanent: bool) -> None:
    """Stand-in runners that fail to load every instance `MAX_INSTANCE_FAILURES` times
    (with `REASON`, the model's own failure when `permanent`), as a runner retried with
    backoff reports each try."""
    failed: dict[str, int] = {}
    while True:
        for instance in cluster.state.instances.values():
            count = failed.get(instance.instance_id, 0)
            if count < MAX_INSTANCE_FAILURES:
                failed[instance.instance_id] = count + 1
                runner_id = instance.shard_assignments.rank_zero_runner()
                status = RunnerFailed(error_message=REASON, permanent=permanent)
                cluster.emit_local(
                    RunnerStatusUpdated(runner_id=runner_id, node_id=NODE, status=status)
                )
        await anyio.sleep(0.01)


def error_of(response: httpx.Response) -> tuple[str, str | None]:
    """The error's message and code in the dialect's shape (Ollama's has no code, Claude's
    carries its type instead)."""
    error = response.json()["error"]
    if isinstance(error, str):
        return error, None
    return error["message"], error.get("code", error.get("type"))


async def post(http: httpx.AsyncClient, endpoint: str, body: dict[str, Any]) -> httpx.Response:
    with anyio.fail_after(DEADLINE_SECONDS):
        return await http.post(endpoint, json=body)


@pytest.mark.parametrize("endpoint", DIALECT_REQUESTS)
async def test_a_model_that_cannot_load_is_a_final_error_and_is_not_placed_again(
    tmp_path: Path, endpoint: str
) -> None:
    async with (
        running(tmp_path, loaded_at_once=False) as (cluster, http, _loaded),
        anyio.create_task_group() as task_group,
    ):
        task_group.start_soon(fail_loads, cluster, True)
        first = await post(http, endpoint, DIALECT_REQUESTS[endpoint])
        assert first.status_code == 500, first.text
        message, code = error_of(first)
        assert REASON in message and "failed to load it repeatedly" in message
        assert code == EXPECTED_CODE.get(endpoint, LOAD_FAILED)
        assert cluster.state.load_failures[SMOLLM2].reason == REASON

        second = await post(http, endpoint, DIALECT_REQUESTS[endpoint])
        assert second.status_code == 500, second.text
        message, _code = error_of(second)
        assert REASON in message and "not loaded on request again within 300 s" in message
        assert len(placements(cluster)) == 1  # the second request placed nothing
        task_group.cancel_scope.cancel()


async def test_the_openai_error_names_the_code_and_a_request_mid_load_hears_the_reason(
    tmp_path: Path,
) -> None:
    """A request that finds the instance still loading is sent to it (no wait of its own):
    the instance's deletion ends its stream with the same reason, a 500."""
    async with (
        running(tmp_path, loaded_at_once=False) as (cluster, http, _loaded),
        anyio.create_task_group() as task_group,
    ):
        placed = await post(http, "/place_instance", {"model_id": SMOLLM2})
        assert placed.status_code == 200, placed.text
        await wait_for(lambda: cluster.state.instances, "the placement")
        joined: list[httpx.Response] = []

        async def join() -> None:
            joined.append(await post(http, CHAT, DIALECT_REQUESTS[CHAT]))

        task_group.start_soon(join)
        await wait_for(lambda: cluster.state.tasks, "the request routed to the loading instance")
        task_group.start_soon(fail_loads, cluster, True)
        await wait_for(lambda: joined, "the joined request's answer")
        assert joined[0].status_code == 500, joined[0].text
        assert REASON in error_of(joined[0])[0]
        again = await post(http, CHAT, DIALECT_REQUESTS[CHAT])
        assert again.status_code == 500
        assert error_of(again)[1] == LOAD_FAILED
        assert len(placements(cluster)) == 1
        task_group.cancel_scope.cancel()


async def test_a_failure_that_may_pass_stays_503_and_the_next_request_places_again(
    tmp_path: Path,
) -> None:
    async with (
        running(tmp_path, loaded_at_once=False) as (cluster, http, _loaded),
        anyio.create_task_group() as task_group,
    ):
        task_group.start_soon(fail_loads, cluster, False)
        for placed in (1, 2):
            response = await post(http, CHAT, DIALECT_REQUESTS[CHAT])
            assert response.status_code == 503, response.text
            assert "unloaded before it finished loading" in error_of(response)[0]
            assert len(placements(cluster)) == placed
        assert cluster.state.load_failures == {}
        task_group.cancel_scope.cancel()


async def test_the_failure_is_forgotten_after_its_window_or_a_completed_download(
    tmp_path: Path,
) -> None:
    settings = LoadOnRequest(load_failure_seconds=0.0)  # remembered for no time at all
    async with (
        running(tmp_path, settings, loaded_at_once=False) as (cluster, http, _loaded),
        anyio.create_task_group() as task_group,
    ):
        task_group.start_soon(fail_loads, cluster, True)
        for placed in (1, 2):
            response = await post(http, CHAT, DIALECT_REQUESTS[CHAT])
            assert response.status_code == 500, response.text
            assert "failed to load it repeatedly" in error_of(response)[0]
            assert len(placements(cluster)) == placed
        download = NodeDownloadProgress(
            node_id=NODE, model_id=SMOLLM2, status=DownloadCompleted(path=str(tmp_path))
        )
        cluster.emit_local(download)
        await wait_for(lambda: not cluster.state.load_failures, "the failure forgotten")
        task_group.cancel_scope.cancel()
