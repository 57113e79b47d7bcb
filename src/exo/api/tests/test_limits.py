"""Limits on hostile clients (`exo.api.guards.limits`) against a real uvicorn server: body size,
slowloris headers, a stalled body, generations per client, and the rate limit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import pytest
from starlette.testclient import TestClient

from exo.api.guards.auth import ApiAuth
from exo.api.guards.limits import ApiLimits, RateLimiter
from exo.api.security import ApiSecurity
from exo.api.tests.serving import scripted_app, serving
from exo.shared.types.chunks import Chunk, TokenChunk, Usage
from exo.shared.types.common import CommandId
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

CHAT = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}
DEADLINE_SECONDS = 20.0


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send `data` on a new connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        connection.sendall(data)
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            part = connection.recv(65536)
            if not part:
                break
            received += part
        return received


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_oversized_bodies_get_413_and_the_node_keeps_serving() -> None:
    limit = 64 * 1024
    limits = ApiLimits(max_body_bytes=limit)
    app = scripted_app(ScriptedCluster(), ApiSecurity(limits=limits))
    with serving(app, limits) as (url, port):
        # A declared length past the limit: refused before any of the body is read.
        declared = raw_exchange(
            port,
            b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {limit * 100}\r\n\r\n".encode(),
        )
        assert status_of(declared) == 413
        assert b'"request_too_large"' in declared  # Anthropic's shape under /v1/messages
        # No length at all (chunked): counted while it streams in.
        piece = b"x" * 4096
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(limit // 4096 + 1))
        streamed = raw_exchange(
            port,
            b"POST /ollama/api/chat HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunks,
        )
        assert status_of(streamed) == 413
        assert b'{"error":"the request body is larger' in streamed  # Ollama's shape
        # Under the limit, and afterwards: served.
        served = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=10)
        assert served.status_code == 200
        assert served.json()["choices"][0]["message"]["content"] == SCRIPTED_ANSWER


def test_a_slowloris_is_cut_after_the_header_timeout_while_others_are_served() -> None:
    limits = ApiLimits(header_timeout_seconds=1.0)
    app = scripted_app(ScriptedCluster(), ApiSecurity(limits=limits))
    request = b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 200 + b"\r\n\r\n"
    with serving(app, limits) as (url, port):
        connection = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            started = time.monotonic()
            sent = 0
            closed_after: float | None = None
            # One byte every 50 ms: the headers would take 11 s to arrive.
            while sent < len(request) and time.monotonic() - started < 8:
                try:
                    connection.sendall(request[sent : sent + 1])
                except OSError:
                    closed_after = time.monotonic() - started
                    break
                sent += 1
                if sent == 5:  # meanwhile another client is served at once
                    assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
                connection.settimeout(0.05)
                try:
                    answer = connection.recv(4096)
                except TimeoutError:
                    continue
                closed_after = time.monotonic() - started
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408")
                break
        finally:
            connection.close()
        assert closed_after is not None, "the trickling connection was never cut"
        assert 0.9 <= closed_after < 4.0
        assert sent < len(request)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200


def test_a_stalled_body_gets_408() -> None:
    limits = ApiLimits(body_timeout_seconds=0.5)
    app = scripted_app(ScriptedCluster(), ApiSecurity(limits=limits))
    with serving(app, limits) as (_, port):
        started = time.monotonic()
        answer = raw_exchange(
            port,
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
        )
        assert status_of(answer) == 408
        assert time.monotonic() - started < 5


class HeldCluster(ScriptedCluster):
    """Streamed generations send one token, then wait until `release` is set (at most
    `DEADLINE_SECONDS`) before finishing; other generations finish at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.held = 0

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        (command,) = [item for item in self.submitted if item.command_id == command_id]
        model = command.params.model
        if command.params.stream:
            self.held += 1
            yield TokenChunk(command_id=command_id, model=model, text="Hi", token_ids=(1,))
            with anyio.move_on_after(DEADLINE_SECONDS):
                while not self.release.is_set():
                    await anyio.sleep(0.02)
        yield TokenChunk(
            command_id=command_id,
            model=model,
            text=SCRIPTED_ANSWER,
            token_ids=(2,),
            finish_reason="stop",
            usage=Usage(prompt_tokens=5, completion_tokens=2),
        )


@pytest.fixture
def held() -> Iterator[tuple[HeldCluster, str]]:
    cluster = HeldCluster()
    auth = ApiAuth("keys", ("key-greedy-client", "key-second-client"))
    limits = ApiLimits(max_generations_per_client=2)
    app = scripted_app(cluster, ApiSecurity(auth=auth, limits=limits))
    with serving(app, limits) as (url, _):
        try:
            yield cluster, url
        finally:
            cluster.release.set()


def test_one_client_with_many_streams_cannot_stop_another(held: tuple[HeldCluster, str]) -> None:
    """The greedy client's streams never finish while the second client asks; without the
    per-client cap, its five streams would fill the model's admission limit here (a batch of
    one plus a queue of four) and the second client would wait, then get a 503."""
    cluster, url = held
    greedy = {"Authorization": "Bearer key-greedy-client"}

    def open_stream() -> int:
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={**CHAT, "stream": True},
            headers=greedy,
            timeout=DEADLINE_SECONDS + 10,
        ) as response:
            for _ in response.iter_bytes():
                pass
            return response.status_code

    with ThreadPoolExecutor(max_workers=5) as pool:
        streams = [pool.submit(open_stream) for _ in range(5)]
        deadline = time.monotonic() + DEADLINE_SECONDS
        while sum(stream.done() for stream in streams) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        # Two streams held open; the other three refused at once, with Retry-After.
        assert cluster.held == 2
        refused = [stream.result() for stream in streams if stream.done()]
        assert refused == [429, 429, 429]
        second = httpx.post(
            f"{url}/v1/chat/completions",
            json=CHAT,
            headers={"x-api-key": "key-second-client"},
            timeout=10,
        )
        assert second.status_code == 200
        assert second.json()["choices"][0]["message"]["content"] == SCRIPTED_ANSWER
        assert not all(stream.done() for stream in streams)  # still held meanwhile
        third = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=greedy, timeout=10)
        assert third.status_code == 429
        assert third.headers["retry-after"].isdigit()
        assert third.json()["error"]["type"] == "rate_limit_error"
        cluster.release.set()
        statuses = sorted(stream.result(timeout=DEADLINE_SECONDS) for stream in streams)
    assert statuses == [200, 200, 429, 429, 429]
    # Their places were given back: the first client may start again.
    again = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=greedy, timeout=10)
    assert again.status_code == 200


def test_rate_limit_answers_429_with_retry_after() -> None:
    now = [0.0]
    limiter = RateLimiter(per_minute=2, clock=lambda: now[0])
    assert limiter.take("a") is None and limiter.take("a") is None
    wait = limiter.take("a")
    assert wait is not None and 29 < wait <= 30  # one request every 30 s
    assert limiter.take("b") is None  # per client
    now[0] = 30.0
    assert limiter.take("a") is None

    limits = ApiLimits(rate_limit_per_minute=2)
    app = scripted_app(
        ScriptedCluster(), ApiSecurity(auth=ApiAuth("keys", ("k-1",)), limits=limits)
    )
    client = TestClient(app)
    headers = {"x-api-key": "k-1"}
    assert [client.get("/v1/models", headers=headers).status_code for _ in range(2)] == [200, 200]
    refused = client.post("/v1/messages", headers=headers, json={})
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"  # Anthropic's shape
    assert client.get("/").status_code == 200  # the page is not counted


def test_rate_limit_leaves_operators_reads_alone() -> None:
    """With the bucket empty, a Prometheus scrape and the dashboard's polls still answer
    (they need the key all the same); the inference API stays refused."""
    limits = ApiLimits(rate_limit_per_minute=1)
    app = scripted_app(
        ScriptedCluster(), ApiSecurity(auth=ApiAuth("keys", ("k-1",)), limits=limits)
    )
    client = TestClient(app)
    headers = {"x-api-key": "k-1"}
    assert client.get("/v1/models", headers=headers).status_code == 200
    assert client.get("/v1/models", headers=headers).status_code == 429
    for _ in range(3):
        for path in ("/metrics", "/state", "/node_id"):  # the scripted app has no /cluster
            assert client.get(path, headers=headers).status_code == 200, path
    assert client.get("/metrics").status_code == 401  # not counted, still behind the key
    assert client.post("/v1/chat/completions", headers=headers, json={}).status_code == 429
