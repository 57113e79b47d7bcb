"""A node that stops while requests still wait before their chunk stream — for their model
to load on request, or for a place in the admission queue — answers each of them as it
answers an open stream, at once (`exo.api.serving.node_stop`): a non-streamed request 503
`node_shutting_down` in its dialect's error shape, a stream whose headers went out its
dialect's in-band error; none is cut by uvicorn's graceful-shutdown timeout (a plain-text
500, a stream ended without its error, a `CancelledError` traceback). The node's API
(`exo.api.main.Api`) over a real `ClusterClient`, a stand-in master and runner, and real
HTTP on 127.0.0.1 (`exo.api.tests.stopping_node`), as in `test_shutdown_streams`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import anyio
import httpx
import pytest

from exo.api.main import SHUTTING_DOWN_MESSAGE
from exo.api.serving.admission import Admission
from exo.api.tests.stopping_node import (
    FIRST_TEXT,
    MESSAGES,
    NODE,
    STREAMS,
    StandIn,
    error_of,
    node,
)
from exo.testing.builders import SMOLLM2, make_instance, make_node_info, make_state

pytestmark = pytest.mark.anyio

# Waiting requests are answered as the stop begins, well inside uvicorn's 2 s graceful
# timeout (which the old code ran out); room for a busy machine.
ANSWERED_WITHIN_SECONDS = 1.5
# Non-streamed requests of three dialects: (path, body).
NON_STREAMED = {
    "chat": ("/v1/chat/completions", {"model": SMOLLM2, "messages": MESSAGES}),
    "claude": ("/v1/messages", {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 16}),
    "ollama": ("/ollama/api/chat", {"model": SMOLLM2, "messages": MESSAGES, "stream": False}),
}
# Streams whose headers go out before their first chunk (early headers).
EARLY_STREAMS = ("chat", "responses", "claude")


@dataclass
class Answer:
    status: int | None = None
    body: str = ""
    headers_sent: anyio.Event = field(default_factory=anyio.Event)


async def ask(client: httpx.AsyncClient, path: str, body: object, answer: Answer) -> None:
    """Send the request and read its answer into `answer`, a cut stream noted in its body."""
    try:
        async with client.stream("POST", path, json=body) as response:
            answer.status = response.status_code
            answer.headers_sent.set()
            async for text in response.aiter_text():
                answer.body += text
    except httpx.TransportError as error:
        answer.body += f"<cut: {error!r}>"


def asked(
    task_group: anyio.abc.TaskGroup, client: httpx.AsyncClient
) -> tuple[dict[str, Answer], dict[str, Answer]]:
    """Every dialect's non-streamed request and early-header stream, sent now: (answers of
    the non-streamed, answers of the streams)."""
    plain = {dialect: Answer() for dialect in NON_STREAMED}
    streams = {dialect: Answer() for dialect in EARLY_STREAMS}
    for dialect, (path, body) in NON_STREAMED.items():
        task_group.start_soon(ask, client, path, body, plain[dialect])
    for dialect in EARLY_STREAMS:
        path, body = STREAMS[dialect]
        task_group.start_soon(ask, client, path, body, streams[dialect])
    return plain, streams


def assert_told_the_node_stops(plain: dict[str, Answer], streams: dict[str, Answer]) -> None:
    for dialect, answer in plain.items():
        assert answer.status == 503, (dialect, answer)
        payload = json.loads(answer.body)
        if dialect == "ollama":
            assert payload == {"error": SHUTTING_DOWN_MESSAGE}
        elif dialect == "claude":
            assert payload["type"] == "error", payload
            assert payload["error"]["message"] == SHUTTING_DOWN_MESSAGE, payload
        else:
            assert payload["error"]["message"] == SHUTTING_DOWN_MESSAGE, payload
            assert payload["error"]["code"] == "node_shutting_down", payload
    for dialect, answer in streams.items():
        assert answer.status == 200, (dialect, answer)
        assert error_of(dialect, answer.body) == SHUTTING_DOWN_MESSAGE, (dialect, answer)


async def test_requests_waiting_for_their_model_to_load_are_told_the_node_stops() -> None:
    stand_in = StandIn(make_state(nodes={NODE: make_node_info(4096)}))
    async with node(stand_in) as running, anyio.create_task_group() as asking:
        plain, streams = asked(asking, running.client)
        for answer in streams.values():
            await answer.headers_sent.wait()  # the placement is under way: early headers
        # Every request has been waiting for the placement since before the headers went
        # out; now it is placed, they all wait for its runner to be ready.
        stand_in.placing.set()
        while not stand_in.state.instances:
            await anyio.sleep(0.01)
        await anyio.sleep(0.1)
        assert len(stand_in.placements) == 1
        assert all(answer.status is None for answer in plain.values())
        assert stand_in.generations == []
        took = await running.stop()
    assert_told_the_node_stops(plain, streams)
    assert took < ANSWERED_WITHIN_SECONDS
    assert stand_in.generations == []
    assert running.warnings == []


async def test_requests_waiting_in_the_admission_queue_are_told_the_node_stops() -> None:
    stand_in = StandIn(make_state(instances=[make_instance(NODE)]))
    admission = Admission(max_queued_requests=0)  # one generation at a time, none queued
    async with node(stand_in, admission) as running, anyio.create_task_group() as asking:
        first = Answer()
        asking.start_soon(ask, running.client, *STREAMS["chat"], first)
        while FIRST_TEXT not in first.body:
            await anyio.sleep(0.01)
        plain, streams = asked(asking, running.client)
        for answer in streams.values():
            await answer.headers_sent.wait()  # queued: early headers
        assert admission.waiting(SMOLLM2) == len(plain) + len(streams)
        took = await running.stop()
    assert_told_the_node_stops(plain, streams)
    assert took < ANSWERED_WITHIN_SECONDS
    assert error_of("chat", first.body) == SHUTTING_DOWN_MESSAGE  # an open stream, as before
    assert len(stand_in.generations) == 1  # the queued ones were never sent
    assert running.warnings == []


async def test_a_request_arriving_once_the_node_stops_is_answered_at_once() -> None:
    """A request that reaches the API after the stop began (`end_streams` runs before
    uvicorn stops listening) is neither placed nor queued: 503 at once, also a stream
    (its headers not sent yet: a plain HTTP error)."""
    stand_in = StandIn(make_state(nodes={NODE: make_node_info(4096)}))
    async with node(stand_in) as running:
        running.cluster.end_streams(SHUTTING_DOWN_MESSAGE)  # what the stop does first
        answers = {dialect: Answer() for dialect in ("chat", "claude")}
        with anyio.fail_after(ANSWERED_WITHIN_SECONDS):
            await ask(running.client, *NON_STREAMED["chat"], answers["chat"])
            await ask(running.client, *STREAMS["claude"], answers["claude"])
        assert_told_the_node_stops(answers, {})
        assert stand_in.placements == []
        await running.stop()
    assert running.warnings == []
