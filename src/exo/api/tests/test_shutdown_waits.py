"""A node that stops while requests still wait before their chunk stream — for their model
to load on request, or for a place in the admission queue — answers each of them as it
answers an open stream, at once (`exo.api.serving.node_stop`): a non-streamed request 503
`node_shutting_down` in its dialect's error shape, a stream whose headers went out its
dialect's in-band error; none is cut by uvicorn's graceful-shutdown timeout (a plain-text
500, a stream ended without its error, a `CancelledError` traceback). The node's API
(`exo.api.main.Api`) over a real `ClusterClient`, a stand-in master and runner, and real
HTTP on 127.0.0.1, as in `test_shutdown_streams`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx
import pytest

from exo.api.guards.browser_access import BrowserAccess
from exo.api.main import SHUTTING_DOWN_MESSAGE, Api, bind_api_socket
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import ClusterClient
from exo.api.tests.test_shutdown_streams import (
    DEADLINE_SECONDS,
    FIRST_TEXT,
    MESSAGES,
    NODE,
    STREAMS,
    error_of,
    uvicorn_warnings,
)
from exo.shared.types.chunks import Chunk, TokenChunk
from exo.shared.types.commands import (
    CancelGeneration,
    ForwarderCommand,
    GenerateText,
    PlaceInstance,
)
from exo.shared.types.common import TaskId
from exo.shared.types.events import IndexedEvent, InstanceCreated, TaskCreated
from exo.shared.types.state import State
from exo.shared.types.tasks import TextGeneration
from exo.testing.builders import SMOLLM2, make_instance, make_node_info, make_state, smollm2_card
from exo.utils.channels import Subscription, Topic

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
class StandIn:
    """The master and runner: a placement makes an instance that never becomes ready (once
    `placing` is set); a generation becomes a task that streams one token and nothing
    more."""

    state: State
    placing: anyio.Event = field(default_factory=anyio.Event)
    placements: list[PlaceInstance] = field(default_factory=list)
    generations: list[GenerateText] = field(default_factory=list)
    cancelled: list[CancelGeneration] = field(default_factory=list)

    async def serve(
        self,
        commands: Subscription[ForwarderCommand],
        applied: Topic[IndexedEvent],
        chunks: Topic[Chunk],
    ) -> None:
        index = 0
        instance = make_instance(NODE)
        async for forwarded in commands:
            match forwarded.command:
                case CancelGeneration() as cancel:
                    self.cancelled.append(cancel)
                case PlaceInstance() as place if place not in self.placements:  # not resent
                    self.placements.append(place)
                    await self.placing.wait()
                    self.state = self.state.model_copy(
                        update={"instances": {instance.instance_id: instance}}
                    )
                    event = InstanceCreated(instance=instance, command_id=place.command_id)
                    applied.publish(IndexedEvent(idx=index, event=event))
                    index += 1
                case GenerateText() as command:
                    self.generations.append(command)
                    task = TextGeneration(
                        task_id=TaskId(f"task-{index}"),
                        command_id=command.command_id,
                        instance_id=instance.instance_id,
                        origin_node_id=NODE,
                        params=command.params,
                    )
                    applied.publish(IndexedEvent(idx=index, event=TaskCreated(task=task)))
                    index += 1
                    chunks.publish(
                        TokenChunk(
                            command_id=command.command_id,
                            model=SMOLLM2,
                            text=FIRST_TEXT,
                            token_ids=(1,),
                        )
                    )
                case _:
                    pass


@dataclass
class Answer:
    status: int | None = None
    body: str = ""
    headers_sent: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class RunningNode:
    """A node's API serving: its HTTP client, its cluster client, `stop` (SIGTERM, then
    wait until the API returned; the seconds that took) and uvicorn's warnings."""

    client: httpx.AsyncClient
    cluster: ClusterClient
    stop: Callable[[], Awaitable[float]]
    warnings: list[str]


@asynccontextmanager
async def node(stand_in: StandIn, admission: Admission | None = None) -> AsyncIterator[RunningNode]:
    """A node's API over `stand_in`, serving on 127.0.0.1."""
    commands: Topic[ForwarderCommand] = Topic("commands")
    applied: Topic[IndexedEvent] = Topic("applied")
    chunks: Topic[Chunk] = Topic("chunks")
    cluster = ClusterClient(
        node_id=NODE,
        current_state=lambda: stand_in.state,
        applied_events=applied.subscribe(),
        chunk_subscription=chunks.subscribe(),
        command_publisher=commands.sender(),
        cards={SMOLLM2: smollm2_card()},
    )
    listener = bind_api_socket("127.0.0.1", 0)
    api = Api(cluster, listener, "WARNING", BrowserAccess(), admission=admission)
    scope = anyio.CancelScope()  # the node's task group, which a signal cancels
    stopped = anyio.Event()

    async def run_node() -> None:
        with scope:
            await api.run()
        stopped.set()

    async def stop() -> float:
        stopping = time.monotonic()
        scope.cancel()  # SIGTERM / Ctrl-C: `Node._stop_on_signal`
        await stopped.wait()
        return time.monotonic() - stopping

    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    with uvicorn_warnings() as warnings, anyio.fail_after(DEADLINE_SECONDS):
        async with (
            anyio.create_task_group() as task_group,
            httpx.AsyncClient(base_url=base, timeout=DEADLINE_SECONDS) as client,
        ):
            task_group.start_soon(stand_in.serve, commands.subscribe(), applied, chunks)
            task_group.start_soon(run_node)
            while not api.started:
                await anyio.sleep(0.01)
            yield RunningNode(client, cluster, stop, warnings)
            task_group.cancel_scope.cancel()


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
