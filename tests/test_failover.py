"""Mid-stream failover on three real `exo` processes on loopback: the node of a streaming
instance is killed after every client got at least `KILL_AFTER_CHUNKS` chunks, a second
instance of the model is healthy on another node, and each client — raw SSE and the
openai SDK on Chat Completions, the openai SDK on Responses, the anthropic SDK on Claude
Messages, raw NDJSON on Ollama — gets one unbroken answer: the scripted text, each word
once, with the usage of the original request. With no healthy instance left a stream ends
with the dialect's in-band error, within the failover's deadline.

One cluster (A: master and API node; B, C) serves both cases. The five streams of the first
run at once on B's instance (the model's only one when they start); C's is placed while
they stream, then B is killed. The model is a tiny random one whose answer the engine's
test seam scripts (`exo.testing.seam`) and streams one token per `DECODE_STEP_SECONDS`, so
the kill lands mid-stream whatever this machine's speed, and the text is known. Waits have
deadlines; every process is stopped however the module ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest

from exo.api.serving.failover import FAILOVER_DEADLINE_SECONDS
from exo.testing.processes import ExoNode, wait_until
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_checkout
from tests.test_cluster import FORM_TIMEOUT_SECONDS, make_cluster, running, same_master

KILL_AFTER_CHUNKS = 5
# Five streams of 200 steps: 40 s, of which placing C's instance while they run takes about
# 13 s on this 2-core machine when it is busy (12.6 s measured on 2026-12-06).
DECODE_STEP_SECONDS = 0.2
REPLY = " ".join(f"w{1 + index % 60}" for index in range(200))
PROMPT = "w0 w7 w9"
PLAIN_TEMPLATE = "{% for message in messages %}{{ message.content }} {% endfor %}"
READY_SECONDS = 120.0
CLIENT_TIMEOUT_SECONDS = 90.0


@dataclass
class Cluster:
    a: ExoNode
    b: ExoNode
    c: ExoNode
    model_id: str

    def instances(self) -> dict[str, set[str]]:
        """The model's instances and the nodes each runs on."""
        return {
            instance_id: set(instance["shard_assignments"]["node_to_runner"])
            for instance_id, instance in self.a.state()["instances"].items()
            if instance["shard_assignments"]["model_id"] == self.model_id
        }

    def place_and_wait(self, node: ExoNode) -> str:
        """Place an instance on `node` alone and wait until it serves; its id."""
        response = httpx.post(
            f"{self.a.url}/place_instance",
            json={"model_id": self.model_id, "node_ids": [node.node_id()]},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        instance_id: str = response.json()["instance_id"]
        wait_until(lambda: self.a.serving(instance_id), READY_SECONDS, 0.2, what="serving")
        return instance_id

    def delete_all(self) -> None:
        for instance_id in self.instances():
            response = httpx.delete(f"{self.a.url}/instance/{instance_id}", timeout=60)
            assert response.status_code in (200, 404), response.text
        wait_until(lambda: not self.instances(), 60, what="no instance left")

    def unfinished_tasks(self) -> list[dict[str, Any]]:
        return [
            task
            for task in self.a.state()["tasks"].values()
            if task["status"]["kind"] in ("TaskPending", "TaskRunning")
        ]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("failover")
    model_dir = save_tiny_checkout(root / "models" / "scripted", chat_template=PLAIN_TEMPLATE)
    mark_model_dir(model_dir, decode_step_seconds=DECODE_STEP_SECONDS, replies=[("w0", REPLY)])
    nodes = make_cluster(root, root / "models", 3, first_args=("--force-master",))
    with running(nodes):
        a, b, c = nodes
        wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        added = httpx.post(f"{a.url}/models/add", json={"model_id": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        yield Cluster(a, b, c, added.json()["model_id"])


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
    cluster.delete_all()
    on_b = cluster.place_and_wait(cluster.b)
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
    threads = [stream.start() for stream in streams]
    try:
        # All five run on B's instance (the only one), then C's joins as a healthy one.
        wait_until(
            lambda: (
                len(cluster.unfinished_tasks()) == len(streams)
                and all(task["instance_id"] == on_b for task in cluster.unfinished_tasks())
            ),
            CLIENT_TIMEOUT_SECONDS,
            0.1,
            what="every stream running on B",
        )
        placing = time.monotonic()
        cluster.place_and_wait(cluster.c)
        print(f"C's instance served {time.monotonic() - placing:.1f} s after it was placed")
        wait_until(
            lambda: all(stream.chunks >= KILL_AFTER_CHUNKS for stream in streams),
            CLIENT_TIMEOUT_SECONDS,
            0.05,
            what=f"{KILL_AFTER_CHUNKS} chunks on every stream",
        )
        ended = [(stream.name, stream.chunks, stream.error) for stream in streams if stream.done]
        assert not ended, f"streams ended before the kill: {ended}"
        cluster.b.kill()
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
    cluster.delete_all()
    cluster.place_and_wait(cluster.c)
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
                cluster.delete_all()
                lost_at = time.monotonic()
        ended = time.monotonic()
    assert stream.chunks > KILL_AFTER_CHUNKS, "the stream ended before C was killed"
    assert ended - lost_at < FAILOVER_DEADLINE_SECONDS + 10
    assert "error" in events[-1], events[-1]
    text = chat_text(events)
    assert REPLY.startswith(text.strip()) and len(text.split()) >= KILL_AFTER_CHUNKS - 2
