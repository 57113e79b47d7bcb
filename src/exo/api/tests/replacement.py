"""Shared set-up of the tests of requests sent while their model's instance is placed again
after a node loss (`exo.api.serving.replacement_wait`): the cluster states, a scripted
cluster whose master is the real `events_for_command` over the test's state, the app over
it, a request pending in the background, and the 503's message in each dialect's shape.

Two models are placed on this node: SmolLM2 (chat and mean-pooled embeddings) and
Qwen3-Reranker-0.6B (rerank), each with one instance.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.api.serving import accepted_generation, early_stream, embedding, replacement_wait
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import CommandRejectedError
from exo.master.decisions import events_for_command
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, Chunk, ErrorChunk
from exo.shared.types.commands import ComputeEmbeddings, GenerateText
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.events import CommandRejected
from exo.shared.types.models import ModelCard
from exo.shared.types.state import InstanceUnavailable, State
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import ScriptedCluster

DEADLINE_SECONDS = 20.0
# Long enough for a request that was going to be refused at once to have been refused.
STILL_WAITING_SECONDS = 0.3
NODE = NodeId("node-a")
INSTANCE = InstanceId("instance-1")
RERANKER = ModelId("Qwen/Qwen3-Reranker-0.6B")
RERANK_INSTANCE = InstanceId("instance-rerank")
LOADING = "node n-1 left; re-placed on node-a, loading"
NO_ROOM = "node n-1 left; waiting for room: no node has 300 MiB free"


@functools.cache
def reranker_card() -> ModelCard:
    return load_builtin_cards()[RERANKER]


def serving() -> State:
    """Both models' instances serving."""
    reranker = make_instance(NODE, reranker_card(), instance_id=RERANK_INSTANCE)
    return make_state(instances=[make_instance(NODE), reranker])


def unavailable(reason: str, waiting_for_room: bool = False) -> State:
    """Every instance unavailable for `reason`."""
    state = serving()
    entry = InstanceUnavailable(reason=reason, waiting_for_room=waiting_for_room)
    return state.model_copy(update={"unavailable_instances": dict.fromkeys(state.instances, entry)})


def replacing(reason: str = LOADING) -> State:
    """Every instance re-placed after its node left, its new runners loading."""
    return unavailable(reason)


def waiting_for_room() -> State:
    """Every instance waits for room no node set has."""
    return unavailable(NO_ROOM, waiting_for_room=True)


class ReplacingCluster(ScriptedCluster):
    """A scripted cluster whose master decides with `events_for_command` over
    `master_state` (by default this node's state): refusals raise as `ClusterClient.submit`
    does, and a refused command is recorded in `refused`. A master ahead of this node
    (`master_state` set) refuses, then this node applies the master's state, as the
    refusal reaches a node only after the events before it.

    `losses`: the next accepted commands (generations and embeddings alike) lose their
    instance before answering, each leaving this node (and the master) holding the state
    given: their stream ends with the `INSTANCE_UNAVAILABLE` error chunk the API gets.
    """

    def __init__(self, state: State) -> None:
        super().__init__()
        self.cards[RERANKER] = reranker_card()
        self.state = state
        self.state_changed = anyio.Event()
        self.master_state: State | None = None
        self.refused: list[GenerateText | ComputeEmbeddings] = []
        self.losses: list[State] = []
        self.lost: list[CommandId] = []

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
            self.refused.append(command)
            if self.master_state is not None:
                self.change(self.master_state)
            raise CommandRejectedError(event.reason, event.status_code)
        await super().submit(command, timeout)

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        if self.losses:
            self.change(self.losses.pop(0))
            self.lost.append(command_id)
            yield ErrorChunk(
                command_id=command_id,
                model=SMOLLM2,
                error_message=f"instance {INSTANCE} is unavailable: node n-1 left; re-placing",
                status_code=503,
                error_code=INSTANCE_UNAVAILABLE,
            )
            return
        async for chunk in super()._answer(command_id):
            yield chunk


def quick_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waiters look at the state often, and a stream sends its headers early, so that
    these tests take tenths of seconds (each test module's autouse fixture)."""
    monkeypatch.setattr(replacement_wait, "STATE_CHECK_SECONDS", 0.02)
    monkeypatch.setattr(early_stream, "HEADERS_AFTER_SECONDS", 0.05)


def shorten_waits(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every wait for a re-placed instance (new and lost requests, generations and
    embeddings) lasts at most `seconds`."""
    for module in (accepted_generation, embedding):
        monkeypatch.setattr(module, "REPLACEMENT_WAIT_SECONDS", seconds)
        monkeypatch.setattr(module, "RETRY_WAIT_SECONDS", seconds)


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


@dataclass
class Pending:
    """A request posted in the background (`pending`); `answer` once the block ended."""

    admission: Admission
    answers: list[httpx.Response] = field(default_factory=list)

    @property
    def answer(self) -> httpx.Response:
        (answer,) = self.answers
        return answer

    async def admitted(self, model: str) -> None:
        """Return once the request holds its admission place (it is past every check)."""
        await wait_for(lambda: self.admission.in_flight(ModelId(model)) == 1, "admitted")


@contextlib.asynccontextmanager
async def pending(
    cluster: ReplacingCluster, path: str, body: dict[str, Any]
) -> AsyncIterator[Pending]:
    """Post `body` to `path` in the background; the block ends once it is answered (within
    `DEADLINE_SECONDS` in all)."""
    request = Pending(Admission())
    with anyio.fail_after(DEADLINE_SECONDS):
        async with (
            app_client(cluster, request.admission) as http,
            anyio.create_task_group() as group,
        ):

            async def send() -> None:
                request.answers.append(await http.post(path, json=body))

            group.start_soon(send)
            yield request


async def answer_of(cluster: ReplacingCluster, path: str, body: dict[str, Any]) -> httpx.Response:
    """`body` posted to `path` and answered, within `DEADLINE_SECONDS`."""
    with anyio.fail_after(DEADLINE_SECONDS):
        async with app_client(cluster, Admission()) as http:
            answer: httpx.Response = await http.post(path, json=body)
            return answer


def error_message(path: str, response: httpx.Response) -> str:
    """The message of a 503 in the dialect's error shape (asserting the shape): Claude's
    `overloaded_error`, Ollama's `{"error": ...}` (under `/ollama/api` and at the root's
    `/api`), else OpenAI's envelope."""
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
        return str(body["error"]["message"])
    if path.startswith(("/ollama/api/", "/api/")):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return str(body["error"])
    assert body["error"]["type"] == "service_unavailable_error", body
    return str(body["error"]["message"])
