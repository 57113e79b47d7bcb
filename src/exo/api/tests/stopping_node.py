"""A node's API that a test can stop as a signal stops it, for the shutdown tests
(`test_shutdown_streams`, `test_shutdown_waits`): the real `exo.api.main.Api` over a real
`ClusterClient` and real HTTP on 127.0.0.1, a stand-in master and runner behind it
(`StandIn`), uvicorn's warnings captured, and each dialect's streaming request and the
in-band error that ends it."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import anyio
import httpx

from exo.api.guards.browser_access import BrowserAccess
from exo.api.main import Api, bind_api_socket
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.types.chunks import Chunk, TokenChunk
from exo.shared.types.commands import (
    CancelGeneration,
    ForwarderCommand,
    GenerateText,
    PlaceInstance,
)
from exo.shared.types.common import NodeId, TaskId
from exo.shared.types.events import IndexedEvent, InstanceCreated, TaskCreated
from exo.shared.types.state import State
from exo.shared.types.tasks import TextGeneration
from exo.testing.builders import SMOLLM2, make_instance, smollm2_card
from exo.utils.channels import Subscription, Topic

NODE = NodeId("api-node")
DEADLINE_SECONDS = 30
FIRST_TEXT = "Hel"
"""The one token every generation streams (and then nothing more)."""
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


@dataclass
class StandIn:
    """The master and runner: a placement makes an instance that never becomes ready (once
    `placing` is set); a generation becomes a task that streams `FIRST_TEXT` and nothing
    more (it is still generating when the node stops). Records what it was sent."""

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
class RunningNode:
    """A node's API serving: its HTTP client, its cluster client, `stop` (SIGTERM, then
    wait until the API returned; the seconds that took) and uvicorn's warnings."""

    client: httpx.AsyncClient
    cluster: ClusterClient
    stop: Callable[[], Awaitable[float]]
    warnings: list[str]


@asynccontextmanager
async def node(stand_in: StandIn, admission: Admission | None = None) -> AsyncIterator[RunningNode]:
    """A node's API over `stand_in`, serving on 127.0.0.1, all within `DEADLINE_SECONDS`."""
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


def error_of(dialect: str, body: str) -> object:
    """The in-band error that ends `body`, a stream of `STREAMS[dialect]`, in the dialect's
    own shape."""
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
