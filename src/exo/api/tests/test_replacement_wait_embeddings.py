"""Embeddings and rerank requests while their model's only instance is placed again after a
node loss behave as generations do (`exo.api.serving.replacement_wait`): they wait for it
and are answered; when it cannot serve again soon (it waits for room, was deleted, or the
wait ran out) they are answered 503 with `Retry-After` in their path's error shape. One
whose instance is lost before it answers is sent again and takes the same decision.

The set-up (states, the scripted cluster with the real master's decisions) is shared with
the generations' tests (`exo.api.tests.replacement`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from exo.api.serving.admission import Admission
from exo.api.serving.embedding import compute_embeddings
from exo.api.serving.replacement_wait import UNAVAILABLE_RETRY_AFTER_SECONDS
from exo.api.tests.replacement import (
    DEADLINE_SECONDS,
    RERANKER,
    STILL_WAITING_SECONDS,
    ReplacingCluster,
    answer_of,
    error_message,
    pending,
    quick_polls,
    replacing,
    serving,
    shorten_waits,
    wait_for,
    waiting_for_room,
)
from exo.api.wire.errors import GenerationError
from exo.shared.types.common import ModelId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.testing.builders import SMOLLM2, make_state

pytestmark = pytest.mark.anyio

REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "openai": ("/v1/embeddings", {"model": SMOLLM2, "input": "hi"}),
    "openai under /ollama": ("/ollama/v1/embeddings", {"model": SMOLLM2, "input": ["hi"]}),
    "ollama embed": ("/ollama/api/embed", {"model": SMOLLM2, "input": "hi"}),
    "ollama embed at the root": ("/api/embed", {"model": SMOLLM2, "input": ["hi"]}),
    "ollama embeddings": ("/ollama/api/embeddings", {"model": SMOLLM2, "prompt": "hi"}),
    "ollama embeddings at the root": ("/api/embeddings", {"model": SMOLLM2, "prompt": "hi"}),
    "rerank": ("/v1/rerank", {"model": RERANKER, "query": "q", "documents": ["a", "b"]}),
}
ANSWER_KEYS = {
    "/v1/embeddings": "data",
    "/ollama/v1/embeddings": "data",
    "/ollama/api/embed": "embeddings",
    "/api/embed": "embeddings",
    "/ollama/api/embeddings": "embedding",
    "/api/embeddings": "embedding",
    "/v1/rerank": "results",
}
LOST_WAIT_SECONDS = 5.0
"""A lost request's wait in these tests: one answered before it did not wait it out."""


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_polls(monkeypatch)


def assert_answered(path: str, answer: Any) -> None:
    assert answer.status_code == 200, answer.text
    assert answer.json()[ANSWER_KEYS[path]], answer.text


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_an_embedding_request_waits_while_its_instance_is_placed_again_and_is_answered(
    name: str,
) -> None:
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    async with pending(cluster, path, body) as request:
        await request.admitted(body["model"])
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        assert cluster.refused == [] and cluster.embedding_commands == [], "sent meanwhile"
        cluster.change(serving())  # every runner of the new placement ready
    assert_answered(path, request.answer)
    assert len(cluster.embedding_commands) == 1 and cluster.refused == []
    assert request.admission.in_flight(ModelId(body["model"])) == 0


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_an_embedding_request_whose_instance_waits_for_room_is_a_503_with_retry_after(
    name: str,
) -> None:
    cluster = ReplacingCluster(waiting_for_room())
    path, body = REQUESTS[name]
    answer = await answer_of(cluster, path, body)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "waiting for room" in error_message(path, answer)
    assert len(cluster.refused) == 1  # the master's answer


@pytest.mark.parametrize("name", ["openai", "ollama embed", "ollama embeddings", "rerank"])
async def test_an_embedding_request_whose_instance_does_not_serve_in_time_is_a_503(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shorten_waits(monkeypatch, 0.3)
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    answer = await answer_of(cluster, path, body)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    message = error_message(path, answer)
    assert "re-placed on node-a, loading" in message and "within 0.3 s" in message
    assert cluster.refused == [] and cluster.embedding_commands == []


@pytest.mark.parametrize("name", ["openai", "ollama embed at the root"])
async def test_an_instance_deleted_while_an_embedding_request_waits_is_a_503(name: str) -> None:
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    async with pending(cluster, path, body) as request:
        await request.admitted(body["model"])
        cluster.change(make_state())  # DELETE /instance
    answer = request.answer
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "deleted" in error_message(path, answer)
    assert cluster.refused == [] and cluster.embedding_commands == []


async def test_an_embedding_request_the_master_refuses_while_it_re_places_is_sent_again() -> None:
    # This node has not applied the node loss yet; the master has, and refuses.
    cluster = ReplacingCluster(serving())
    cluster.master_state = replacing()
    path, body = REQUESTS["openai"]
    async with pending(cluster, path, body) as request:
        await wait_for(lambda: len(cluster.refused) == 1, "the master refused")
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        cluster.master_state = None
        cluster.change(serving())
    assert_answered(path, request.answer)
    (first,) = cluster.refused
    (sent,) = cluster.embedding_commands
    assert sent.command_id != first.command_id and sent.params == first.params


@pytest.mark.parametrize("name", ["openai", "ollama embed", "rerank"])
async def test_an_embedding_request_lost_before_its_answer_waits_and_is_sent_again(
    name: str,
) -> None:
    cluster = ReplacingCluster(serving())
    cluster.losses = [replacing()]  # its node left; re-placed, loading
    path, body = REQUESTS[name]
    async with pending(cluster, path, body) as request:
        await wait_for(lambda: cluster.lost, "the instance lost")
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        assert len(cluster.embedding_commands) == 1 and cluster.refused == []
        cluster.change(serving())
    assert_answered(path, request.answer)
    lost, sent = cluster.embedding_commands
    assert cluster.lost == [lost.command_id]
    assert sent.command_id != lost.command_id and sent.params == lost.params


@pytest.mark.parametrize("name", ["openai", "ollama embeddings", "rerank"])
async def test_an_embedding_request_lost_while_its_instance_waits_for_room_is_a_503_at_once(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shorten_waits(monkeypatch, LOST_WAIT_SECONDS)
    cluster = ReplacingCluster(serving())
    cluster.losses = [waiting_for_room()]
    path, body = REQUESTS[name]
    started = anyio.current_time()
    answer = await answer_of(cluster, path, body)
    assert anyio.current_time() - started < LOST_WAIT_SECONDS
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "waiting for room" in error_message(path, answer)
    assert len(cluster.lost) == 1 and len(cluster.refused) == 1


class LeavingClient:
    """A request of an app with free places, whose client is gone from the second look on."""

    def __init__(self) -> None:
        self.looks = 0
        self.app = SimpleNamespace(state=SimpleNamespace(admission=Admission()))

    async def is_disconnected(self) -> bool:
        self.looks += 1
        return self.looks > 1


async def test_a_client_leaving_while_its_embedding_model_is_placed_again_ends_the_wait() -> None:
    cluster = ReplacingCluster(replacing())
    params = EmbeddingTaskParams(model=ModelId(SMOLLM2), inputs=("hi",))
    client = LeavingClient()
    with anyio.fail_after(DEADLINE_SECONDS), pytest.raises(GenerationError):
        await compute_embeddings(cluster, client, params)  # type: ignore[arg-type]
    assert cluster.refused == [] and cluster.embedding_commands == []
    assert client.app.state.admission.in_flight(ModelId(SMOLLM2)) == 0
