"""A tool call left without its result is refused, as the reference APIs refuse it.

Found by trial 40: an assistant turn with two calls followed by results for only one of
them was accepted in Chat Completions and Claude Messages (and Responses), and the model
was prompted with a call that never got an answer. OpenAI answers 400 "An assistant message
with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The
following tool_call_ids did not have response messages: call_b"; Anthropic answers 400
"messages.2: `tool_use` ids were found without `tool_result` blocks immediately after:
toolu_b. Each `tool_use` block must have a corresponding `tool_result` block in the next
message." exo checks only the other direction (a result without its call). The Responses
API answers 400 "No tool output found for function call call_b." (param `input`). A final
assistant turn stays valid everywhere: it is a continuation.
"""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from exo.api.claude_messages.request import to_task_params as claude_params
from exo.api.claude_messages.wire_types import MessagesRequest
from exo.api.openai_chat.request import to_task_params as chat_params
from exo.api.openai_chat.wire_types import ChatCompletionRequest
from exo.api.openai_responses.request import to_task_params as responses_params
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.tests.serving import scripted_app
from exo.api.wire.errors import InvalidRequestError
from exo.testing.scripted_cluster import ScriptedCluster

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}


def test_chat_completions_refuses_a_call_without_its_tool_message() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "two cities"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [_call("call_a"), _call("call_b")],
                },
                {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
                {"role": "user", "content": "and now?"},
            ],
        }
    )
    with pytest.raises(InvalidRequestError, match="call_b"):
        chat_params(request)


def test_claude_messages_refuses_a_tool_use_without_its_tool_result() -> None:
    request = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 64,
            "messages": [
                {"role": "user", "content": "two cities"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
                        {"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "r"}],
                },
            ],
        }
    )
    with pytest.raises(InvalidRequestError, match="toolu_b"):
        claude_params(request)


def _responses_request(input_items: list[dict[str, Any]]) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": input_items})


def _function_call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def test_responses_refuses_a_function_call_without_its_output() -> None:
    request = _responses_request(
        [
            {"role": "user", "content": "two cities"},
            _function_call("call_a"),
            _function_call("call_b"),
            {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
            {"role": "user", "content": "and now?"},
        ]
    )
    with pytest.raises(InvalidRequestError, match="No tool output found for function call call_b"):
        responses_params(request)


def test_a_final_assistant_turn_with_calls_is_a_continuation_in_every_dialect() -> None:
    chat_params(
        ChatCompletionRequest.model_validate(
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "two cities"},
                    {"role": "assistant", "content": None, "tool_calls": [_call("call_a")]},
                ],
            }
        )
    )
    claude_params(
        MessagesRequest.model_validate(
            {
                "model": MODEL,
                "max_tokens": 64,
                "messages": [
                    {"role": "user", "content": "two cities"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}
                        ],
                    },
                ],
            }
        )
    )
    responses_params(
        _responses_request([{"role": "user", "content": "two cities"}, _function_call("call_a")])
    )


def test_each_dialect_answers_400_in_its_own_shape_with_the_references_wording() -> None:
    client = TestClient(scripted_app(ScriptedCluster()))
    chat = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [_call("call_b")]},
                {"role": "user", "content": "and now?"},
            ],
        },
    )
    assert chat.status_code == 400
    assert chat.json()["error"]["type"] == "invalid_request_error"
    assert chat.json()["error"]["message"] == (
        "An assistant message with 'tool_calls' must be followed by tool messages responding "
        "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        "call_b"
    )
    claude = client.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}}],
                },
                {"role": "user", "content": "and now?"},
            ],
        },
    )
    assert claude.status_code == 400
    assert claude.json()["type"] == "error"
    assert claude.json()["error"] == {
        "type": "invalid_request_error",
        "message": "messages.2: `tool_use` ids were found without `tool_result` blocks "
        "immediately after: toolu_b. Each `tool_use` block must have a corresponding "
        "`tool_result` block in the next message.",
    }
    responses = client.post(
        "/v1/responses",
        json={
            "model": MODEL,
            "input": [
                {"role": "user", "content": "hi"},
                _function_call("call_b"),
                {"role": "user", "content": "and now?"},
            ],
        },
    )
    assert responses.status_code == 400
    assert responses.json()["error"]["message"] == "No tool output found for function call call_b."
    assert responses.json()["error"]["param"] == "input"
