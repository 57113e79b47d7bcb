"""A node that stops while generations stream ends every open stream with its dialect's
in-band error ("the node is shutting down") within uvicorn's graceful-shutdown timeout,
cancels those generations on the cluster, and logs no ASGI exception: the node's API
(`exo.api.main.Api`) over a real `ClusterClient`, a stand-in master and runner, and real
HTTP streams on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import httpx
import pytest

from exo.api.guards.browser_access import BrowserAccess
from exo.api.main import SHUTTING_DOWN_MESSAGE, Api, bind_api_socket
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.types.chunks import Chunk, TokenChunk
from exo.shared.types.commands import CancelGeneration, ForwarderCommand, GenerateText
from exo.shared.types.common import NodeId, TaskId
from exo.shared.types.events import IndexedEvent, TaskCreated
from exo.shared.types.tasks import TextGeneration
from exo.testing.builders import SMOLLM2, make_instance, make_state, smollm2_card
from exo.utils.channels import Subscription, Topic

pytestmark = pytest.mark.anyio

NODE = NodeId("api-node")
DEADLINE_SECONDS = 30
# uvicorn's `timeout_graceful_shutdown` (2 s, `server_config`) plus room for a busy machine.
SHUTDOWN_BOUND_SECONDS = 10.0
FIRST_TEXT = "Hel"
MESSAGES = [{"role": "user", "content": "hi"}]
# One streaming request per dialect: (path, body).
STREAMS = {
    "chat": ("/v1/chat/completions", {"model": SMOLLM2, "messages": MESSAGES, "stream": True}),
    "responses": ("/v1/responses", {"model": SMOLLM2, "input": "hi", "stream": True}),
    "claude": (
        "/v1/messages",
        {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 16, "stream": True},
    ),
    "ollama": ("/ollama/api/chat", {"model": SMOLLM2, "messages": MESSAGES}),
}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def uvicorn_warnings() -> Iterator[list[str]]:
    """uvicorn's warnings and errors (its loggers do not propagate to pytest's capture)."""
    records = _Records()
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(records)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)


async def stand_in_cluster(
    commands: Subscription[ForwarderCommand],
    applied: Topic[IndexedEvent],
    chunks: Topic[Chunk],
    cancelled: list[CancelGeneration],
) -> None:
    """The master and runner: each generation becomes a task and streams one token, then
    nothing more (it is still generating when the node stops)."""
    index = 0
    async for forwarded in commands:
        command = forwarded.command
        if isinstance(command, CancelGeneration):
            cancelled.append(command)
        if not isinstance(command, GenerateText):
            continue
        task = TextGeneration(
            task_id=TaskId(f"task-{index}"),
            command_id=command.command_id,
            instance_id=make_instance(NODE).instance_id,
            origin_node_id=NODE,
            params=command.params,
        )
        applied.publish(IndexedEvent(idx=index, event=TaskCreated(task=task)))
        index += 1
        chunks.publish(
            TokenChunk(
                command_id=command.command_id, model=SMOLLM2, text=FIRST_TEXT, token_ids=(1,)
            )
        )


async def read_stream(
    client: httpx.AsyncClient, dialect: str, bodies: dict[str, str], started: anyio.Event
) -> None:
    """Stream `dialect`'s request into `bodies[dialect]`; `started` once its first text
    arrived."""
    path, body = STREAMS[dialect]
    bodies[dialect] = ""
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for text in response.aiter_text():
            bodies[dialect] += text
            if FIRST_TEXT in bodies[dialect]:
                started.set()


def error_of(dialect: str, body: str) -> object:
    """The in-band error that ends `body`, in the dialect's own shape."""
    if dialect == "ollama":
        return json.loads(body.strip().splitlines()[-1])["error"]
    events = [block for block in body.split("\n\n") if block.strip()]
    if dialect == "chat":
        *_, last_data, done = events
        assert done == "data: [DONE]"
        return json.loads(last_data.removeprefix("data: "))["error"]["message"]
    last = events[-1]
    name, data = last.split("\n", 1)
    payload = json.loads(data.removeprefix("data: "))
    if dialect == "claude":
        assert name == "event: error"
        return payload["error"]["message"]
    assert name == "event: response.failed"
    return payload["response"]["error"]["message"]


async def test_open_streams_end_with_their_dialects_error_when_the_node_stops() -> None:
    state = make_state(instances=[make_instance(NODE)])
    commands: Topic[ForwarderCommand] = Topic("commands")
    applied: Topic[IndexedEvent] = Topic("applied")
    chunks: Topic[Chunk] = Topic("chunks")
    cluster = ClusterClient(
        node_id=NODE,
        current_state=lambda: state,
        applied_events=applied.subscribe(),
        chunk_subscription=chunks.subscribe(),
        command_publisher=commands.sender(),
        cards={SMOLLM2: smollm2_card()},
    )
    listener = bind_api_socket("127.0.0.1", 0)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    api = Api(cluster, listener, "WARNING", BrowserAccess())
    cancelled: list[CancelGeneration] = []
    bodies: dict[str, str] = {}
    node = anyio.CancelScope()  # the node's task group, which a signal cancels
    stopped: list[float] = []

    async def run_node() -> None:
        with node:
            await api.run()
        stopped.append(time.monotonic())

    with uvicorn_warnings() as warnings, anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(
                stand_in_cluster, commands.subscribe(), applied, chunks, cancelled
            )
            task_group.start_soon(run_node)
            while not api.started:
                await anyio.sleep(0.01)
            async with (
                httpx.AsyncClient(base_url=base, timeout=DEADLINE_SECONDS) as client,
                anyio.create_task_group() as streams,
            ):
                for dialect in STREAMS:
                    started = anyio.Event()
                    streams.start_soon(read_stream, client, dialect, bodies, started)
                    await started.wait()
                stopping = time.monotonic()
                node.cancel()  # SIGTERM / Ctrl-C: `Node._stop_on_signal`
            while not stopped:
                await anyio.sleep(0.01)
            task_group.cancel_scope.cancel()
    assert stopped[0] - stopping < SHUTDOWN_BOUND_SECONDS
    for dialect, body in bodies.items():
        assert FIRST_TEXT in body, dialect
        assert error_of(dialect, body) == SHUTTING_DOWN_MESSAGE, (dialect, body)
    assert len(cancelled) == len(STREAMS)  # no generation runs on for a client gone
    assert warnings == []
