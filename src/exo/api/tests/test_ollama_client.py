"""The official `ollama` client (and `openai` on `/ollama/v1`, and curl-style bodies)
against the real app over a scripted cluster."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, cast

import httpx
import ollama
import openai
import pytest
import uvicorn

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient, LoadOnRequest
from exo.api.serving.load_wait import ReadyTimes
from exo.api.serving.node_stop import NodeStop
from exo.api.tests.ollama_builders import error_chunk, finish, token, tool_calls
from exo.api.wire.images import ImagePolicy
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import Command, GenerateText
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.state import State
from exo.testing.builders import SMOLLM2, make_instance, smollm2_card


class ScriptedCluster:
    """Just enough of ClusterClient for the routes: one node holding a placed SmolLM2, and
    every generation answered with `script`."""

    def __init__(self) -> None:
        self.node_id = NodeId("node-a")
        self.cards = {SMOLLM2: smollm2_card()}
        instance = make_instance(self.node_id)
        self.state = State(instances={instance.instance_id: instance})
        self.script: list[Chunk] = []
        self.submitted: list[GenerateText] = []
        self.load_on_request = LoadOnRequest()
        self.ready_times = ReadyTimes()  # none seen ready: `load_duration` is measured
        self.stop = NodeStop()
        self.image_policy = ImagePolicy()

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        return True  # the state is what the test set

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            for chunk in self.script:
                yield chunk

        yield chunks()

    async def submit(self, command: Command) -> None:
        assert isinstance(command, GenerateText)
        self.submitted.append(command)

    def send_and_forget(self, command: Command) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedCluster]]:
    cluster = ScriptedCluster()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    app = create_app(cast(ClusterClient, cluster))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", cluster
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        listener.close()


@pytest.fixture
def client(server: tuple[str, ScriptedCluster]) -> ollama.Client:
    return ollama.Client(host=f"{server[0]}/ollama", timeout=10)


@pytest.fixture
def cluster(server: tuple[str, ScriptedCluster]) -> ScriptedCluster:
    server[1].script = [token("Par"), token("is"), finish()]
    server[1].submitted.clear()
    return server[1]


def test_client_chat_plain_and_streaming(client: ollama.Client, cluster: ScriptedCluster) -> None:
    messages = [{"role": "user", "content": "capital of France?"}]
    answer = client.chat(model=f"{SMOLLM2}:latest", messages=messages, options={"temperature": 0})
    assert answer.message.content == "Paris" and answer.done and answer.done_reason == "stop"
    assert answer.model == f"{SMOLLM2}:latest"
    assert answer.prompt_eval_count == 5 and answer.eval_count == 3
    assert answer.total_duration is not None and answer.total_duration > 0
    params = cluster.submitted[0].params
    assert params.model == SMOLLM2 and params.temperature == 0 and params.stream is False

    parts = list(client.chat(model=SMOLLM2, messages=messages, stream=True))
    assert [part.message.content for part in parts] == ["Par", "is", ""]
    assert [part.done for part in parts] == [False, False, True]
    assert cluster.submitted[1].params.stream is True


def test_client_chat_tool_call_and_thinking(
    client: ollama.Client, cluster: ScriptedCluster
) -> None:
    cluster.script = [
        token(reasoning="need weather"),
        tool_calls(("get_weather", '{"city": "Paris"}'), finish_reason="tool_calls"),
    ]

    def get_weather(city: str) -> str:
        """Weather of a city.

        Args:
            city: The city.
        """
        return "sunny"

    # `think` asks for a thinking model (else Ollama's 400: test_ollama_thinking_support.py).
    plain = cluster.cards[SMOLLM2]
    cluster.cards[SMOLLM2] = plain.model_copy(
        update={"capabilities": (*plain.capabilities, "thinking")}
    )
    try:
        answer = client.chat(
            model=SMOLLM2,
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=[get_weather],
            think=True,
            stream=False,
        )
    finally:
        cluster.cards[SMOLLM2] = plain
    assert answer.message.thinking == "need weather"
    assert answer.message.tool_calls is not None
    call = answer.message.tool_calls[0].function
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
    params = cluster.submitted[0].params
    assert [tool.name for tool in params.tools] == ["get_weather"]
    assert params.enable_thinking is True and params.tool_choice == "auto"


def test_client_generate_list_show_ps(client: ollama.Client, cluster: ScriptedCluster) -> None:
    generated = client.generate(model=SMOLLM2, prompt="capital of France?", system="be brief")
    assert generated.response == "Paris" and generated.done_reason == "stop"
    assert [m.role for m in cluster.submitted[0].params.messages] == ["system", "user"]
    loaded = client.generate(model=SMOLLM2, prompt="")
    assert loaded.done and loaded.done_reason == "load"
    assert len(cluster.submitted) == 1, "an empty prompt only loads the model"

    listed = client.list()
    assert [m.model for m in listed.models] == [SMOLLM2]
    assert listed.models[0].size == smollm2_card().storage_size_bytes
    assert listed.models[0].details is not None
    assert listed.models[0].details.family == "llama"

    shown = client.show(SMOLLM2)
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"

    running = client.ps()
    assert [m.model for m in running.models] == [SMOLLM2]
    assert running.models[0].size_vram == 0


def test_client_generate_with_every_option_the_client_declares(
    client: ollama.Client, cluster: ScriptedCluster
) -> None:
    """The `ollama` client's `Options` in full: each has its effect, is accepted as a
    documented no-op (neutral values, load-time options), or is a 400 naming it."""
    accepted = ollama.Options(
        numa=False, num_ctx=2048, num_batch=512, num_gpu=0, main_gpu=0, low_vram=False,
        f16_kv=True, logits_all=False, vocab_only=False, use_mmap=True, use_mlock=False,
        embedding_only=False, num_thread=2, num_keep=4, seed=7, num_predict=5, top_k=20,
        top_p=0.9, tfs_z=1.0, typical_p=1.0, repeat_last_n=-1, temperature=0.2,
        repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.2, mirostat=0,
        mirostat_tau=5.0, mirostat_eta=0.1, penalize_newline=True, stop=["END"],
    )  # fmt: skip
    generated = client.generate(model=SMOLLM2, prompt="hi", options=accepted)
    assert generated.response == "Paris"
    params = cluster.submitted[-1].params
    assert (params.context_tokens, params.seed, params.max_tokens, params.top_k) == (2048, 7, 5, 20)
    assert (params.repetition_penalty, params.stop) == (1.1, ("END",))
    for refused in ({"mirostat": 2}, {"typical_p": 0.5}, {"repeat_last_n": -2}):
        with pytest.raises(ollama.ResponseError) as raised:
            client.generate(model=SMOLLM2, prompt="hi", options=ollama.Options(**refused))
        (name,) = refused
        assert raised.value.status_code == 400 and f"options.{name}" in raised.value.error


def test_client_errors(client: ollama.Client, cluster: ScriptedCluster, server: Any) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert (raised.value.status_code, raised.value.error) == (404, "model 'nope' not found")
    with pytest.raises(ollama.ResponseError) as raised:
        client.show("nope")
    assert raised.value.status_code == 404

    cluster.script = [token("Hi"), error_chunk("runner crashed")]
    stream = client.chat(model=SMOLLM2, messages=[{"role": "user", "content": "x"}], stream=True)
    with pytest.raises(ollama.ResponseError, match="runner crashed"):
        list(stream)

    base = server[0]
    wrong_type = httpx.post(f"{base}/ollama/api/chat", json={"model": SMOLLM2, "messages": "x"})
    assert wrong_type.status_code == 400 and set(wrong_type.json()) == {"error"}
    missing = httpx.post(f"{base}/ollama/api/chat", json={"messages": []})
    assert missing.status_code == 400 and "model" in missing.json()["error"]
    images = httpx.post(
        f"{base}/ollama/api/chat",
        json={"model": SMOLLM2, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
    )
    assert images.status_code == 400 and "vision" in images.json()["error"]
    empty = httpx.post(f"{base}/ollama/api/chat", json={"model": SMOLLM2, "messages": []})
    assert empty.status_code == 200 and empty.json()["done_reason"] == "load"


def test_version_root_and_openai_routes(server: tuple[str, ScriptedCluster], cluster: Any) -> None:
    base = server[0]
    assert httpx.get(f"{base}/ollama/api/version").json() == {"version": "0.13.4"}
    assert httpx.head(f"{base}/ollama/api/version").status_code == 200
    assert httpx.get(f"{base}/ollama").text == "Ollama is running"
    openai_client = openai.OpenAI(base_url=f"{base}/ollama/v1", api_key="x", max_retries=0)
    assert [m.id for m in openai_client.models.list()] == [SMOLLM2]
    completion = openai_client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "x"}]
    )
    assert completion.choices[0].message.content == "Paris"
    with pytest.raises(openai.NotFoundError) as raised:
        openai_client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}]
        )
    assert raised.value.body is not None and "message" in cast(dict[str, Any], raised.value.body)


def test_curl_style_body_without_json_content_type(
    server: tuple[str, ScriptedCluster], cluster: ScriptedCluster
) -> None:
    """`curl -d '{...}'` (Ollama's own examples) sends a form content type."""
    body = json.dumps(
        {"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    )
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        response = httpx.post(
            f"{server[0]}/ollama/api/chat", content=body, headers={"content-type": content_type}
        )
        assert response.status_code == 200, response.text
        assert response.json()["message"]["content"] == "Paris"
    garbage = httpx.post(
        f"{server[0]}/ollama/api/chat",
        content=b"model=x",
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert garbage.status_code == 400 and "error" in garbage.json()
