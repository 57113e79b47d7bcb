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
    chat = (
        "This model's maximum context length is 8192 tokens. However, your messages "
        "resulted in 9000 tokens."
    )
    for create, param, sentence in (
        (
            lambda: client.chat.completions.create(
                model=SMOLLM2, messages=[{"role": "user", "content": "hi"}]
            ),
            "messages",
            chat,
        ),
        (
            lambda: client.chat.completions.create(
                model=SMOLLM2, messages=[{"role": "user", "content": "hi"}], stream=True
            ),
            "messages",
            chat,
        ),
        (
            lambda: client.responses.create(model=SMOLLM2, input="hi"),
            "input",
            "Your input exceeds the context window of this model. Please adjust your input "
            "and try again. (The input is 9000 tokens; the model's context is 8192.)",
        ),
        (
            lambda: client.completions.create(model=SMOLLM2, prompt="hi"),
            "prompt",
            "This model's maximum context length is 8192 tokens, however you requested 9000 "
            "tokens (9000 in your prompt; 0 for the completion). Please reduce your prompt; "
            "or completion length.",
        ),
    ):
        with pytest.raises(openai.BadRequestError) as openai_error:
            create()
        assert openai_error.value.code == "context_length_exceeded"
        assert openai_error.value.param == param
        assert openai_error.value.body["message"].startswith(sentence)  # type: ignore[index]
    # The same routes under Ollama's OpenAI-compatible prefix word it the same way.
    for route, body, sentence in (
        ("/ollama/v1/completions", {"prompt": "hi"}, "This model's maximum context length is "
         "8192 tokens, however you requested 9000 tokens"),
        ("/ollama/v1/responses", {"input": "hi"}, "Your input exceeds the context window"),
    ):  # fmt: skip
        answer = http.post(route, json={"model": SMOLLM2, **body})
        assert answer.status_code == 400
        assert answer.json()["error"]["message"].startswith(sentence), route
        assert answer.json()["error"]["code"] == "context_length_exceeded"

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


# ---------------------------------------------------------------- Codex's requests

SHELL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
}
NAMESPACE = {
    "type": "namespace",
    "name": "mcp__files__",
    "description": "a file server",
    "tools": [
        {"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}},
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
    ],
}


class NamespacedCallCluster(AgentCluster):
    """Answers every generation with a call of the model's `mcp__files__read`."""

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        call = ToolCall(id="call_7", name="mcp__files__read", arguments="{}")
        yield ToolCallChunk(
            command_id=command_id,
            model=self.last_params.model,
            tool_calls=(call,),
            finish_reason="tool_calls",
            usage=Usage(prompt_tokens=5, completion_tokens=2),
        )


@pytest.mark.parametrize("stream", [False, True])
def test_namespace_tools_are_offered_as_functions_and_their_calls_named_apart(
    stream: bool,
) -> None:
    cluster = NamespacedCallCluster()
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
        )
        tools = cast(Any, [SHELL, NAMESPACE, {"type": "web_search"}])
        response: openai.types.responses.Response
        if stream:
            with client.responses.stream(model=SMOLLM2, input="read", tools=tools) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(model=SMOLLM2, input="read", tools=tools)
    offered = [tool.name for tool in cluster.last_params.tools]
    assert offered == ["shell", "mcp__files__read", "mcp__files__shell"]
    (item,) = response.output
    assert item.type == "function_call" and item.name == "read"
    assert item.namespace == "mcp__files__"  # the SDK (openai 3.57) knows the field


def test_namespace_is_accepted_on_input_items(http: TestClient, cluster: AgentCluster) -> None:
    body = {
        "model": SMOLLM2,
        "tools": [NAMESPACE],
        "input": [
            {"role": "user", "content": "read"},
            {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "mcp__files__",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "contents"},
        ],
    }  # fmt: skip
    assert http.post("/v1/responses", json=body).status_code == 200
    assert cluster.last_params.messages[1].tool_calls[0].name == "mcp__files__read"


@pytest.mark.parametrize(
    ("tools", "tool_choice", "status", "header"),
    [
        ([SHELL, {"type": "web_search"}, {"type": "file_search"}], None, 200,
         "web_search, file_search"),
        ([{"type": "code_interpreter"}, {"type": "image_generation"}, {"type": "mcp"}], None,
         200, "code_interpreter, image_generation, mcp"),
        ([SHELL], None, 200, None),
        ([SHELL, {"type": "web_search"}], {"type": "web_search"}, 400, None),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_hosted_tools_are_not_offered_and_listed_in_a_header(
    http: TestClient,
    cluster: AgentCluster,
    tools: list[Any],
    tool_choice: Any,
    status: int,
    header: str | None,
    stream: bool,
) -> None:
    body: dict[str, Any] = {"model": SMOLLM2, "input": "hi", "tools": tools, "stream": stream}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    answer = http.post("/v1/responses", json=body)
    assert answer.status_code == status, answer.text
    assert answer.headers.get("x-exo-tools-not-offered") == header
    if status == 200:
        assert [tool.name for tool in cluster.last_params.tools] == [
            tool["name"] for tool in tools if tool["type"] == "function"
        ]


def test_input_tokens_counts_what_the_model_would_see(
    http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exo.api.openai_responses import routes

    seen: list[Any] = []

    async def count(_cluster: Any, params: Any) -> int:
        seen.append(params)
        return 42

    monkeypatch.setattr(routes, "count_prompt_tokens", count)
    body = {"model": SMOLLM2, "input": "hi", "instructions": "Be brief.", "tools": [NAMESPACE]}
    answer = http.post("/v1/responses/input_tokens", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"object": "response.input_tokens", "input_tokens": 42}
    assert [message.role for message in seen[0].messages] == ["system", "user"]
    assert len(seen[0].tools) == 2


# ---------------------------------------------------------------- Ollama at the root


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/api/tags", None),
        ("GET", "/api/version", None),
        ("GET", "/api/ps", None),
        ("POST", "/api/show", {"model": SMOLLM2}),
        ("POST", "/api/chat", {"model": SMOLLM2, "messages": [{"role": "user", "content": "hi"}],
                               "stream": False}),
        ("POST", "/api/generate", {"model": SMOLLM2, "prompt": "hi", "stream": False}),
        ("POST", "/api/chat", {"model": "no-such-model", "messages": []}),
    ],
)  # fmt: skip
def test_the_ollama_api_is_served_at_the_root_exactly_as_under_ollama(
    http: TestClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    def strip(value: Any) -> Any:  # what differs between two answers: times, durations
        if isinstance(value, dict):
            return {
                key: strip(item)
                for key, item in value.items()
                if not key.endswith(("_at", "duration"))
            }
        return value

    root = http.request(method, path, json=body)
    prefixed = http.request(method, "/ollama" + path, json=body)
    assert root.status_code == prefixed.status_code
    assert root.headers["content-type"] == prefixed.headers["content-type"]
    assert strip(root.json()) == strip(prefixed.json())


def test_the_ollama_client_works_with_the_node_as_its_host(http: TestClient) -> None:
    import ollama

    client = ollama.Client(host="http://testserver")
    client._client = http  # the official client over the in-process app
    assert client.chat(model=SMOLLM2, messages=[{"role": "user", "content": "hi"}]).message
    assert [model.model for model in client.list().models] == [SMOLLM2]


def test_the_reported_ollama_version_is_the_api_level_served(http: TestClient) -> None:
    # `codex --oss` needs 0.13.4 (the release serving /v1/responses).
    for path in ("/api/version", "/ollama/api/version"):
        assert http.get(path).json() == {"version": "0.13.4"}
    assert (
        http.post("/ollama/v1/responses", json={"model": SMOLLM2, "input": "hi"}).json()["status"]
        == "completed"
    )


# ---------------------------------------------------------------- model aliases


@pytest.mark.parametrize(
    ("asked", "served"),
    [
        ("claude-sonnet-5", SMOLLM2),  # a Claude Code default
        ("claude-haiku-4-5", SMOLLM2),  # its small fast model
        ("gpt-5-codex", SMOLLM2),
        (SMOLLM2, SMOLLM2),  # a name the cluster knows is never aliased
        ("llama-3", None),  # no alias matches: the usual 404
    ],
)
def test_model_aliases_map_client_names_to_served_models(
    cluster: AgentCluster, asked: str, served: str | None
) -> None:
    import dataclasses

    from exo.api.serving.model_aliases import parse_model_aliases

    aliases = parse_model_aliases(["claude-*=smollm2-135m", "gpt-?-codex=" + SMOLLM2])
    cluster.load_on_request = dataclasses.replace(cluster.load_on_request, model_aliases=aliases)
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        claude = anthropic.Anthropic(
            base_url="http://testserver", api_key="x", http_client=http, max_retries=0
        )
        if served is None:
            with pytest.raises(anthropic.NotFoundError):
                claude.messages.create(
                    model=asked, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
                )
            return
        message = claude.messages.create(
            model=asked, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert cluster.last_params.model == served
    assert message.model == served


@pytest.mark.parametrize(
    ("argv", "environment", "expected"),
    [
        ([], "", ()),
        (["--model-alias", "claude-*=qwen3:8b"], "", (("claude-*", "qwen3:8b"),)),
        (["--model-alias", "a=b", "--model-alias", "c*=d"], "", (("a", "b"), ("c*", "d"))),
        ([], "claude-*=x,gpt-*=y", (("claude-*", "x"), ("gpt-*", "y"))),
    ],
)
def test_the_model_alias_option(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environment: str, expected: Any
) -> None:
    from exo.node_options import parse_args

    monkeypatch.setenv("EXO_MODEL_ALIASES", environment)
    options = parse_args(argv)
    assert [(alias.pattern, alias.model) for alias in options.model_aliases] == list(expected)


@pytest.mark.parametrize("bad", ["claude-*", "=x", "claude-*="])
def test_a_model_alias_without_both_sides_is_refused(bad: str) -> None:
    from exo.node_options import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model-alias", bad])
