"""A stream survives its node restarting quickly, on a cluster of two real `exo` processes
on loopback (A: master and API node; B): the model's only instance runs on B, which holds
its files; A does not and cannot get them soon (the loopback Hub stalls every file A asks
for, as a large download would). A stream through A is running when B is SIGKILLed and
started again at once (same home, so the same node id, and its files still there).

Was (a new user's trial): the master placed the instance again on A, the only node left,
where it waited for its download; B came back seconds later but was not used for the
instance, and the failover's 30 s bound ran out: the client got the error although B
could serve again within seconds. Now the master places the instance again where fewer
nodes must fetch the files once B is back (`master.recovery.replacements_nearer_files`),
and the stream goes on there: the client gets the scripted answer whole.

The model is a tiny random one whose answer the engine's test seam scripts
(`exo.testing.seam`), one token per `DECODE_STEP_SECONDS`, so the kill lands mid-stream
whatever this machine's speed, and the text is known. Waits poll conditions with
deadlines; both nodes and the Hub stand-in stop however the test ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from starlette.responses import Response, StreamingResponse

from exo.testing.hf_file_serving import FileRequest
from exo.testing.hf_server import HubServer
from exo.testing.processes import ExoNode, wait_until
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_checkout
from tests.test_cluster import running, same_master

REPO = "someone/tiny-restart"
DIRECTORY = "someone--tiny-restart"
DECODE_STEP_SECONDS = 0.1
REPLY = " ".join(f"w{1 + index % 60}" for index in range(100))
PROMPT = "w0 w7 w9"
PLAIN_TEMPLATE = "{% for message in messages %}{{ message.content }} {% endfor %}"
KILL_AFTER_CHUNKS = 5
FORM_SECONDS = 120.0
READY_SECONDS = 180.0
# The client's read timeout: past the failover's bounds, so the server's answer decides.
CLIENT_TIMEOUT_SECONDS = 200.0
# How long the Hub stand-in holds a stalled file before cutting it (the test's own bound).
STALL_SECONDS = 300.0


class StalledFiles:
    """A Hub hook that holds every GET of `REPO`'s files open, sending nothing, until
    `release` is set (or `STALL_SECONDS` pass), then cuts the transfer."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.asked = 0

    def __call__(self, file_request: FileRequest) -> Response | None:
        if file_request.method != "GET" or file_request.repository.repo_id != REPO:
            return None
        self.asked += 1
        release = self.release

        async def nothing() -> AsyncIterator[bytes]:
            until = time.monotonic() + STALL_SECONDS
            while not release.is_set() and time.monotonic() < until:
                await anyio.sleep(0.2)
            raise ConnectionAbortedError("the Hub test server cut a stalled transfer")
            yield b""  # an async generator

        size = str(len(file_request.file.data))
        return StreamingResponse(nothing(), headers={"Content-Length": size})


def completed(node: ExoNode, of: ExoNode) -> bool:
    status = node.state()["downloads"].get(of.node_id(), {}).get(REPO)
    return status is not None and status["kind"] == "DownloadCompleted"


def serving(node: ExoNode, instance_id: str) -> bool:
    return node.serving(instance_id) is not None


def milestones(
    a: ExoNode, b: ExoNode, b_id: str, instance_id: str, stream: ChatStream, since: float
) -> dict[str, float]:
    """Seconds from `since` until the instance was placed away from B, B's API answered
    again, the instance was placed on B again and it served, watched while the stream runs
    (at most `CLIENT_TIMEOUT_SECONDS`); for the printed account of a recovery, never
    asserted on."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + CLIENT_TIMEOUT_SECONDS
    while stream.thread.is_alive() and time.monotonic() < deadline and len(seen) < 4:
        now = time.monotonic() - since
        try:
            if "B's API" not in seen and b.node_id() == b_id:
                seen["B's API"] = now
        except httpx.HTTPError:
            pass
        try:
            state = a.state()
            nodes = set(state["instances"][instance_id]["shard_assignments"]["node_to_runner"])
            served = "on B again" in seen and a.serving(instance_id) is not None
        except (httpx.HTTPError, KeyError):
            nodes, served = set(), False
        if "away from B" not in seen and nodes and nodes != {b_id}:
            seen["away from B"] = now
        if "away from B" in seen and "on B again" not in seen and nodes == {b_id}:
            seen["on B again"] = now
        if served and "serving" not in seen:
            seen["serving"] = now
        time.sleep(0.2)
    return {name: round(value, 1) for name, value in seen.items()}


class ChatStream:
    """A raw SSE chat through `node` on a thread: its chunks' text and arrival times."""

    def __init__(self, node: ExoNode, model_id: str) -> None:
        self.url = f"{node.url}/v1/chat/completions"
        self.body = {
            "model": model_id,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
        }
        self.events: list[dict[str, Any]] = []
        self.arrivals: list[float] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.url, json=self.body, timeout=CLIENT_TIMEOUT_SECONDS
            ) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line.removeprefix("data: ")))
                        self.arrivals.append(time.monotonic())
        except BaseException as error:
            self.error = error

    def text(self) -> str:
        return "".join(
            event["choices"][0]["delta"].get("content") or ""
            for event in self.events
            if event.get("choices")
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_stream_goes_on_when_its_node_restarts_quickly(tmp_path: Path) -> None:
    checkout = save_tiny_checkout(tmp_path / "checkout", chat_template=PLAIN_TEMPLATE)
    stall = StalledFiles()
    with HubServer() as hub:
        hub.add_directory(REPO, checkout)
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        }
        a = ExoNode(
            tmp_path / "a", tmp_path / "a-models", ("--no-default-model", "--force-master"), env=env
        )
        b = ExoNode(
            tmp_path / "b", tmp_path / "b-models", ("--no-default-model",), env=env,
            namespace=a.namespace, bootstrap=(a,),
        )  # fmt: skip
        with running([a, b]):
            try:
                nodes = [a, b]
                wait_until(
                    lambda: same_master(nodes) and len(b.state()["node_info"]) == 2,
                    FORM_SECONDS,
                    what="one cluster of two",
                )
                added = httpx.post(f"{a.url}/models/add", json={"model_id": REPO}, timeout=60)
                assert added.status_code == 200, added.text
                model_id: str = added.json()["model_id"]
                started = httpx.post(
                    f"{a.url}/download/start",
                    json={"model": model_id, "node_id": b.node_id()},
                    timeout=30,
                )
                assert started.status_code == 200, started.text
                wait_until(lambda: completed(a, b), READY_SECONDS, what="B's copy")
                mark_model_dir(
                    tmp_path / "b-models" / DIRECTORY,
                    decode_step_seconds=DECODE_STEP_SECONDS,
                    replies=[("w0", REPLY)],
                )
                hub.hooks.append(stall)  # from now on A cannot get the files soon
                placed = httpx.post(
                    f"{a.url}/place_instance",
                    json={"model_id": model_id, "node_ids": [b.node_id()]},
                    timeout=60,
                )
                assert placed.status_code == 200, placed.text
                instance_id = placed.json()["instance_id"]
                wait_until(lambda: serving(a, instance_id), READY_SECONDS, 0.2, what="B serving")

                stream = ChatStream(a, model_id)
                stream.thread.start()
                wait_until(
                    lambda: len(stream.events) >= KILL_AFTER_CHUNKS or stream.error,
                    CLIENT_TIMEOUT_SECONDS,
                    0.02,
                    what=f"{KILL_AFTER_CHUNKS} chunks",
                )
                assert stream.thread.is_alive(), (stream.error, stream.events[-1:])
                b_id = b.node_id()
                b.kill()
                killed_at = time.monotonic()
                b.launch()  # at once: same home, ports and node id, its files still there
                seen = milestones(a, b, b_id, instance_id, stream, killed_at)
                stream.thread.join(CLIENT_TIMEOUT_SECONDS + 10)
                assert not stream.thread.is_alive(), "the stream never ended"
                after = [at - killed_at for at in stream.arrivals if at > killed_at]
                print(
                    f"B killed after {KILL_AFTER_CHUNKS}+ chunks; seconds after the kill: "
                    f"{seen}, the next chunk {after[0] if after else float('nan'):.1f}, "
                    f"the stream's end {time.monotonic() - killed_at:.1f}; "
                    f"A asked the Hub for {stall.asked} stalled file(s)"
                )
                assert stream.error is None, stream.error
                assert not [e for e in stream.events if "error" in e], stream.events[-1]
                assert stream.text().split() == REPLY.split(), stream.text()
                # The instance went back to B, whose files were there.
                wait_until(lambda: serving(a, instance_id), READY_SECONDS, 0.2, what="serving")
                nodes_now = a.state()["instances"][instance_id]["shard_assignments"]
                assert set(nodes_now["node_to_runner"]) == {b.node_id()}
            finally:
                stall.release.set()  # before the nodes stop: A's download ends
