"""A turn with no content is refused as the reference API refuses it: OpenAI answers a
user (system, developer, tool) message without `content` with 400 "Missing required
parameter"; Anthropic answers any turn whose content is `""` or `[]` with 400, except a
final assistant turn (a prefill), and an empty text block in any turn's content list with
400 "messages: text content blocks must be non-empty". What the references accept stays
accepted."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.claude_messages.request import to_task_params
from exo.api.claude_messages.wire_types import MessagesRequest
from exo.api.openai_chat.wire_types import ChatCompletionRequest
from exo.api.serving.cluster_client import ClusterClient
from exo.api.wire.errors import InvalidRequestError, without_union_tags
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
_ANTHROPIC_EMPTY = "all messages must have non-empty content except for the optional final"


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    # Validation runs before any handler: no request below reaches the cluster.
    with TestClient(create_app(cast(ClusterClient, object()))) as test_client:
        yield test_client


# ---------------------------------------------------------------- OpenAI Chat Completions


@pytest.mark.parametrize("role", ["user", "system", "developer", "tool"])
def test_openai_message_without_content_is_missing_required_parameter(
    http: TestClient, role: str
) -> None:
    message: dict[str, Any] = {"role": role}
    if role == "tool":
        message["tool_call_id"] = "call_1"
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}, message]},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": "Missing required parameter: 'messages[1].content'.",
        "type": "invalid_request_error",
        "param": "messages[1].content",
        "code": "missing_required_parameter",
    }


def test_openai_null_user_content_is_a_400_naming_the_field(http: TestClient) -> None:
    response = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": None}]},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content"


def test_openai_missing_top_level_field_is_worded_as_openai_words_it(http: TestClient) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL})
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (400, "missing_required_parameter")
    assert error["message"] == "Missing required parameter: 'messages'."


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"model": MODEL, "input": [{"role": "user"}]}, "input[0].content"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_missing_field_inside_an_array_is_named_not_the_string_branch(
    http: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    """`input` and `content` take a string or an array: for an array the answer names what
    the array lacks, not "expected a string, but got an array"."""
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "missing_required_parameter")
    assert error["message"] == f"Missing required parameter: '{param}'."


def test_openai_assistant_turn_may_carry_only_tool_calls() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"},
            ],
        }
    )
    assert len(request.messages) == 3


def test_union_tags_are_left_out_of_the_location() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    errors: list[dict[str, Any]] = [
        {"loc": ("body", "messages", 0, "user", "content", "list[...]", 0, "text", "text")},
        {"loc": ("body", "messages", 0, "user", "content", "str"), "type": "string_type"},
        {"loc": ("body", "messages", 0, "user", "name")},
        {"loc": ("query", "stream")},
    ]
    assert [error["loc"] for error in without_union_tags(errors, body)] == [
        ("body", "messages", 0, "content", 0, "text"),
        ("body", "messages", 0, "content", "str"),
        ("body", "messages", 0, "name"),
        ("query", "stream"),
    ]


# ---------------------------------------------------------------- Claude Messages


def _claude(*messages: dict[str, Any]) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"model": MODEL, "max_tokens": 8, "messages": list(messages)}
    )


@pytest.mark.parametrize("empty", ["", []])
@pytest.mark.parametrize(
    ("messages", "at"),
    [
        ([{"role": "user"}], 0),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user"}], 1),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
          {"role": "user"}], 2),
        ([{"role": "user", "content": "hi"}, {"role": "system"}], 1),
    ],
)  # fmt: skip
def test_claude_empty_turn_is_refused_naming_it(
    empty: str | list[Any], messages: list[dict[str, Any]], at: int
) -> None:
    sent = [
        message if "content" in message else {**message, "content": empty} for message in messages
    ]
    with pytest.raises(InvalidRequestError) as raised:
        to_task_params(_claude(*sent))
    assert raised.value.message == f"messages.{at}: {_ANTHROPIC_EMPTY} assistant message"
    assert raised.value.param == f"messages.{at}.content"


@pytest.mark.parametrize("empty", ["", []])
def test_claude_empty_final_assistant_turn_stays_valid(empty: str | list[Any]) -> None:
    params = to_task_params(
        _claude({"role": "user", "content": "hi"}, {"role": "assistant", "content": empty})
    )
    assert [message.role for message in params.messages] == ["user", "assistant"]
    assert params.messages[-1].content == ""


def test_claude_route_answers_400_in_anthropic_shape() -> None:
    cluster = ScriptedCluster()
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        response = http.post(
            "/v1/messages",
            json={"model": SMOLLM2, "max_tokens": 8, "messages": [{"role": "user", "content": ""}]},
        )
    assert response.status_code == 400, response.text
    assert cluster.submitted == []
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert _ANTHROPIC_EMPTY in response.json()["error"]["message"]


_ANTHROPIC_EMPTY_BLOCK = "messages: text content blocks must be non-empty"
EMPTY_TEXT = {"type": "text", "text": ""}


@pytest.mark.parametrize(
    ("messages", "at"),
    [
        ([{"role": "user", "content": [EMPTY_TEXT]}], "messages.0.content.0.text"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}, EMPTY_TEXT]}],
            "messages.0.content.1.text",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [EMPTY_TEXT]},
                {"role": "user", "content": "again"},
            ],
            "messages.1.content.0.text",
        ),
        # The final assistant turn's exception is for empty content, not for an empty block.
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [EMPTY_TEXT]}],
            "messages.1.content.0.text",
        ),
    ],
)
def test_claude_empty_text_block_is_refused_in_anthropic_words(
    messages: list[dict[str, Any]], at: str
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        to_task_params(_claude(*messages))
    assert (raised.value.message, raised.value.param) == (_ANTHROPIC_EMPTY_BLOCK, at)


def test_claude_route_answers_an_empty_text_block_with_400() -> None:
    cluster = ScriptedCluster()
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        response = http.post(
            "/v1/messages",
            json={
                "model": SMOLLM2,
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [EMPTY_TEXT]}],
            },
        )
    assert response.status_code == 400, response.text
    assert cluster.submitted == []
    assert response.json()["error"] == {
        "type": "invalid_request_error",
        "message": _ANTHROPIC_EMPTY_BLOCK,
    }


_ANTHROPIC_WHITESPACE = "messages: text content blocks must contain non-whitespace text"


@pytest.mark.parametrize("texts", [[" "], ["\n"], [" ", "\t\n"]])
def test_claude_turn_of_whitespace_only_text_is_refused_in_anthropic_words(
    texts: list[str],
) -> None:
    blocks = [{"type": "text", "text": text} for text in texts]
    with pytest.raises(InvalidRequestError) as raised:
        to_task_params(_claude({"role": "user", "content": blocks}))
    assert (raised.value.message, raised.value.param) == (
        _ANTHROPIC_WHITESPACE,
        "messages.0.content.0.text",
    )


def test_claude_whitespace_block_beside_real_text_stays_valid() -> None:
    blocks = [{"type": "text", "text": " "}, {"type": "text", "text": "real"}]
    params = to_task_params(_claude({"role": "user", "content": blocks}))
    assert "real" in str(params.messages[0].content)
