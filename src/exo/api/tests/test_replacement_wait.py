"""A new request for a model whose only instance is being placed again after a node loss
waits for it and is answered, as Ollama and llama-server hold a request while a model
loads; only when the instance cannot serve again soon (it waits for room, was deleted, or
the wait ran out) is it answered 503 with `Retry-After` in its dialect's shape. A model
with no instance keeps its own answer (load on request, `test_load_on_request.py`).

The app runs in-process over a scripted cluster whose master is the real
`events_for_command` over the test's state, so a generation submitted while every instance
of its model is unavailable gets the master's own refusal (503).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest

from exo.api.serving import early_stream
from exo.api.serving.accepted_generation import Generation
from exo.api.serving.admission import Admission
from exo.api.serving.replacement_wait import UNAVAILABLE_RETRY_AFTER_SECONDS, replacement_under_way
from exo.api.tests.replacement import (
    DEADLINE_SECONDS,
    INSTANCE,
    STILL_WAITING_SECONDS,
    ReplacingCluster,
    answer_of,
    app_client,
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
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import GenerateText
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.state import InstanceUnavailable, State
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import SCRIPTED_ANSWER

pytestmark = pytest.mark.anyio

USER_HI = {"role": "user", "content": "hi"}
REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": SMOLLM2, "messages": [USER_HI]}),
    "chat stream": (
        "/v1/chat/completions",
        {"model": SMOLLM2, "messages": [USER_HI], "stream": True},
    ),
    "responses": ("/v1/responses", {"model": SMOLLM2, "input": "hi"}),
    "claude": ("/v1/messages", {"model": SMOLLM2, "messages": [USER_HI], "max_tokens": 8}),
    "ollama": ("/ollama/api/chat", {"model": SMOLLM2, "messages": [USER_HI], "stream": False}),
}


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    quick_polls(monkeypatch)


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_a_new_request_waits_while_its_instance_is_placed_again_and_is_answered(
    name: str,
) -> None:
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    async with pending(cluster, path, body) as request:
        await request.admitted(SMOLLM2)
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        assert cluster.refused == [] and cluster.submitted == [], "sent while unavailable"
        cluster.change(serving())  # every runner of the new placement ready
    assert request.answer.status_code == 200, request.answer.text
    assert SCRIPTED_ANSWER.split()[0] in request.answer.text
    assert len(cluster.submitted) == 1 and cluster.refused == []
    assert request.admission.in_flight(ModelId(SMOLLM2)) == 0


async def test_a_request_the_master_refuses_while_it_re_places_waits_and_is_sent_again() -> None:
    # This node has not applied the node loss yet; the master has, and refuses.
    cluster = ReplacingCluster(serving())
    cluster.master_state = replacing()
    path, body = REQUESTS["chat"]
    async with pending(cluster, path, body) as request:
        await wait_for(lambda: len(cluster.refused) == 1, "the master refused")
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        assert cluster.submitted == []
        cluster.master_state = None
        cluster.change(serving())
    answer = request.answer
    assert answer.status_code == 200, answer.text
    (first,) = cluster.refused
    (sent,) = cluster.submitted
    assert sent.command_id != first.command_id
    assert sent.params == first.params
    # The client's id names the command it knows; the alias to the one sent is gone.
    assert answer.json()["id"] == f"chatcmpl-{first.command_id.replace('-', '')}"
    assert cluster.generation_aliases == {}


@pytest.mark.parametrize("name", ["chat", "claude", "ollama"])
async def test_an_instance_that_does_not_serve_again_in_time_is_a_503_with_retry_after(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shorten_waits(monkeypatch, 0.3)
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    started = anyio.current_time()
    answer = await answer_of(cluster, path, body)
    waited = anyio.current_time() - started
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    message = error_message(path, answer)
    assert "re-placed on node-a, loading" in message and "within 0.3 s" in message
    assert waited >= 0.3
    assert cluster.refused == [] and cluster.submitted == []


async def test_a_stream_whose_instance_does_not_serve_again_in_time_ends_with_an_error_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its headers went out while it waited: the error comes in-band."""
    shorten_waits(monkeypatch, 0.3)
    cluster = ReplacingCluster(replacing())
    answer = await answer_of(cluster, *REQUESTS["chat stream"])
    assert answer.status_code == 200
    events = [
        json.loads(line.removeprefix("data: "))
        for line in answer.text.splitlines()
        if line.startswith("data: {")
    ]
    assert events[-1]["error"]["type"] == "service_unavailable_error", events
    assert "within 0.3 s" in events[-1]["error"]["message"]


async def test_an_instance_waiting_for_room_is_a_503_with_retry_after_at_once() -> None:
    cluster = ReplacingCluster(waiting_for_room())
    path, body = REQUESTS["chat"]
    answer = await answer_of(cluster, path, body)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "waiting for room" in error_message(path, answer)
    assert len(cluster.refused) == 1  # the master's answer, as before


async def test_an_instance_deleted_while_a_request_waits_is_a_503() -> None:
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS["ollama"]
    async with pending(cluster, path, body) as request:
        await request.admitted(SMOLLM2)
        cluster.change(make_state())  # DELETE /instance
    answer = request.answer
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "deleted" in error_message(path, answer)
    assert cluster.refused == [] and cluster.submitted == []


# A request that lost its instance before its first chunk (`Generation.retry`) takes the
# same decision as a new one.

LOST_WAIT_SECONDS = 5.0
"""The lost request's wait in these tests: one answered before it did not wait it out."""


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_a_lost_request_whose_instance_waits_for_room_is_a_503_at_once(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shorten_waits(monkeypatch, LOST_WAIT_SECONDS)
    # No stream headers before the answer: the 503 is the whole answer.
    monkeypatch.setattr(early_stream, "HEADERS_AFTER_SECONDS", DEADLINE_SECONDS)
    cluster = ReplacingCluster(serving())
    cluster.losses = [waiting_for_room()]  # its node left; no node set has room
    path, body = REQUESTS[name]
    started = anyio.current_time()
    answer = await answer_of(cluster, path, body)
    assert anyio.current_time() - started < LOST_WAIT_SECONDS
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "waiting for room" in error_message(path, answer)
    assert len(cluster.lost) == 1 and len(cluster.submitted) == 1
    assert len(cluster.refused) == 1  # the master's answer to the re-submission


@pytest.mark.parametrize("name", ["chat", "chat stream", "claude"])
async def test_a_lost_request_waiting_for_its_re_placed_instance_is_a_503_once_it_waits_for_room(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    shorten_waits(monkeypatch, LOST_WAIT_SECONDS)
    monkeypatch.setattr(early_stream, "HEADERS_AFTER_SECONDS", DEADLINE_SECONDS)
    cluster = ReplacingCluster(serving())
    cluster.losses = [replacing()]
    path, body = REQUESTS[name]
    async with pending(cluster, path, body) as request:
        await wait_for(lambda: cluster.lost, "the instance lost")
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        started = anyio.current_time()
        cluster.change(waiting_for_room())  # the new placement found no room after all
    assert anyio.current_time() - started < LOST_WAIT_SECONDS
    answer = request.answer
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "waiting for room" in error_message(path, answer)


@pytest.mark.parametrize("name", ["chat", "chat stream", "ollama"])
async def test_a_request_lost_before_its_first_chunk_waits_for_the_re_placed_instance_unrefused(
    name: str,
) -> None:
    """It is sent again once the instance serves, not into a master that would refuse it."""
    cluster = ReplacingCluster(serving())
    cluster.losses = [replacing()]
    path, body = REQUESTS[name]
    async with pending(cluster, path, body) as request:
        await wait_for(lambda: cluster.lost, "the instance lost")
        await anyio.sleep(STILL_WAITING_SECONDS)
        assert not request.answers, request.answers[0].text
        assert cluster.refused == [] and len(cluster.submitted) == 1
        cluster.change(serving())
    assert request.answer.status_code == 200, request.answer.text
    assert SCRIPTED_ANSWER.split()[0] in request.answer.text
    assert len(cluster.submitted) == 2 and cluster.refused == []


class LeavingClient:
    """A request whose client is gone from the second look on."""

    def __init__(self) -> None:
        self.looks = 0

    async def is_disconnected(self) -> bool:
        self.looks += 1
        return self.looks > 1


async def test_a_client_leaving_while_its_instance_is_placed_again_ends_the_wait() -> None:
    cluster = ReplacingCluster(replacing())
    params = TextGenerationTaskParams(
        model=ModelId(SMOLLM2), messages=(ChatMessage(role="user", content="hi"),)
    )
    command = GenerateText(command_id=CommandId.new(), params=params)

    async def no_chunks() -> AsyncIterator[Chunk]:
        return
        yield

    generation = Generation(cluster, command.command_id, params, no_chunks())  # type: ignore[arg-type]
    with anyio.fail_after(DEADLINE_SECONDS), pytest.raises(GenerationError):
        await generation.submit(LeavingClient(), command)  # type: ignore[arg-type]
    assert cluster.refused == [] and cluster.submitted == []


def states() -> Iterator[tuple[str, State, bool]]:
    yield "serving", serving(), False
    yield "re-placed, loading", replacing(), True
    yield "its node just lost", replacing("node n-1 left"), True
    yield "waiting for room", waiting_for_room(), False
    yield "no instance", make_state(), False
    other = make_instance(NodeId("node-b"), instance_id="instance-2")
    two = replacing().model_copy(
        update={"instances": {**replacing().instances, "instance-2": other}}
    )
    yield "another instance serving", two, False
    both = two.model_copy(
        update={
            "unavailable_instances": {
                INSTANCE: waiting_for_room().unavailable_instances[INSTANCE],
                InstanceId("instance-2"): InstanceUnavailable(reason="node-b left; re-placed"),
            }
        }
    )
    yield "one waits for room, another is re-placed", both, True


@pytest.mark.parametrize(("name", "state", "expected"), list(states()))
def test_which_states_a_new_request_waits_in(name: str, state: State, expected: bool) -> None:
    assert replacement_under_way(state, ModelId(SMOLLM2)) is expected, name


@pytest.mark.parametrize("name", ["chat", "chat stream", "responses", "claude", "ollama"])
async def test_a_request_cancelled_while_it_waits_is_never_sent_and_ends_cancelled(
    name: str,
) -> None:
    """`POST /v1/cancel/{id}` of a request still waiting for its re-placed instance (not
    yet a task, so a 404 before) ends its wait: it is never sent, and its client gets the
    end a cancelled generation gets (the runner's final "cancelled" chunk)."""
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    async with (
        pending(cluster, path, body) as request,
        app_client(cluster, request.admission) as http,
    ):
        await wait_for(lambda: len(cluster.waiting_generations) == 1, "waiting")
        (command_id,) = cluster.waiting_generations
        cancel = await http.post(f"/v1/cancel/{command_id}")
        assert cancel.status_code == 200, cancel.text
        assert cancel.json()["cancelled"] is True
    assert cluster.submitted == [] and cluster.refused == []
    assert cluster.waiting_generations == {}
    # As each dialect ends any generation cancelled before its first token (a queued
    # task's final "cancelled" chunk, docs/api.md#cancellation): the chat stream with the
    # `generation_cancelled` error event and `[DONE]`, Responses as `cancelled`, the other
    # whole answers as the error "cancelled before it finished".
    answer = request.answer
    assert SCRIPTED_ANSWER.split()[0] not in answer.text
    if name == "chat stream":
        assert answer.status_code == 200, answer.text
        assert '"code": "generation_cancelled"' in answer.text
        assert answer.text.rstrip().endswith("data: [DONE]")
    elif name == "responses":
        assert answer.status_code == 200, answer.text
        assert answer.json()["status"] == "cancelled" and answer.json()["output"] == []
    else:
        assert answer.status_code == 500, answer.text
        assert "cancelled before it finished" in answer.text
    assert request.admission.in_flight(ModelId(SMOLLM2)) == 0


async def test_a_cancel_of_nothing_waiting_or_running_is_still_a_404() -> None:
    cluster = ReplacingCluster(serving())
    async with app_client(cluster, Admission()) as http:
        answer = await http.post(f"/v1/cancel/{CommandId.new()}")
    assert answer.status_code == 404, answer.text
