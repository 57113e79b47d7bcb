"""Ollama's `load_duration` through the app, a real cluster client and master, with
stand-in runners that become ready when the test says: a request that waited for its
model to load reports that wait (placing it, or finding it placed and still loading),
streamed or not, on chat and generate; one to the loaded instance reports 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from exo.api.tests.test_load_on_request import DIALECT_REQUESTS, placements, running, wait_for

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 20
# The stand-in runners report ready this long after the placement: every request sent
# before that waited at least this long for the load.
LOAD_SECONDS = 0.3


def final_object(response: httpx.Response, stream: bool) -> dict[str, Any]:
    """The object with the statistics: the whole answer, or the stream's last line."""
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()
    *_, last = [json.loads(line) for line in response.text.splitlines() if line]
    assert last["done"] is True
    return last


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["/ollama/api/chat", "/ollama/api/generate"])
async def test_load_duration_is_the_wait_for_the_load_then_0(
    tmp_path: Path, endpoint: str, stream: bool
) -> None:
    body = {**DIALECT_REQUESTS[endpoint], "stream": stream}
    async with running(tmp_path, loaded_at_once=False) as (cluster, http, loaded):
        answers: dict[str, httpx.Response] = {}

        async def ask(name: str) -> None:
            answers[name] = await http.post(endpoint, json=body)

        with anyio.fail_after(DEADLINE_SECONDS):
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(ask, "placing")  # places the model on request
                await wait_for(lambda: cluster.state.instances, "the placement")
                task_group.start_soon(ask, "joining")  # finds it placed, still loading
                # Sent to the loading instance (the placing one is sent once it is ready).
                await wait_for(lambda: cluster.state.tasks, "the joining request's task")
                await anyio.sleep(LOAD_SECONDS)
                assert answers == {}
                loaded.set()
            answers["warm"] = await http.post(endpoint, json=body)
        assert len(placements(cluster)) == 1
        for name in ("placing", "joining"):
            cold = final_object(answers[name], stream)
            assert cold["load_duration"] >= LOAD_SECONDS * 1e9, (name, cold)
            # The load is part of the total and not of the prompt's evaluation.
            assert cold["load_duration"] + cold["prompt_eval_duration"] <= cold["total_duration"]
        warm = final_object(answers["warm"], stream)
        assert warm["load_duration"] == 0
        assert warm["total_duration"] > 0
