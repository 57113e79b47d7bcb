"""What the coding agents send and parse (issue 41): Claude Code's system-role messages,
billing line, ids and the errors it matches; the same overflow and queue-full errors in
every dialect's words. Through the real app with a stand-in cluster and the official SDKs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import ClusterClient
from exo.api.wire.errors import QueueFullError
from exo.shared.types.chunks import Chunk, ErrorChunk, ToolCallChunk, Usage
from exo.shared.types.common import CommandId
from exo.shared.types.text_generation import ChatMessage, ToolCall
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

OVERFLOW = (
    "the prompt is 9000 tokens; the model's context is 8192 tokens, leaving no room for a reply"
)
READ_TOOL = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
}


class AgentCluster(ScriptedCluster):
    """Answers with `reply`: "text" (the scripted text), "overflow" (the engine's refusal of
    a prompt over the context) or "tool" (a call of Read)."""

    reply = "text"

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        model = self.last_params.model
        if self.reply == "overflow":
            yield ErrorChunk(
                command_id=command_id,
                model=model,
                error_message=OVERFLOW,
                status_code=400,
                error_code="context_length_exceeded",
            )
        elif self.reply == "tool":
            call = ToolCall(id="call_abc123", name="Read", arguments='{"file_path": "a.txt"}')
            yield ToolCallChunk(
                command_id=command_id,
                model=model,
                tool_calls=(call,),
                finish_reason="tool_calls",
                usage=Usage(prompt_tokens=5, completion_tokens=2),
            )
        else:
            async for chunk in super()._answer(command_id):
                yield chunk


class FullAdmission(Admission):
    async def admit(self, *_arguments: Any, **_options: Any) -> Any:
        raise QueueFullError("every instance of the model is busy", retry_after_seconds=5)


@pytest.fixture
def cluster() -> AgentCluster:
    return AgentCluster()


@pytest.fixture
def http(cluster: AgentCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client


@pytest.fixture
def claude(http: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )


# ---------------------------------------------------------------- Claude Code's requests


@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_system_role_messages_are_accepted_as_system_turns(
    http: TestClient, cluster: AgentCluster, route: str
) -> None:
    # Claude Code's first request (its mid-conversation-system beta), shape kept.
    body = {
        "model": SMOLLM2,
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cch=1f2e;"},
            {"type": "text", "text": "You are Claude Code."},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "system", "content": [{"type": "text", "text": "Today is Friday."}]},
            {"role": "user", "content": "what day is it?"},
        ],
    }
    headers = {"anthropic-beta": "mid-conversation-system-2026-04-07,claude-code-20250219"}
    if route == "/v1/messages/count_tokens":
        # Counting needs the tokenizer; the conversion is what is checked here.
        from exo.api.claude_messages.request import count_tokens_params
        from exo.api.claude_messages.wire_types import CountTokensRequest

        params = count_tokens_params(CountTokensRequest.model_validate(body))
    else:
        answer = http.post(route, json=body, headers=headers)
        assert answer.status_code == 200, answer.text
        params = cluster.last_params
    assert params.messages == (
        ChatMessage(role="system", content="You are Claude Code."),
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="system", content="Today is Friday."),
        ChatMessage(role="user", content="what day is it?"),
    )


@pytest.mark.parametrize(
    ("system", "expected"),
    [
        ("x-anthropic-billing-header: cch=1;\nYou are Claude Code.", "You are Claude Code."),
        ("You are Claude Code.", "You are Claude Code."),
        (
            [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
            "Be brief.\nBe kind.",
        ),
    ],
)
def test_only_a_leading_billing_line_is_left_out(
    http: TestClient, cluster: AgentCluster, system: Any, expected: str
) -> None:
    body = {
        "model": SMOLLM2,
        "max_tokens": 5,
        "system": system,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert http.post("/v1/messages", json=body).status_code == 200
    assert cluster.last_params.messages[0] == ChatMessage(role="system", content=expected)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"role": "tool", "content": "x"}, 'messages.0: Unexpected role "tool".'),
        ({"role": "developer", "content": "x"}, 'messages.0: Unexpected role "developer".'),
        (
            {"role": "system", "content": [{"type": "image", "source": {}}]},
            "messages.0.content.0: system messages take text blocks only",
        ),
    ],
)
def test_unexpected_roles_are_worded_as_anthropic_words_them(
    claude: anthropic.Anthropic, message: dict[str, Any], expected: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=SMOLLM2, max_tokens=5, messages=[cast(Any, message)])
    assert expected in str(raised.value)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_ids_are_anthropic_ids(
    claude: anthropic.Anthropic, cluster: AgentCluster, stream: bool
) -> None:
    cluster.reply = "tool"
    message: anthropic.types.Message
    if stream:
        with claude.messages.stream(
            model=SMOLLM2,
            max_tokens=50,
            messages=[{"role": "user", "content": "read a.txt"}],
            tools=[cast(Any, READ_TOOL)],
        ) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(
            model=SMOLLM2,
            max_tokens=50,
            messages=[{"role": "user", "content": "read a.txt"}],
            tools=[cast(Any, READ_TOOL)],
        )
    (block,) = message.content
    assert block.type == "tool_use" and block.id == "toolu_abc123"
    assert block.input == {"file_path": "a.txt"}


# ---------------------------------------------------------------- errors clients act on


def test_context_overflow_is_worded_as_each_reference_api_words_it(
    http: TestClient, cluster: AgentCluster
) -> None:
    cluster.reply = "overflow"
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as claude_error:
        claude.messages.create(
            model=SMOLLM2, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert "prompt is too long: 9000 tokens > 8192 maximum" in str(claude_error.value)

    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
    )
    for create in (
        lambda: client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": "hi"}]
        ),
        lambda: client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": "hi"}], stream=True
        ),
        lambda: client.responses.create(model=SMOLLM2, input="hi"),
        lambda: client.completions.create(model=SMOLLM2, prompt="hi"),
    ):
        with pytest.raises(openai.BadRequestError) as openai_error:
            create()
        assert openai_error.value.code == "context_length_exceeded"
        assert openai_error.value.body["message"].startswith(  # type: ignore[index]
            "This model's maximum context length is 8192 tokens. However, your messages "
            "resulted in 9000 tokens."
        )

    ollama = http.post(
        "/ollama/api/chat",
        json={"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}], "stream": False},
    )
    assert ollama.status_code == 400
    assert ollama.json()["error"].startswith("the input length exceeds the context length")


@pytest.mark.parametrize(
    ("route", "body", "status", "check"),
    [
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, 529,
         lambda body: body["error"]["type"] == "overloaded_error"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 503,
         lambda body: body["error"]["code"] == "queue_full"),
        ("/ollama/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, 503,
         lambda body: "busy" in body["error"]),
    ],
)  # fmt: skip
def test_a_full_queue_is_each_dialects_overloaded_answer(
    cluster: AgentCluster, route: str, body: dict[str, Any], status: int, check: Any
) -> None:
    app = create_app(cast(ClusterClient, cluster), admission=FullAdmission())
    with TestClient(app) as http:
        answer = http.post(route, json={"model": SMOLLM2, **body})
    assert answer.status_code == status
    assert answer.headers["retry-after"] == "5"
    assert check(answer.json())
