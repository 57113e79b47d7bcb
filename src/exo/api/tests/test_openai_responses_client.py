"""The official `openai` client's Responses API against the route in the app: streamed and
not, a function call and its output, what the route passes to the cluster, and errors in
OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any, cast

import openai
import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient, LoadOnRequest
from exo.api.serving.node_stop import NodeStop
from exo.api.serving.response_ids import command_id_in_response_id
from exo.api.tests.openai_responses_builders import (
    MODEL,
    error_chunk,
    finish,
    token,
    tool_calls,
)
from exo.api.wire.images import ImagePolicy
from exo.shared.types.chunks import (
    Chunk,
)
from exo.shared.types.commands import CancelGeneration, GenerateText
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.text_generation import ChatMessage, ToolCall
from exo.testing.builders import make_instance

# ---------------------------------------------------------------- the official client


SCRIPTED_CHUNKS: dict[str, list[Chunk]] = {
    "hello": [token(reasoning="Greet."), token("Hel"), token("lo"), finish(text=" world")],
    "weather": [tool_calls(("call_1", "weather", '{"city": "Paris"}'), reason="tool_calls")],
    "crash": [token("partial"), error_chunk("runner crashed")],
    "20C": [token("It is 20C in Paris."), finish()],
}


class FakeState:
    instances: dict[str, Any] = {}
    custom_cards: dict[str, Any] = {}
    runners: dict[str, Any] = {}
    unavailable_instances: dict[str, Any] = {}

    def instances_of_model(self, model_id: ModelId) -> list[Any]:
        return [make_instance(NodeId("node-a"))]


class FakeCluster:
    """What the real route needs from `ClusterClient`: one known model with an instance,
    and for each command the scripted chunks keyed by its last message's text."""

    def __init__(self) -> None:
        self.cards = {ModelId(MODEL): None}
        self.state = FakeState()
        self.commands: list[GenerateText] = []
        self.cancelled: list[CommandId] = []
        self.load_on_request = LoadOnRequest()
        self.stop = NodeStop()
        self.image_policy = ImagePolicy()

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        return True  # the state is what the test set

    @contextmanager
    def chunk_stream(self, command_id: CommandId) -> Iterator[AsyncIterator[Chunk]]:
        async def chunks() -> AsyncIterator[Chunk]:
            last = self.commands[-1].params.messages[-1].content
            for chunk in SCRIPTED_CHUNKS[last]:
                yield chunk

        yield chunks()

    async def submit(self, command: GenerateText) -> None:
        self.commands.append(command)

    def send_and_forget(self, command: CancelGeneration) -> None:
        self.cancelled.append(command.target_command_id)


@pytest.fixture(scope="module")
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture(scope="module")
def client(cluster: FakeCluster) -> Iterator[openai.OpenAI]:
    """The official client against the real app (routes, error handlers), in process."""
    with TestClient(create_app(cast(ClusterClient, cluster))) as http_client:
        yield openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http_client, max_retries=0
        )


def test_openai_client_non_streaming(client: openai.OpenAI, cluster: FakeCluster) -> None:
    response = client.responses.create(model=MODEL, input="hello", store=False)
    assert command_id_in_response_id(response.id) == cluster.commands[-1].command_id
    assert response.status == "completed"
    assert response.output_text == "Hello world"
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.usage is not None and response.usage.total_tokens == 8


def test_openai_client_streaming_events(client: openai.OpenAI) -> None:
    stream = client.responses.create(model=MODEL, input="hello", stream=True)
    events = list(stream)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello world"
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Hello world"


def test_openai_client_stream_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="hello") as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello world"


def test_openai_client_function_call_round_trip(
    client: openai.OpenAI, cluster: FakeCluster
) -> None:
    tools: Any = [
        {
            "type": "function",
            "name": "weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": False,
        }
    ]
    response = client.responses.create(
        model=MODEL,
        input="weather",
        tools=tools,
        tool_choice={"type": "function", "name": "weather"},
    )
    (call,) = response.output
    assert call.type == "function_call"
    assert (call.name, call.call_id, json.loads(call.arguments)) == (
        "weather",
        "call_1",
        {"city": "Paris"},
    )
    # Replaying the output plus the result is the next request.
    follow_up: list[Any] = [
        {"role": "user", "content": "weather"},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "20C"},
    ]
    answer = client.responses.create(model=MODEL, input=follow_up, tools=tools)
    assert answer.output_text == "It is 20C in Paris."
    assert cluster.commands[-1].params.messages[1:] == (
        ChatMessage(
            role="assistant",
            tool_calls=(ToolCall(id="call_1", name="weather", arguments='{"city": "Paris"}'),),
        ),
        ChatMessage(role="tool", content="20C", tool_call_id="call_1"),
    )


def test_route_passes_the_converted_request_to_the_cluster(
    client: openai.OpenAI, cluster: FakeCluster
) -> None:
    client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="hello",
        max_output_tokens=17,
        temperature=0,
        reasoning={"effort": "low"},
    )
    params = cluster.commands[-1].params
    assert params.messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="hello"),
    )
    assert (params.max_tokens, params.temperature, params.enable_thinking) == (17, 0, True)


def test_max_output_tokens_below_openais_minimum_is_refused_as_openai_words_it(
    client: openai.OpenAI, cluster: FakeCluster
) -> None:
    """OpenAI's least `max_output_tokens` is 16; below it, its 400 (param, code, sentence)."""
    sent = len(cluster.commands)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model=MODEL, input="hello", max_output_tokens=10)
    assert raised.value.body == {
        "message": "Invalid 'max_output_tokens': integer below minimum value. Expected a value "
        ">= 16, but got 10 instead.",
        "type": "invalid_request_error",
        "param": "max_output_tokens",
        "code": "integer_below_min_value",
    }
    assert len(cluster.commands) == sent
    client.responses.create(model=MODEL, input="hello", max_output_tokens=16)
    assert cluster.commands[-1].params.max_tokens == 16


def test_openai_client_sees_a_failed_stream(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="crash", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error is not None
    assert events[-1].response.error.message == "runner crashed"


def test_openai_client_non_streaming_failure_is_an_api_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="runner crashed"):
        client.responses.create(model=MODEL, input="crash")


def test_openai_client_gets_bad_request_for_previous_response_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hello", previous_response_id="resp_1")
    assert caught.value.body is not None
    assert "does not store" in str(caught.value.body)


def test_route_errors_are_openai_shaped(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="no/such-model", input="hello")
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as schema:
        client.responses.create(model=MODEL, input=cast(Any, 42))
    assert isinstance(schema.value.body, dict) and schema.value.body["param"].startswith("input")
    with pytest.raises(openai.BadRequestError) as image:
        client.responses.create(
            model=MODEL,
            input=cast(
                Any,
                [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x/y"}],
                    }
                ],
            ),
        )
    assert isinstance(image.value.body, dict)
    assert image.value.body["param"] == "input[0].content[0]"
    assert image.value.body["type"] == "invalid_request_error"
