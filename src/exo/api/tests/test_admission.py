"""Admission: an API node lets at most capacity + queue of its requests be in flight per
instance of a model; the next one waits (first come first served) for a place, and is
answered 503 with `Retry-After` in its dialect's error shape when none frees in time. A
freed place admits the waiter; a client that leaves while waiting gives up its place.

The app runs in-process over a scripted cluster whose generations each hold until the test
lets them finish.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from exo.api.app import create_app
from exo.api.serving.admission import DEFAULT_MIN_QUEUE, DEFAULT_QUEUE_BATCHES, Admission
from exo.api.wire.errors import GenerationError, QueueFullError
from exo.master.placement import runner_id_for
from exo.shared.types.chunks import Chunk, TokenChunk, Usage
from exo.shared.types.commands import CancelGeneration, ComputeEmbeddings, GenerateText
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.runners import RunnerLoading, RunnerReady, RunnerRunning, RunnerStatus
from exo.shared.types.state import InstanceUnavailable, State
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import ScriptedCluster

pytestmark = pytest.mark.anyio

DEADLINE_SECONDS = 20.0
NODE = NodeId("node-a")
USER_HI = {"role": "user", "content": "hi"}
# (path, body) of one non-streamed generation in every dialect.
DIALECT_REQUESTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": SMOLLM2, "messages": [USER_HI]}),
    "completions": ("/v1/completions", {"model": SMOLLM2, "prompt": "hi"}),
    "responses": ("/v1/responses", {"model": SMOLLM2, "input": "hi"}),
    "claude": ("/v1/messages", {"model": SMOLLM2, "messages": [USER_HI], "max_tokens": 8}),
    "ollama": ("/ollama/api/chat", {"model": SMOLLM2, "messages": [USER_HI], "stream": False}),
}


def state_with(*statuses: RunnerStatus, unavailable: tuple[int, ...] = ()) -> State:
    """One single-node instance of SmolLM2 per status, its rank-0 runner in that status;
    the instances numbered in `unavailable` lost a node."""
    instances = [
        make_instance(NODE, instance_id=f"instance-{index}") for index in range(len(statuses))
    ]
    runners = {
        runner_id_for(instance.instance_id, 0): (NODE, status)
        for instance, status in zip(instances, statuses, strict=True)
    }
    state = make_state(instances=instances, runners=runners)
    lost = {
        instances[index].instance_id: InstanceUnavailable(reason="node-b left")
        for index in unavailable
    }
    return state.model_copy(update={"unavailable_instances": lost})


class HeldCluster(ScriptedCluster):
    """A scripted cluster whose every generation holds until `finish(n)` lets the n oldest
    unfinished ones answer."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state
        self.gates: dict[CommandId, anyio.Event] = {}

    def finish(self, count: int = 1) -> None:
        waiting = [gate for gate in self.gates.values() if not gate.is_set()]
        for gate in waiting[:count]:
            gate.set()

    async def submit(self, command: GenerateText | ComputeEmbeddings, timeout: float = 0.0) -> None:
        self.gates[command.command_id] = anyio.Event()
        await super().submit(command, timeout)

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        await self.gates[command_id].wait()
        (command,) = [item for item in self.submitted if item.command_id == command_id]
        yield TokenChunk(
            command_id=command_id,
            model=command.params.model,
            text=self.answer,
            token_ids=(1, 2),
            finish_reason="stop",
            usage=Usage(prompt_tokens=5, completion_tokens=2),
        )


async def wait_for(condition: Any, what: str) -> None:
    with anyio.fail_after(DEADLINE_SECONDS):
        while not condition():
            await anyio.sleep(0.01)
    assert condition(), what


# ---------------------------------------------------------------- capacity


def test_capacity_is_the_rank_zero_runners_batch_plus_the_default_queue() -> None:
    admission = Admission()
    loading = RunnerLoading(layers_loaded=1, total_layers=30)
    state = state_with(RunnerReady(max_concurrent_requests=8), loading)
    # The loading instance counts with a batch of 1 until it reports its own; the queue of
    # each is 4 batches, at least 16.
    assert (DEFAULT_QUEUE_BATCHES, DEFAULT_MIN_QUEUE) == (4, 16)
    assert admission.capacity(state, SMOLLM2) == (8 + 1, 4 * 8 + 16)
    assert Admission(max_queued_requests=3).limit(state, SMOLLM2) == 8 + 1 + 2 * 3


def test_a_running_instance_keeps_the_capacity_it_reported_while_ready() -> None:
    admission = Admission(max_queued_requests=0)
    assert admission.limit(state_with(RunnerReady(max_concurrent_requests=4)), SMOLLM2) == 4
    assert admission.limit(state_with(RunnerRunning()), SMOLLM2) == 4
    assert Admission(max_queued_requests=0).limit(state_with(RunnerRunning()), SMOLLM2) == 1
    running_with_its_own = state_with(RunnerRunning(max_concurrent_requests=6))
    assert Admission(max_queued_requests=0).limit(running_with_its_own, SMOLLM2) == 6


def test_an_unavailable_instance_takes_no_requests() -> None:
    state = state_with(RunnerReady(), RunnerReady(), unavailable=(1,))
    assert Admission(max_queued_requests=2).limit(state, SMOLLM2) == 1 + 2


def test_a_model_whose_every_instance_is_being_replaced_keeps_its_places() -> None:
    """Requests during a re-placement go on to the cluster (which waits for the re-placed
    instance) rather than waiting here on a limit of 0 and failing "busy"."""
    state = state_with(RunnerReady(), RunnerReady(), unavailable=(0, 1))
    assert Admission(max_queued_requests=2).limit(state, SMOLLM2) == 2 * (1 + 2)


def test_a_negative_queue_is_refused() -> None:
    with pytest.raises(ValueError, match="max_queued_requests"):
        Admission(max_queued_requests=-1)


# ---------------------------------------------------------------- waiting


class FakeRequest:
    def __init__(self) -> None:
        self.gone = False

    async def is_disconnected(self) -> bool:
        return self.gone


async def test_a_waiting_request_is_admitted_first_come_first_served() -> None:
    state = state_with(RunnerReady())
    admission = Admission(max_queued_requests=0, wait_seconds=DEADLINE_SECONDS, poll_seconds=0.05)
    release = await admission.admit(lambda: state, FakeRequest(), SMOLLM2)
    order: list[str] = []

    async def waiter(name: str) -> None:
        release_mine = await admission.admit(lambda: state, FakeRequest(), SMOLLM2)
        order.append(name)
        release_mine()

    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(waiter, "first")
            await wait_for(lambda: admission.waiting(SMOLLM2) == 1, "first waits")
            task_group.start_soon(waiter, "second")
            await wait_for(lambda: admission.waiting(SMOLLM2) == 2, "second waits")
            assert admission.in_flight(SMOLLM2) == 1
            release()
            release()  # idempotent: a second call frees nothing more
    assert order == ["first", "second"]
    assert admission.in_flight(SMOLLM2) == 0


async def test_a_client_leaving_while_waiting_gives_up_its_place() -> None:
    state = state_with(RunnerReady())
    admission = Admission(max_queued_requests=0, wait_seconds=DEADLINE_SECONDS, poll_seconds=0.02)
    release = await admission.admit(lambda: state, FakeRequest(), SMOLLM2)
    leaving, staying = FakeRequest(), FakeRequest()
    outcome: list[str] = []

    async def wait_as(request: FakeRequest, name: str) -> None:
        try:
            (await admission.admit(lambda: state, request, SMOLLM2))()
            outcome.append(f"{name} admitted")
        except GenerationError:
            outcome.append(f"{name} left")

    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(wait_as, leaving, "leaving")
            await wait_for(lambda: admission.waiting(SMOLLM2) == 1, "the first waits")
            task_group.start_soon(wait_as, staying, "staying")
            await wait_for(lambda: admission.waiting(SMOLLM2) == 2, "the second waits")
            leaving.gone = True
            await wait_for(lambda: admission.waiting(SMOLLM2) == 1, "the leaver is gone")
            release()
    assert outcome == ["leaving left", "staying admitted"]
    assert admission.in_flight(SMOLLM2) == 0 and admission.waiting(SMOLLM2) == 0


async def test_no_place_within_the_wait_is_a_queue_full_error() -> None:
    state = state_with(RunnerReady())
    admission = Admission(max_queued_requests=0, wait_seconds=0.3, poll_seconds=0.05)
    await admission.admit(lambda: state, FakeRequest(), SMOLLM2)
    started = anyio.current_time()
    with pytest.raises(QueueFullError) as raised:
        await admission.admit(lambda: state, FakeRequest(), SMOLLM2)
    assert anyio.current_time() - started >= 0.3  # it waited the whole bounded wait
    assert raised.value.status_code == 503 and raised.value.code == "queue_full"
    assert admission.waiting(SMOLLM2) == 0


async def test_a_new_instance_admits_a_waiting_request() -> None:
    states = [state_with(RunnerReady())]
    admission = Admission(max_queued_requests=0, wait_seconds=DEADLINE_SECONDS, poll_seconds=0.02)
    await admission.admit(lambda: states[0], FakeRequest(), SMOLLM2)
    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(admission.admit, lambda: states[0], FakeRequest(), SMOLLM2)
            await wait_for(lambda: admission.waiting(SMOLLM2) == 1, "it waits")
            states[0] = state_with(RunnerReady(), RunnerReady())
    assert admission.in_flight(SMOLLM2) == 2


# ---------------------------------------------------------------- through the app


def http_client(cluster: HeldCluster, admission: Admission) -> httpx.AsyncClient:
    app = create_app(cluster, admission=admission)  # type: ignore[arg-type]
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:52415"
    )


@pytest.mark.parametrize("dialect", list(DIALECT_REQUESTS))
async def test_a_full_model_answers_503_with_retry_after_in_the_dialects_shape(
    dialect: str,
) -> None:
    # Batch of 2 plus a queue of 1: three requests in flight, the fourth waits, then 503.
    cluster = HeldCluster(state_with(RunnerReady(max_concurrent_requests=2)))
    admission = Admission(max_queued_requests=1, wait_seconds=0.5, poll_seconds=0.05)
    path, body = DIALECT_REQUESTS[dialect]
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await http.post(path, json=body))

    with anyio.fail_after(DEADLINE_SECONDS):
        async with (
            http_client(cluster, admission) as http,
            anyio.create_task_group() as task_group,
        ):
            for _ in range(3):
                task_group.start_soon(send)
            await wait_for(lambda: len(cluster.submitted) == 3, "three admitted")
            refused = await http.post(path, json=body)
            assert len(cluster.submitted) == 3, "the refused request reached the cluster"
            cluster.finish(3)
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    # Anthropic answers an overloaded API with 529, which its clients retry.
    assert refused.status_code == (529 if dialect == "claude" else 503), refused.text
    assert refused.headers["Retry-After"] == str(admission.retry_after_seconds)
    error = refused.json()
    match dialect:
        case "claude":
            assert error["type"] == "error"
            assert error["error"]["type"] == "overloaded_error"
            message = error["error"]["message"]
        case "ollama":
            assert set(error) == {"error"}
            message = error["error"]
        case _:
            assert error["error"]["type"] == "service_unavailable_error"
            assert error["error"]["code"] == "queue_full"
            message = error["error"]["message"]
    assert "busy" in message and "retry after" in message
    assert admission.in_flight(SMOLLM2) == 0


async def test_a_freed_place_admits_the_waiting_request_through_the_app() -> None:
    cluster = HeldCluster(state_with(RunnerReady()))
    admission = Admission(max_queued_requests=0, wait_seconds=DEADLINE_SECONDS, poll_seconds=0.05)
    path, body = DIALECT_REQUESTS["chat"]
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await http.post(path, json=body))

    with anyio.fail_after(DEADLINE_SECONDS):
        async with (
            http_client(cluster, admission) as http,
            anyio.create_task_group() as task_group,
        ):
            task_group.start_soon(send)
            await wait_for(lambda: len(cluster.submitted) == 1, "the first admitted")
            task_group.start_soon(send)
            await wait_for(lambda: admission.waiting(SMOLLM2) == 1, "the second waits")
            assert len(cluster.submitted) == 1
            cluster.finish(1)
            await wait_for(lambda: len(cluster.submitted) == 2, "the second admitted")
            cluster.finish(1)
    assert [answer.status_code for answer in answers] == [200, 200]
    assert "Retry-After" not in answers[1].headers
    assert admission.in_flight(SMOLLM2) == 0


async def test_a_streamed_answer_holds_its_place_until_it_ends() -> None:
    cluster = HeldCluster(state_with(RunnerReady()))
    admission = Admission(max_queued_requests=0, wait_seconds=DEADLINE_SECONDS, poll_seconds=0.05)
    path, body = DIALECT_REQUESTS["chat"]

    async def stream() -> None:
        answer = await http.post(path, json=body | {"stream": True})
        assert answer.status_code == 200 and "[DONE]" in answer.text

    with anyio.fail_after(DEADLINE_SECONDS):
        async with (
            http_client(cluster, admission) as http,
            anyio.create_task_group() as task_group,
        ):
            task_group.start_soon(stream)
            await wait_for(lambda: admission.in_flight(SMOLLM2) == 1, "the stream holds one")
            cluster.finish(1)
    assert admission.in_flight(SMOLLM2) == 0


async def call_with_failing_send(app: Any, fail_on: str) -> None:
    """A streamed chat request straight through ASGI (spec 2.4, as uvicorn speaks it) whose
    client is gone when the response's `fail_on` message ("start" or "body") is sent."""
    body = json.dumps({**DIALECT_REQUESTS["chat"][1], "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:52415"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 52415),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == f"http.response.{fail_on}":
            raise OSError("the client is gone")

    with contextlib.suppress(Exception):
        await app(scope, receive, send)


@pytest.mark.parametrize("fail_on", ["start", "body"])
async def test_a_stream_whose_client_left_gives_back_its_place(fail_on: str) -> None:
    # Starlette never starts the body when the headers cannot be sent ("start"), and stops
    # iterating it when a piece cannot ("body"); the place comes back at once either way.
    cluster = ScriptedCluster()
    admission = Admission(max_queued_requests=0, wait_seconds=DEADLINE_SECONDS)
    app = create_app(cluster, admission=admission)  # type: ignore[arg-type]
    with anyio.fail_after(DEADLINE_SECONDS):
        await call_with_failing_send(app, fail_on)
    assert len(cluster.submitted) == 1
    assert admission.in_flight(SMOLLM2) == 0
    cancelled = [c.target_command_id for c in cluster.sent if isinstance(c, CancelGeneration)]
    assert cancelled == [cluster.submitted[0].command_id]
