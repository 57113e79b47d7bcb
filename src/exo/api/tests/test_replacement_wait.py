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

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.api.serving import accepted_generation, early_stream
from exo.api.serving.accepted_generation import (
    UNAVAILABLE_RETRY_AFTER_SECONDS,
    Generation,
    replacement_under_way,
)
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import CommandRejectedError
from exo.api.wire.errors import GenerationError
from exo.master.decisions import events_for_command
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import ComputeEmbeddings, GenerateText
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.events import CommandRejected
from exo.shared.types.state import InstanceUnavailable, State
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 20.0
# Long enough for a request that was going to be refused at once to have been refused.
STILL_WAITING_SECONDS = 0.3
NODE = NodeId("node-a")
INSTANCE = InstanceId("instance-1")
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


def serving() -> State:
    return make_state(instances=[make_instance(NODE)])


def replacing(reason: str = "node n-1 left; re-placed on node-a, loading") -> State:
    """The only instance re-placed after its node left, its new runners loading."""
    return serving().model_copy(
        update={"unavailable_instances": {INSTANCE: InstanceUnavailable(reason=reason)}}
    )


def waiting_for_room() -> State:
    waiting = InstanceUnavailable(
        reason="node n-1 left; waiting for room: no node has 300 MiB free", waiting_for_room=True
    )
    return serving().model_copy(update={"unavailable_instances": {INSTANCE: waiting}})


class ReplacingCluster(ScriptedCluster):
    """A scripted cluster whose master decides with `events_for_command` over
    `master_state` (by default this node's state): refusals raise as `ClusterClient.submit`
    does, and a refused generation is recorded in `refused`. A master ahead of this node
    (`master_state` set) refuses, then this node applies the master's state, as the
    refusal reaches a node only after the events before it."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.state_changed = anyio.Event()
        self.master_state: State | None = None
        self.refused: list[GenerateText] = []

    def change(self, state: State) -> None:
        """This node applies events that leave it holding `state`."""
        self.state = state
        self.state_changed.set()
        self.state_changed = anyio.Event()

    async def submit(self, command: GenerateText | ComputeEmbeddings, timeout: float = 0.0) -> None:
        master = self.master_state or self.state
        cards = {ModelId(model): card for model, card in self.cards.items()}
        (event, *_) = events_for_command(master, self.node_id, command, cards)
        if isinstance(event, CommandRejected):
            assert isinstance(command, GenerateText)
            self.refused.append(command)
            if self.master_state is not None:
                self.change(self.master_state)
            raise CommandRejectedError(event.reason, event.status_code)
        await super().submit(command, timeout)


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters look at the state often, and a stream sends its headers early, so that
    these tests take tenths of seconds."""
    monkeypatch.setattr(accepted_generation, "RETRY_STATE_CHECK_SECONDS", 0.02)
    monkeypatch.setattr(early_stream, "HEADERS_AFTER_SECONDS", 0.05)


@contextlib.asynccontextmanager
async def app_client(cluster: ReplacingCluster, admission: Admission) -> AsyncIterator[Any]:
    app = create_app(cluster, admission=admission)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:52415") as http:
        yield http


async def wait_for(condition: Any, what: str) -> None:
    with anyio.fail_after(DEADLINE_SECONDS):
        while not condition():
            await anyio.sleep(0.01)
    assert condition(), what


def error_message(path: str, response: httpx.Response) -> str:
    """The message of a 503 in the dialect's error shape (asserting the shape)."""
    body = response.json()
    match path:
        case "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
            return str(body["error"]["message"])
        case "/ollama/api/chat":
            assert set(body) == {"error"}
            return str(body["error"])
        case _:
            assert body["error"]["type"] == "service_unavailable_error"
            return str(body["error"]["message"])


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_a_new_request_waits_while_its_instance_is_placed_again_and_is_answered(
    name: str,
) -> None:
    cluster = ReplacingCluster(replacing())
    admission = Admission()
    path, body = REQUESTS[name]
    answers: list[httpx.Response] = []
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, admission) as http, anyio.create_task_group() as group:

            async def send() -> None:
                answers.append(await http.post(path, json=body))

            group.start_soon(send)
            await wait_for(lambda: admission.in_flight(SMOLLM2) == 1, "the request admitted")
            await anyio.sleep(STILL_WAITING_SECONDS)
            assert not answers, answers[0].text
            assert cluster.refused == [] and cluster.submitted == [], "sent while unavailable"
            cluster.change(serving())  # every runner of the new placement ready
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert SCRIPTED_ANSWER.split()[0] in answer.text
    assert len(cluster.submitted) == 1 and cluster.refused == []
    assert admission.in_flight(SMOLLM2) == 0


async def test_a_request_the_master_refuses_while_it_re_places_waits_and_is_sent_again() -> None:
    # This node has not applied the node loss yet; the master has, and refuses.
    cluster = ReplacingCluster(serving())
    cluster.master_state = replacing()
    path, body = REQUESTS["chat"]
    answers: list[httpx.Response] = []
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, Admission()) as http, anyio.create_task_group() as group:

            async def send() -> None:
                answers.append(await http.post(path, json=body))

            group.start_soon(send)
            await wait_for(lambda: len(cluster.refused) == 1, "the master refused")
            await anyio.sleep(STILL_WAITING_SECONDS)
            assert not answers, answers[0].text
            assert cluster.submitted == []
            cluster.master_state = None
            cluster.change(serving())
    (answer,) = answers
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
    monkeypatch.setattr(accepted_generation, "REPLACEMENT_WAIT_SECONDS", 0.3)
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS[name]
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, Admission()) as http:
            started = anyio.current_time()
            answer = await http.post(path, json=body)
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
    monkeypatch.setattr(accepted_generation, "REPLACEMENT_WAIT_SECONDS", 0.3)
    cluster = ReplacingCluster(replacing())
    path, body = REQUESTS["chat stream"]
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, Admission()) as http:
            answer = await http.post(path, json=body)
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
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, Admission()) as http:
            answer = await http.post(path, json=body)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "waiting for room" in error_message(path, answer)
    assert len(cluster.refused) == 1  # the master's answer, as before


async def test_an_instance_deleted_while_a_request_waits_is_a_503() -> None:
    cluster = ReplacingCluster(replacing())
    admission = Admission()
    path, body = REQUESTS["ollama"]
    answers: list[httpx.Response] = []
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, admission) as http, anyio.create_task_group() as group:

            async def send() -> None:
                answers.append(await http.post(path, json=body))

            group.start_soon(send)
            await wait_for(lambda: admission.in_flight(SMOLLM2) == 1, "the request admitted")
            cluster.change(make_state())  # DELETE /instance
    (answer,) = answers
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == str(UNAVAILABLE_RETRY_AFTER_SECONDS)
    assert "deleted" in error_message(path, answer)
    assert cluster.refused == [] and cluster.submitted == []


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
