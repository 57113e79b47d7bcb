"""Mid-stream failover and the short chaos set, on one cluster of three real `exo` processes
on loopback (A: master and API node; B and C), in this order, each scenario leaving the
cluster usable or restoring it:

1. SIGKILL a runner mid-stream (`tests/chaos/scenarios.py`): the default model's only
   instance on C, chats streaming through C; its runner is killed.
2. Failover: the node of a streaming instance is killed after every client got at least
   `KILL_AFTER_CHUNKS` chunks, a second instance of the model is healthy on another node,
   and each client — raw SSE and the openai SDK on Chat Completions, the openai SDK on
   Responses, the anthropic SDK on Claude Messages, raw NDJSON on Ollama — gets one
   unbroken answer: the scripted text, each word once, with the usage of the original
   request. The five streams run at once on B's instance: C's is made the busier first by
   five streams pinned to it (`X-Exo-Instance`), so the master routes the five to B; then B
   is killed.
3. With no healthy instance left (C killed with the only one) a stream ends with the
   dialect's in-band error, within the failover's deadline.
4. SIGKILL a pipeline rank's node (`tests/chaos/scenarios.py`): B started again (same
   home, so the same node id) and rejoined, a pipeline instance of the default model on A
   and B, chats through A, B killed; the instance is placed again on A.
5. SIGKILL the master mid-stream (`tests/chaos/scenarios.py`): C started again, the
   default model on C, chats through C, A killed; C elects itself and serves.

Each test starts from the nodes it needs (starting again any that an earlier test killed,
so one run alone, or after a failure, still finds them) and an empty cluster (every
instance deleted), so a test leaves nothing that changes the next one. The failover model
is a tiny random one whose answer the engine's test seam scripts (`exo.testing.seam`) and
streams one token per `DECODE_STEP_SECONDS`, so the kill lands mid-stream whatever this
machine's speed, and the text is known; the chaos scenarios serve the default model (the
session's converted copy). Waits poll conditions with deadlines; every process is stopped
however the module ends. The link-cut chaos scenario needs nodes inside network namespaces
and plays on two of its own (tests/chaos/test_chaos.py).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from exo.api.serving.failover import FAILOVER_DEADLINE_SECONDS
from exo.testing.processes import ExoNode, wait_until
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_checkout
from tests.chaos import scenarios
from tests.chaos.harness import Row
from tests.test_cluster import FORM_TIMEOUT_SECONDS, make_cluster, place_on, running, same_master

KILL_AFTER_CHUNKS = 5
# 100 steps of 0.1 s: every stream reaches its fifth chunk within a second or two of the
# first, so the kill lands with most of each answer still to come.
DECODE_STEP_SECONDS = 0.1
REPLY = " ".join(f"w{1 + index % 60}" for index in range(100))
STREAMS = 5
# Ten streams at once on C after the failover (its five pinned ones and the five moved).
MAX_CONCURRENT_REQUESTS = 2 * STREAMS
PROMPT = "w0 w7 w9"
PLAIN_TEMPLATE = "{% for message in messages %}{{ message.content }} {% endfor %}"
READY_SECONDS = 120.0
CLIENT_TIMEOUT_SECONDS = 90.0
# A node started again: its API, then the cluster agreeing on it (master and membership).
REJOIN_SECONDS = 120.0
# The chaos scenarios' own deadlines (a model loading, a recovery) reach past the default
# per-test timeout on a loaded machine.
CHAOS_TIMEOUT = pytest.mark.timeout(1800)


@dataclass
class Cluster:
    a: ExoNode
    b: ExoNode
    c: ExoNode
    model_id: str

    @property
    def nodes(self) -> list[ExoNode]:
        return [self.a, self.b, self.c]

    def instances(self) -> dict[str, set[str]]:
        """The failover model's instances and the nodes each runs on."""
        return {
            instance_id: set(instance["shard_assignments"]["node_to_runner"])
            for instance_id, instance in self.a.state()["instances"].items()
            if instance["shard_assignments"]["model_id"] == self.model_id
        }

    def place(self, node: ExoNode) -> str:
        """Place an instance of the failover model on `node` alone; its id."""
        response = httpx.post(
            f"{self.a.url}/place_instance",
            json={"model_id": self.model_id, "node_ids": [node.node_id()]},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        instance_id: str = response.json()["instance_id"]
        return instance_id

    def on(self, node: ExoNode) -> str:
        """The id of the failover model's instance on `node`."""
        node_id = node.node_id()
        return next(iter(i for i, nodes in self.instances().items() if nodes == {node_id}))

    def delete(self, instance_ids: list[str], via: ExoNode | None = None) -> None:
        api = via or self.a
        for instance_id in instance_ids:
            response = httpx.delete(f"{api.url}/instance/{instance_id}", timeout=60)
            assert response.status_code in (200, 404), response.text
        wait_until(
            lambda: not set(instance_ids) & set(api.state()["instances"]), 60, what="deleted"
        )

    def unfinished_tasks(self, instance_id: str) -> int:
        return sum(
            1
            for task in self.a.state()["tasks"].values()
            if task["status"]["kind"] in ("TaskPending", "TaskRunning")
            and task["instance_id"] == instance_id
        )

    def require(self, *needed: ExoNode, down: tuple[ExoNode, ...] = ()) -> None:
        """Exactly `needed` (and any other node already running, unless in `down`) up and
        agreeing on one master that counts them all, with no instance of any model: starts
        again every needed node an earlier scenario killed (same home, ports and node id;
        it rejoins through A unless A is the one started again), stops those in `down`, then
        deletes every instance and waits until the runners are gone."""
        for node in down:
            if alive(node):
                node.stop()
        dead = [node for node in needed if not alive(node)]
        for node in dead:
            node.launch()
        for node in dead:
            node.wait_api()
        up = [node for node in self.nodes if alive(node)]
        ids = {node.node_id() for node in up}

        def formed() -> bool:
            master = same_master(up)
            return master in ids and all(ids <= set(n.state()["node_info"]) for n in up)

        wait_until(formed, REJOIN_SECONDS, 0.2, what=f"{len(up)} nodes under one master")
        self.delete(list(up[0].state()["instances"]), via=up[0])
        wait_until(
            lambda: not any(node.runner_processes() for node in up), 60, what="no runners left"
        )


def alive(node: ExoNode) -> bool:
    return node.process is not None and node.process.poll() is None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, shared_models_dir: Path) -> Iterator[Cluster]:
    """Three nodes on the session's models directory (the default model converted), the
    failover's scripted model added by its path; no instance placed."""
    root = tmp_path_factory.mktemp("failover")
    model_dir = save_tiny_checkout(root / "scripted", chat_template=PLAIN_TEMPLATE)
    mark_model_dir(model_dir, decode_step_seconds=DECODE_STEP_SECONDS, replies=[("w0", REPLY)])
    # Ten streams from this one client at once through A.
    api_args = ("--force-master", "--max-generations-per-client", str(2 * STREAMS))
    nodes = make_cluster(root, shared_models_dir, 3, first_args=api_args)
    for node in nodes[1:]:
        node.extra_args += ("--max-concurrent-requests", str(MAX_CONCURRENT_REQUESTS))
    with running(nodes):
        a, b, c = nodes
        wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        added = httpx.post(f"{a.url}/models/add", json={"model_id": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        yield Cluster(a, b, c, added.json()["model_id"])


def report(row: Row) -> None:
    print(row.as_dict())
    assert row.recovery_s is not None


@CHAOS_TIMEOUT
def test_runner_killed_mid_stream(cluster: Cluster) -> None:
    """Chaos: `scenarios.kill_runner_mid_stream` on C, the default model's only instance."""
    cluster.require(*cluster.nodes)
    instance = place_on(cluster.a, cluster.c.node_id())
    wait_until(lambda: cluster.c.serving(instance), scenarios.READY_SECONDS, 0.5, what="ready on C")
    report(scenarios.kill_runner_mid_stream(cluster.c))


@dataclass
class Stream:
    """One client streaming on a thread: `read` returns the answer's text, calling
    `chunk()` at each chunk it reads."""

    name: str
    read: Callable[[Stream], str]
    chunks: int = 0
    done: bool = False
    text: str | None = None
    error: BaseException | None = None

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        return thread

    def chunk(self) -> None:
        self.chunks += 1

    def _run(self) -> None:
        try:
            self.text = self.read(self)
        except BaseException as error:
            self.error = error
        finally:
            self.done = True


def messages() -> Any:  # the SDKs' typed params
    return [{"role": "user", "content": PROMPT}]


def pinned(cluster: Cluster, instance_id: str) -> Callable[[Stream], str]:
    """A stream that runs on `instance_id` only (read to its end, whatever it says)."""

    def read(stream: Stream) -> str:
        body = {"model": cluster.model_id, "messages": messages(), "stream": True}
        with httpx.stream(
            "POST", f"{cluster.a.url}/v1/chat/completions", json=body,
            headers={"X-Exo-Instance": instance_id}, timeout=CLIENT_TIMEOUT_SECONDS,
        ) as response:  # fmt: skip
            return "".join(chat_text([event]) for event in sse_data(response, stream))

    return read


def sse_data(response: httpx.Response, stream: Stream) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event: dict[str, Any] = json.loads(line.removeprefix("data: "))
            stream.chunk()
            yield event


def chat_text(events: list[dict[str, Any]]) -> str:
    return "".join(
        event["choices"][0]["delta"].get("content") or ""
        for event in events
        if event.get("choices")
    )


def raw_chat(cluster: Cluster) -> Callable[[Stream], str]:
    def read(stream: Stream) -> str:
        body = {
            "model": cluster.model_id,
            "messages": messages(),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream(
            "POST", f"{cluster.a.url}/v1/chat/completions", json=body,
            timeout=CLIENT_TIMEOUT_SECONDS,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            events = list(sse_data(response, stream))
        assert not [event for event in events if "error" in event], events[-1]
        (usage,) = [event["usage"] for event in events if event.get("usage")]
        assert usage["completion_tokens"] == len(REPLY.split())
        assert len({event["id"] for event in events}) == 1
        return chat_text(events)

    return read


def sdk_chat(cluster: Cluster) -> Callable[[Stream], str]:
    def read(stream: Stream) -> str:
        client = openai.OpenAI(
            base_url=f"{cluster.a.url}/v1", api_key="x", max_retries=0,
            timeout=CLIENT_TIMEOUT_SECONDS,
        )  # fmt: skip
        text = ""
        for event in client.chat.completions.create(
            model=cluster.model_id, messages=messages(), stream=True
        ):
            if event.choices:
                text += event.choices[0].delta.content or ""
            stream.chunk()
        return text

    return read


def sdk_responses(cluster: Cluster) -> Callable[[Stream], str]:
    def read(stream: Stream) -> str:
        client = openai.OpenAI(
            base_url=f"{cluster.a.url}/v1", api_key="x", max_retries=0,
            timeout=CLIENT_TIMEOUT_SECONDS,
        )  # fmt: skip
        events = []
        for event in client.responses.create(model=cluster.model_id, input=PROMPT, stream=True):
            events.append(event)
            stream.chunk()
        assert events[-1].type == "response.completed", events[-1]
        numbers = [event.sequence_number for event in events]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        deltas = [event for event in events if event.type == "response.output_text.delta"]
        assert {(event.item_id, event.output_index) for event in deltas} == {
            (deltas[0].item_id, deltas[0].output_index)
        }
        usage = events[-1].response.usage
        assert usage is not None and usage.output_tokens == len(REPLY.split())
        assert "".join(event.delta for event in deltas) == events[-1].response.output_text
        return events[-1].response.output_text

    return read


def sdk_claude(cluster: Cluster) -> Callable[[Stream], str]:
    def read(stream: Stream) -> str:
        client = anthropic.Anthropic(
            base_url=cluster.a.url, api_key="x", max_retries=0, timeout=CLIENT_TIMEOUT_SECONDS
        )
        with client.messages.stream(
            model=cluster.model_id, max_tokens=400, messages=messages()
        ) as claude_stream:
            kinds = []
            for event in claude_stream:
                kinds.append(event.type)
                stream.chunk()
            message = claude_stream.get_final_message()
        assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
        assert message.usage.output_tokens == len(REPLY.split())
        return "".join(block.text for block in message.content if block.type == "text")

    return read


def raw_ollama(cluster: Cluster) -> Callable[[Stream], str]:
    def read(stream: Stream) -> str:
        with httpx.stream(
            "POST", f"{cluster.a.url}/ollama/api/chat",
            json={"model": cluster.model_id, "messages": messages()},
            timeout=CLIENT_TIMEOUT_SECONDS,
        ) as response:  # fmt: skip
            assert response.status_code == 200
            lines = []
            for line in response.iter_lines():
                if line:
                    lines.append(json.loads(line))
                    stream.chunk()
        assert not [line for line in lines if "error" in line], lines[-1]
        assert [line["done"] for line in lines].count(True) == 1
        assert lines[-1]["eval_count"] == len(REPLY.split())
        return "".join(line["message"]["content"] for line in lines)

    return read


def test_every_dialect_gets_one_unbroken_answer_after_its_node_is_killed(
    cluster: Cluster,
) -> None:
    cluster.require(*cluster.nodes)
    placed = [cluster.place(cluster.b), cluster.place(cluster.c)]  # loading side by side
    for instance_id in placed:
        wait_until(lambda i=instance_id: cluster.a.serving(i), READY_SECONDS, 0.2, what="serving")  # type: ignore[misc]
    on_b, on_c = cluster.on(cluster.b), cluster.on(cluster.c)
    busy = [Stream(f"pinned to C {index}", pinned(cluster, on_c)) for index in range(STREAMS)]
    streams = [
        Stream(name, make(cluster))
        for name, make in (
            ("chat raw SSE", raw_chat),
            ("chat openai SDK", sdk_chat),
            ("responses openai SDK", sdk_responses),
            ("claude anthropic SDK", sdk_claude),
            ("ollama NDJSON", raw_ollama),
        )
    ]
    threads = [stream.start() for stream in busy]
    try:
        wait_until(lambda: cluster.unfinished_tasks(on_c) == STREAMS, 30, 0.05, what="C busy")
        # The least busy instance takes each new request: B, five times.
        threads += [stream.start() for stream in streams]
        wait_until(lambda: cluster.unfinished_tasks(on_b) == STREAMS, 30, 0.05, what="five on B")
        wait_until(
            lambda: all(stream.chunks >= KILL_AFTER_CHUNKS for stream in streams),
            CLIENT_TIMEOUT_SECONDS,
            0.02,
            what=f"{KILL_AFTER_CHUNKS} chunks on every stream",
        )
        ended = [(stream.name, stream.chunks, stream.error) for stream in streams if stream.done]
        assert not ended, f"streams ended before the kill: {ended}"
        cluster.b.kill()
        print(f"B killed with {[stream.chunks for stream in streams]} chunks read")
    finally:
        for thread in threads:
            thread.join(timeout=CLIENT_TIMEOUT_SECONDS + 10)
    assert not any(thread.is_alive() for thread in threads), "a stream never ended"
    for stream in streams:
        assert stream.error is None, (stream.name, stream.error)
        assert stream.text is not None and stream.text.split() == REPLY.split(), (
            stream.name,
            stream.text,
        )


def test_with_no_healthy_instance_the_stream_ends_with_the_dialects_error(
    cluster: Cluster,
) -> None:
    """After the first case: B is gone and its instance placed again on A or C; only C's
    node may serve the stream (A's instance, if any, is deleted: A is the API node)."""
    a_id, c_id = cluster.a.node_id(), cluster.c.node_id()
    cluster.delete([i for i, nodes in cluster.instances().items() if a_id in nodes])
    wait_until(
        lambda: any(cluster.a.serving(i) for i in cluster.instances()), READY_SECONDS, 0.2,
        what="an instance on C serving",
    )  # fmt: skip
    assert all(nodes == {c_id} for nodes in cluster.instances().values())
    events: list[dict[str, Any]] = []
    stream = Stream("chat", lambda stream: "")
    body = {"model": cluster.model_id, "messages": messages(), "stream": True}
    with httpx.stream(
        "POST", f"{cluster.a.url}/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_SECONDS
    ) as response:
        assert response.status_code == 200
        for event in sse_data(response, stream):
            events.append(event)
            if stream.chunks == KILL_AFTER_CHUNKS:
                # C goes with the only instance, which is not placed again.
                cluster.c.kill()
                cluster.delete(list(cluster.instances()))
                lost_at = time.monotonic()
        ended = time.monotonic()
    assert stream.chunks > KILL_AFTER_CHUNKS, "the stream ended before C was killed"
    assert ended - lost_at < FAILOVER_DEADLINE_SECONDS + 10
    assert "error" in events[-1], events[-1]
    text = chat_text(events)
    assert REPLY.startswith(text.strip()) and len(text.split()) >= KILL_AFTER_CHUNKS - 2


@CHAOS_TIMEOUT
def test_pipeline_rank_node_killed(cluster: Cluster) -> None:
    """Chaos: `scenarios.kill_pipeline_rank_node` with A and B alone, the two-node case (B,
    killed by the failover test, started again first; C stays down as the failover tests
    left it, or is stopped when this test runs alone), so the instance is placed again on
    A."""
    cluster.require(cluster.a, cluster.b, down=(cluster.c,))
    report(scenarios.kill_pipeline_rank_node(cluster.a, cluster.b))


@CHAOS_TIMEOUT
def test_master_killed_mid_stream(cluster: Cluster) -> None:
    """Chaos: `scenarios.kill_master_mid_stream` with A (the master) and C (started again
    first), B down as the pipeline test left it (stopped, when this test runs alone): the
    two-node case, so C is the one to be elected. Last: it leaves the cluster without its
    master."""
    cluster.require(cluster.a, cluster.c, down=(cluster.b,))
    report(scenarios.kill_master_mid_stream(cluster.a, cluster.c))
