"""A generation sent to a node that has not caught up with the master's history waits for
it (bounded) and is served, instead of answering 404 for a model or instance the cluster
knows (`exo.api.serving.catch_up`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import anyio
import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import CATCH_UP_WAIT_SECONDS, ClusterClient
from exo.shared.constants import INSTANCE_HEADER
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import NodeId
from exo.shared.types.events import IndexedEvent
from exo.shared.types.state import State
from exo.testing.builders import SMOLLM2, make_card, make_instance, make_state
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster
from exo.utils.channels import Topic

pytestmark = pytest.mark.anyio

CUSTOM = "someone/custom-model"
# How long the stand-in node takes to catch up: well inside CATCH_UP_WAIT_SECONDS.
CATCH_UP_AFTER_SECONDS = 0.3


class CatchingUpCluster(ScriptedCluster):
    """A node behind the master: what the master placed (another SmolLM2 instance and an
    instance of a custom model) reaches its state only when `catch_up` runs; it waits
    with the real `ClusterClient.wait_until_caught_up`."""

    def __init__(self) -> None:
        super().__init__()
        self.caught_up = False
        self.state_changed = anyio.Event()
        self._caught_up = lambda: self.caught_up
        self.waits = 0

    async def wait_until_caught_up(self, timeout: float = CATCH_UP_WAIT_SECONDS) -> bool:
        self.waits += 1
        return await ClusterClient.wait_until_caught_up(cast(ClusterClient, self), timeout)

    def catch_up(self) -> None:
        self.add_model(make_card(model_id=CUSTOM))
        instances = [
            *self.state.instances.values(),
            make_instance(self.node_id, instance_id="late"),
        ]
        self.state = make_state(instances=instances)
        self.caught_up = True


def after(seconds: float, action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


@pytest.fixture
def behind() -> Iterator[tuple[CatchingUpCluster, TestClient]]:
    cluster = CatchingUpCluster()
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        yield cluster, http


CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(
    ("path", "body", "headers"),
    [
        ("/v1/chat/completions", {"model": CUSTOM, **CHAT}, {}),
        ("/v1/messages", {"model": CUSTOM, "max_tokens": 8, **CHAT}, {}),
        ("/ollama/api/chat", {"model": CUSTOM, "stream": False, **CHAT}, {}),
        ("/v1/chat/completions", {"model": SMOLLM2, **CHAT}, {INSTANCE_HEADER: "late"}),
    ],
)
def test_a_name_the_node_has_not_caught_up_with_waits_and_is_served(
    behind: tuple[CatchingUpCluster, TestClient],
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> None:
    cluster, http = behind
    started = time.monotonic()
    timer = after(CATCH_UP_AFTER_SECONDS, cluster.catch_up)
    try:
        response = http.post(path, json=body, headers=headers)
    finally:
        timer.join()
    assert response.status_code == 200, response.text
    assert SCRIPTED_ANSWER in response.text
    # Answered only after the node caught up (so it waited: a lower bound, not a timing).
    assert time.monotonic() - started >= CATCH_UP_AFTER_SECONDS
    assert cluster.waits >= 1
    assert cluster.last_params.model == body["model"]


def test_a_known_model_never_waits(behind: tuple[CatchingUpCluster, TestClient]) -> None:
    cluster, http = behind
    response = http.post("/v1/chat/completions", json={"model": SMOLLM2, **CHAT})
    assert response.status_code == 200, response.text
    assert cluster.waits == 0


def test_an_unknown_model_on_a_caught_up_node_is_a_404_at_once(
    behind: tuple[CatchingUpCluster, TestClient],
) -> None:
    cluster, http = behind
    cluster.caught_up = True
    response = http.post("/v1/chat/completions", json={"model": "nobody/knows", **CHAT})
    assert response.status_code == 404, response.text
    assert "nobody/knows" in response.json()["error"]["message"]


def client_with(caught_up: Callable[[], bool]) -> ClusterClient:
    return ClusterClient(
        node_id=NodeId("node-a"),
        current_state=State,
        applied_events=Topic[IndexedEvent]("applied").subscribe(),
        chunk_subscription=Topic[Chunk]("chunks").subscribe(),
        command_publisher=Topic[ForwarderCommand]("commands").sender(),
        cards={},
        caught_up=caught_up,
    )


async def test_the_wait_ends_when_the_node_catches_up_or_at_its_bound() -> None:
    flag = [False]
    client = client_with(lambda: flag[0])
    with anyio.fail_after(5):
        assert not await client.wait_until_caught_up(timeout=0.3)
        async with anyio.create_task_group() as task_group:

            async def catch_up() -> None:
                await anyio.sleep(0.2)
                flag[0] = True

            task_group.start_soon(catch_up)
            assert await client.wait_until_caught_up(timeout=4.0)
