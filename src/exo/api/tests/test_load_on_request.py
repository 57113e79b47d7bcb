"""Load on request through the app, a real cluster client and a real master, with stand-in
runners: every dialect places a model that has no instance and answers once it is ready;
concurrent requests place it once; `--no-auto-place`, files that are nowhere and too little
memory are answered as documented; keep-alives unload; Ollama's pull and delete."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from fastapi import Request

from exo.api.app import create_app
from exo.api.serving import load_on_request
from exo.api.serving.cluster_client import LoadOnRequest
from exo.api.serving.load_on_request import ensure_instance
from exo.api.wire.errors import GenerationError
from exo.download.pypi_gguf import COMPLETION_MARKER, model_directory_name
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import TokenChunk, Usage
from exo.shared.types.common import ModelId, RunnerId, TaskId
from exo.shared.types.events import (
    InstanceCreated,
    NodeDownloadProgress,
    RunnerStatusUpdated,
    TaskStatusUpdated,
)
from exo.shared.types.nodes import DownloadFailed
from exo.shared.types.runners import RunnerReady
from exo.shared.types.tasks import TaskComplete
from exo.testing.builders import SMOLLM2
from exo.testing.in_process import NODE, InProcessCluster, in_process_cluster

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 10
ANSWER = "Hi there."
QWEN3 = ModelId("Qwen/Qwen3-0.6B")  # a Hugging Face model: not on this machine
CARDS = {
    model_id: card
    for model_id, card in load_builtin_cards().items()
    if model_id in (SMOLLM2, QWEN3)
}
USER_HI = {"role": "user", "content": "hi"}
# One chat or completion request of every dialect.
DIALECT_REQUESTS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "smollm2:135m", "messages": [USER_HI], "max_tokens": 4},
    "/v1/completions": {"model": SMOLLM2, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": SMOLLM2, "input": "hi", "max_output_tokens": 16},
    "/v1/messages": {"model": SMOLLM2, "messages": [USER_HI], "max_tokens": 4},
    "/ollama/api/chat": {"model": "smollm2:135m", "messages": [USER_HI], "stream": False},
    "/ollama/api/generate": {"model": SMOLLM2, "prompt": "hi", "stream": True},
    "/ollama/v1/chat/completions": {"model": SMOLLM2, "messages": [USER_HI], "stream": True},
}


async def stand_in_runners(cluster: InProcessCluster, loaded: anyio.Event) -> None:
    """Every instance's runners report ready once `loaded` is set; every generation task
    of a ready instance is answered with one chunk and completed."""
    ready: set[RunnerId] = set()
    answered: set[TaskId] = set()
    while True:
        state = cluster.state
        for instance in state.instances.values():
            for runner_id in instance.shard_assignments.runner_to_shard:
                if loaded.is_set() and runner_id not in ready:
                    ready.add(runner_id)
                    cluster.emit_local(
                        RunnerStatusUpdated(runner_id=runner_id, node_id=NODE, status=RunnerReady())
                    )
        for task in state.tasks.values():
            rank_zero = state.instances[task.instance_id].shard_assignments.rank_zero_runner()
            if task.task_id in answered or not isinstance(
                state.runners.get(rank_zero), RunnerReady
            ):
                continue
            answered.add(task.task_id)
            cluster.chunks.publish(
                TokenChunk(
                    command_id=task.command_id,
                    model=task.params.model,
                    text=ANSWER,
                    token_ids=(1,),
                    finish_reason="stop",
                    usage=Usage(prompt_tokens=1, completion_tokens=1),
                )
            )
            cluster.emit_local(TaskStatusUpdated(task_id=task.task_id, status=TaskComplete()))
        await anyio.sleep(0.01)


@asynccontextmanager
async def running(
    tmp_path: Path,
    settings: LoadOnRequest | None = None,
    available_mb: int = 4096,
    loaded_at_once: bool = True,
) -> AsyncIterator[tuple[InProcessCluster, httpx.AsyncClient, anyio.Event]]:
    """A one-node cluster with nothing placed, its API, and the gate its stand-in runners
    become ready at."""
    loaded = anyio.Event()
    if loaded_at_once:
        loaded.set()
    async with in_process_cluster(tmp_path, cards=CARDS, load_on_request=settings) as cluster:
        cluster.report_node(available_mb)
        transport = httpx.ASGITransport(app=create_app(cluster.client))
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:52415") as http,
            anyio.create_task_group() as task_group,
        ):
            task_group.start_soon(stand_in_runners, cluster, loaded)
            yield cluster, http, loaded
            task_group.cancel_scope.cancel()


def placements(cluster: InProcessCluster) -> list[InstanceCreated]:
    return [event for event in cluster.logged_events() if isinstance(event, InstanceCreated)]


async def wait_for(condition: Any, what: str) -> None:
    with anyio.fail_after(DEADLINE_SECONDS):
        while not condition():
            await anyio.sleep(0.01)


@pytest.mark.parametrize("endpoint", DIALECT_REQUESTS)
async def test_every_dialect_places_the_model_and_answers(tmp_path: Path, endpoint: str) -> None:
    async with running(tmp_path) as (cluster, http, _loaded):
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post(endpoint, json=DIALECT_REQUESTS[endpoint])
        assert response.status_code == 200, response.text
        assert "Hi there" in response.text
        [created] = placements(cluster)
        assert created.instance.model_id == SMOLLM2


async def test_concurrent_requests_place_once_and_wait_until_ready(tmp_path: Path) -> None:
    async with running(tmp_path, loaded_at_once=False) as (cluster, http, loaded):
        responses: list[httpx.Response] = []

        async def ask(endpoint: str) -> None:
            responses.append(await http.post(endpoint, json=DIALECT_REQUESTS[endpoint]))

        with anyio.fail_after(DEADLINE_SECONDS):
            async with anyio.create_task_group() as task_group:
                for endpoint in ("/v1/chat/completions", "/ollama/api/generate", "/v1/messages"):
                    task_group.start_soon(ask, endpoint)
                await wait_for(lambda: cluster.state.instances, "the placement")
                await anyio.sleep(0.2)
                assert responses == []  # nothing is answered while the model loads
                loaded.set()
        assert [response.status_code for response in responses] == [200, 200, 200]
        assert len(placements(cluster)) == 1


async def test_a_second_api_node_racing_waits_for_the_first_placement(tmp_path: Path) -> None:
    """The master refuses a second on-request placement (409): the request that lost
    waits for the instance that won."""
    async with running(tmp_path) as (cluster, http, _loaded):
        # Another API node's placement is carried out just before ours reaches the master.
        cluster.client.placing.clear()
        with anyio.fail_after(DEADLINE_SECONDS):
            first = await http.post(
                "/v1/chat/completions", json=DIALECT_REQUESTS["/v1/chat/completions"]
            )
            assert first.status_code == 200
            await http.delete(f"/instance/{placements(cluster)[0].instance.instance_id}")
            await wait_for(lambda: not cluster.state.instances, "the deletion")
            both = [
                http.post("/v1/chat/completions", json=DIALECT_REQUESTS["/v1/chat/completions"])
                for _ in range(2)
            ]
            results: list[httpx.Response] = []
            async with anyio.create_task_group() as task_group:
                for request in both:

                    async def send(request: Any = request) -> None:
                        results.append(await request)

                    task_group.start_soon(send)
        assert [result.status_code for result in results] == [200, 200]
        assert len(placements(cluster)) == 2  # the first, and exactly one after the deletion


async def test_no_auto_place_answers_404_saying_how_to_place(tmp_path: Path) -> None:
    async with running(tmp_path, LoadOnRequest(auto_place=False)) as (cluster, http, _loaded):
        response = await http.post(
            "/v1/chat/completions", json=DIALECT_REQUESTS["/v1/chat/completions"]
        )
        assert response.status_code == 404
        assert "/place_instance" in response.json()["error"]["message"]
        assert placements(cluster) == []


async def test_a_model_not_downloaded_answers_404_with_a_pull_hint(tmp_path: Path) -> None:
    async with running(tmp_path) as (cluster, http, _loaded):
        openai = await http.post(
            "/v1/chat/completions", json={"model": QWEN3, "messages": [USER_HI]}
        )
        assert openai.status_code == 404
        assert openai.json()["error"]["code"] == "model_not_downloaded"
        assert "/ollama/api/pull" in openai.json()["error"]["message"]
        assert "POST /download/start" in openai.json()["error"]["message"]
        ollama = await http.post(
            "/ollama/api/chat", json={"model": "qwen3:0.6b", "messages": [USER_HI]}
        )
        assert ollama.status_code == 404 and "pull" in ollama.json()["error"]
        assert placements(cluster) == []


async def test_an_offline_node_says_what_works_offline(tmp_path: Path) -> None:
    """An `--offline` node downloads nothing: its 404 points to the files and a path, not
    to the download routes."""
    async with running(tmp_path, LoadOnRequest(offline=True)) as (cluster, http, _loaded):
        response = await http.post(
            "/v1/chat/completions", json={"model": QWEN3, "messages": [USER_HI]}
        )
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert "--offline" in message and "/models/add" in message
        assert "/download/start" not in message and "/ollama/api/pull" not in message
        assert placements(cluster) == []
        started = await http.post("/download/start", json={"model": QWEN3})
        assert started.status_code == 409, started.text
        assert "--offline" in started.json()["error"]["message"]


async def test_too_little_memory_answers_503_saying_how_much_is_missing(tmp_path: Path) -> None:
    async with running(tmp_path, available_mb=50) as (cluster, http, _loaded):
        response = await http.post(
            "/v1/chat/completions", json=DIALECT_REQUESTS["/v1/chat/completions"]
        )
        assert response.status_code == 503
        message = response.json()["error"]["message"]
        assert "MiB missing" in message and "50 MiB available" in message
        ollama = await http.post("/ollama/api/chat", json=DIALECT_REQUESTS["/ollama/api/chat"])
        assert ollama.status_code == 503 and "MiB missing" in ollama.json()["error"]
        assert placements(cluster) == []


async def test_keep_alive_zero_without_a_prompt_unloads_at_once(tmp_path: Path) -> None:
    async with running(tmp_path) as (cluster, http, _loaded):
        with anyio.fail_after(DEADLINE_SECONDS):
            # Ollama's load request places the model and answers once it is ready.
            load = await http.post("/ollama/api/generate", json={"model": SMOLLM2, "stream": False})
            assert load.json()["done_reason"] == "load"
            assert cluster.state.instances
            unload = await http.post(
                "/ollama/api/chat", json={"model": SMOLLM2, "keep_alive": 0, "stream": False}
            )
            assert unload.status_code == 200
            assert unload.json()["done_reason"] == "unload" and unload.json()["done"] is True
            await wait_for(lambda: not cluster.state.instances, "the unload")


async def test_a_generation_with_keep_alive_zero_unloads_when_it_ends(tmp_path: Path) -> None:
    async with running(tmp_path) as (cluster, http, _loaded):
        body = {**DIALECT_REQUESTS["/ollama/api/chat"], "keep_alive": "0s"}
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/ollama/api/chat", json=body)
            assert response.status_code == 200 and response.json()["done_reason"] == "stop"
            await wait_for(lambda: not cluster.state.instances, "the unload")
        assert len(placements(cluster)) == 1


async def test_idle_unload_deletes_instances_idle_that_long(tmp_path: Path) -> None:
    settings = LoadOnRequest(idle_unload_seconds=0.3)
    async with running(tmp_path, settings) as (cluster, http, _loaded):
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/v1/completions", json=DIALECT_REQUESTS["/v1/completions"])
            assert response.status_code == 200
            [instance_id] = cluster.state.instances
            usage = cluster.state.instance_usage[instance_id]
            assert usage.keep_alive_seconds == 0.3
            ps = (await http.get("/ollama/api/ps")).json()["models"]
            assert ps[0]["expires_at"] != "9999-12-31T23:59:59Z"
            await wait_for(lambda: not cluster.state.instances, "the idle unload")


async def test_idle_unload_zero_answers_before_it_unloads(tmp_path: Path) -> None:
    """The placement does not carry a keep-alive of 0 (the instance would go as soon as
    it is ready, before the request's generation reaches it); the generation does."""
    async with running(tmp_path, LoadOnRequest(idle_unload_seconds=0)) as (cluster, http, _):
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/v1/completions", json=DIALECT_REQUESTS["/v1/completions"])
            assert response.status_code == 200, response.text
            await wait_for(lambda: not cluster.state.instances, "the unload")


async def test_an_instance_without_a_keep_alive_stays(tmp_path: Path) -> None:
    async with running(tmp_path) as (cluster, http, _loaded):
        response = await http.post("/v1/completions", json=DIALECT_REQUESTS["/v1/completions"])
        assert response.status_code == 200
        await anyio.sleep(1.5)  # the master's idle check runs every second
        assert cluster.state.instances and cluster.state.instance_usage == {}


async def test_a_client_leaving_while_the_model_loads_leaves_the_placement_whole(
    tmp_path: Path,
) -> None:
    async with running(tmp_path, loaded_at_once=False) as (cluster, _http, loaded):
        departed = anyio.Event()

        async def receive() -> dict[str, Any]:
            # As a server does: a disconnect is there at once once the client is gone.
            if not departed.is_set():
                await departed.wait()
            return {"type": "http.disconnect"}

        request = Request({"type": "http", "method": "POST", "headers": []}, receive)
        with anyio.fail_after(DEADLINE_SECONDS):
            async with anyio.create_task_group() as task_group:

                async def leave_once_placed() -> None:
                    await wait_for(lambda: cluster.state.instances, "the placement")
                    departed.set()

                task_group.start_soon(leave_once_placed)
                with pytest.raises(GenerationError, match="disconnected"):
                    await ensure_instance(cluster.client, request, SMOLLM2)
        assert cluster.client.placing == {}
        assert len(placements(cluster)) == 1  # it goes on loading for the next request
        loaded.set()
        with anyio.fail_after(DEADLINE_SECONDS):
            await wait_for(lambda: cluster.state.runners, "the instance ready")


# ---------------------------------------------------------------- Ollama pull and delete


@contextmanager
def prepared(models: Path, model_id: str) -> Iterator[Path]:
    """A model directory that looks prepared (weights stand-in and completion marker)."""
    directory = models / model_directory_name(model_id)
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"\0" * 1000)
    (directory / COMPLETION_MARKER).write_text("{}\n")
    yield directory


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines() if line]


async def test_pull_streams_ollama_progress_and_reports_success(
    tmp_path: Path, empty_models_directory: Path
) -> None:
    async with running(tmp_path) as (_cluster, http, _loaded):
        with prepared(empty_models_directory, SMOLLM2):
            streamed = await http.post("/ollama/api/pull", json={"model": "smollm2:135m"})
            whole = await http.post("/ollama/api/pull", json={"model": SMOLLM2, "stream": False})
    assert streamed.status_code == 200
    progress = lines(streamed)
    assert progress[0] == {"status": "pulling manifest"}
    assert progress[-1] == {"status": "success"}
    [files] = [line for line in progress if "digest" in line]
    assert files["digest"].startswith("sha256:") and files["total"] == files["completed"] > 1000
    assert whole.json() == {"status": "success"}


async def test_pull_failures_come_in_ollama_shape(tmp_path: Path) -> None:
    async with running(tmp_path, LoadOnRequest(offline=True)) as (_cluster, http, _loaded):
        unknown = await http.post("/ollama/api/pull", json={"model": "no-such-model"})
        assert unknown.status_code == 404 and unknown.json() == {
            "error": "model 'no-such-model' not found"
        }
        # `name`, Ollama's older spelling of `model`, is read as it; neither is a 400.
        older = await http.post("/ollama/api/pull", json={"name": "no-such-model"})
        assert older.status_code == 404 and older.json() == unknown.json()
        neither = await http.post("/ollama/api/pull", json={"stream": False})
        assert neither.status_code == 400 and "model" in neither.json()["error"]
        streamed = await http.post("/ollama/api/pull", json={"model": QWEN3})
        assert streamed.status_code == 200
        assert "offline" in lines(streamed)[-1]["error"]
        whole = await http.post("/ollama/api/pull", json={"model": QWEN3, "stream": False})
        assert whole.status_code == 503 and "offline" in whole.json()["error"]


async def test_delete_removes_the_files_unless_the_model_is_in_use(
    tmp_path: Path, empty_models_directory: Path
) -> None:
    async with running(tmp_path) as (cluster, http, _loaded):
        with prepared(empty_models_directory, QWEN3) as directory:
            deleted = await http.request(
                "DELETE", "/ollama/api/delete", json={"model": "qwen3:0.6b"}
            )
            assert deleted.status_code == 200 and deleted.content == b""
            assert not directory.exists()
            again = await http.request("DELETE", "/ollama/api/delete", json={"name": QWEN3})
            assert again.status_code == 404 and "not found" in again.json()["error"]
            # Ollama's documented `curl -X DELETE ... -d '{...}'` sends a form content type.
            as_curl = await http.request(
                "DELETE",
                "/ollama/api/delete",
                content=json.dumps({"model": QWEN3}),
                headers={"content-type": "application/x-www-form-urlencoded"},
            )
            assert as_curl.status_code == 404 and "not found" in as_curl.json()["error"]
        with prepared(empty_models_directory, SMOLLM2) as directory:
            chat = await http.post("/ollama/api/chat", json=DIALECT_REQUESTS["/ollama/api/chat"])
            assert chat.status_code == 200 and cluster.state.instances
            in_use = await http.request("DELETE", "/ollama/api/delete", json={"model": SMOLLM2})
            assert in_use.status_code == 409 and "in use" in in_use.json()["error"]
            assert (directory / COMPLETION_MARKER).is_file()


async def test_a_failure_reported_before_the_wait_starts_still_fails_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's failure can be in the state by the time the request's task runs again
    after placing (a busy machine): it is this placement's failure, not an earlier one's.
    (The request waited until its deadline: a CI run's flake.)"""
    place = load_on_request._place

    async def place_then_fail(*args: Any, **kwargs: Any) -> Any:
        placed = await place(*args, **kwargs)
        failed = DownloadFailed(error_message="no blk.1.ffn_up_exps.weight", permanent=True)
        cluster.emit_local(NodeDownloadProgress(node_id=NODE, model_id=SMOLLM2, status=failed))
        await wait_for(lambda: SMOLLM2 in cluster.state.downloads.get(NODE, {}), "the failure")
        return placed

    monkeypatch.setattr(load_on_request, "_place", place_then_fail)
    async with running(tmp_path, loaded_at_once=False) as (cluster, http, _loaded):
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/v1/messages", json=DIALECT_REQUESTS["/v1/messages"])
        assert response.status_code == 500, response.text
        assert "blk.1.ffn_up_exps.weight" in response.json()["error"]["message"]


@pytest.mark.parametrize("permanent", [True, False])
async def test_a_preparation_failure_is_500_when_permanent_else_503(
    tmp_path: Path, permanent: bool
) -> None:
    """A node that cannot prepare the model: a permanent failure (a GGUF that does not
    convert) is a 500 (Claude `api_error`, which SDKs do not retry), a passing one a 503
    (`overloaded_error`), both while the request waits for the placement it made and when
    the instance was placed beforehand."""
    expected = (500, "api_error") if permanent else (503, "overloaded_error")

    def fail_preparation() -> None:
        failed = DownloadFailed(error_message="no blk.1.ffn_up_exps.weight", permanent=permanent)
        cluster.emit_local(NodeDownloadProgress(node_id=NODE, model_id=SMOLLM2, status=failed))

    async def fail_once_placed(count: int) -> None:
        await wait_for(lambda: len(placements(cluster)) == count, "a placement")
        fail_preparation()

    async with running(tmp_path, loaded_at_once=False) as (cluster, http, _loaded):
        request = DIALECT_REQUESTS["/v1/messages"]
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(fail_once_placed, 1)
            with anyio.fail_after(DEADLINE_SECONDS):
                response = await http.post("/v1/messages", json=request)
        assert response.status_code == expected[0], response.text
        assert response.json()["error"]["type"] == expected[1]
        assert "blk.1.ffn_up_exps.weight" in response.json()["error"]["message"]
        placed = await http.post("/place_instance", json={"model_id": SMOLLM2})
        assert placed.status_code == 200, placed.text
        await fail_once_placed(2)
        await wait_for(lambda: cluster.state.downloads[NODE][SMOLLM2].kind == "DownloadFailed", "")
        with anyio.fail_after(DEADLINE_SECONDS):
            response = await http.post("/v1/messages", json=request)
        assert response.status_code == expected[0], response.text
        assert response.json()["error"]["type"] == expected[1]
