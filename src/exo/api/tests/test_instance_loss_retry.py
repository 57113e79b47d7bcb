"""A generation whose instance becomes unavailable before the client got anything is sent
again (and answered); one that keeps failing gets a 503 in the dialect's own shape, never a
500 or a library's message."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anyio
import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.accepted_generation import MAX_RETRIES
from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk
from exo.shared.types.commands import ComputeEmbeddings, GenerateText
from exo.shared.types.common import CommandId
from exo.shared.types.state import InstanceUnavailable, State
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

LOST = (
    "instance i-1 of HuggingFaceTB/SmolLM2-135M-Instruct is unavailable: node n-1 left; re-placing"
)


class LosingCluster(ScriptedCluster):
    """The first `losses` generations end at once with the error chunk the API gets when
    their instance loses a node; later ones answer."""

    def __init__(self, losses: int) -> None:
        super().__init__()
        self.losses = losses

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        position = [item.command_id for item in self.submitted].index(command_id)
        if position < self.losses:
            model = self.submitted[position].params.model
            yield ErrorChunk(
                command_id=command_id,
                model=model,
                error_message=LOST,
                status_code=503,
                error_code=INSTANCE_UNAVAILABLE,
            )
            return
        async for chunk in super()._answer(command_id):
            yield chunk


def client_for(cluster: ScriptedCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as test_client:
        yield test_client


CHAT = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_generation_that_lost_its_instance_before_any_chunk_is_answered_by_another(
    stream: bool,
) -> None:
    cluster = LosingCluster(losses=2)
    for http in client_for(cluster):
        response = http.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200, response.text
        assert SCRIPTED_ANSWER in response.text
    # Sent three times, each under its own command id, the same request each time; the
    # alias that lets /v1/cancel find the running command goes with the request.
    assert len({command.command_id for command in cluster.submitted}) == 3
    assert cluster.generation_aliases == {}
    assert len({command.params.model_dump_json() for command in cluster.submitted}) == 1


def body_message(path: str, body: dict[str, Any]) -> str:
    match path:
        case "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            return str(body["error"]["message"])
        case "/ollama/api/chat":
            return str(body["error"])
        case _:
            assert body["error"]["type"] == "service_unavailable_error"
            return str(body["error"]["message"])


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {}),
        ("/v1/messages", {"max_tokens": 10}),
        ("/ollama/api/chat", {"stream": False}),
    ],
)
def test_a_generation_that_keeps_losing_its_instance_gets_a_503_in_the_dialects_shape(
    path: str, extra: dict[str, Any]
) -> None:
    cluster = LosingCluster(losses=MAX_RETRIES + 1)
    for http in client_for(cluster):
        response = http.post(path, json={**CHAT, **extra})
        assert response.status_code == 503, response.text
        assert body_message(path, response.json()) == LOST
    assert len(cluster.submitted) == MAX_RETRIES + 1


class RecoveringCluster(LosingCluster):
    """Its only instance is lost under the first generation; the master, ahead of this
    node, then refuses (503) while the instance is being placed again, which this node's
    state shows from that refusal on for a few looks; then the instance serves again and
    the generation is answered."""

    def __init__(self) -> None:
        super().__init__(losses=1)
        self.rejected = 0
        self.looks_while_recovering = 0
        self.state_changed = anyio.Event()
        self._serving_state = self.state
        self._recovering_state = self.state.model_copy(
            update={
                "unavailable_instances": {
                    instance_id: InstanceUnavailable(reason="node n-1 left; re-placed on n-2")
                    for instance_id in self.state.instances
                }
            }
        )

    @property
    def state(self) -> State:
        if self.rejected == 0 or self.looks_while_recovering > 3:
            return self._serving_state
        self.looks_while_recovering += 1
        return self._recovering_state

    @state.setter
    def state(self, value: State) -> None:
        self._serving_state = value

    async def submit(self, command: GenerateText | ComputeEmbeddings, timeout: float = 0.0) -> None:
        if len(self.submitted) == 1 and self.rejected == 0:
            self.rejected += 1
            raise CommandRejectedError("instance i-1 is unavailable: node n-1 left", 503)
        await super().submit(command, timeout)


def test_a_retried_generation_waits_for_its_lost_instance_to_serve_again() -> None:
    cluster = RecoveringCluster()
    for http in client_for(cluster):
        response = http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200, response.text
        assert SCRIPTED_ANSWER in response.text
    assert cluster.rejected == 1 and len(cluster.submitted) == 2
