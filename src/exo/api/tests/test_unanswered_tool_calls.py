"""A tool call left without its result is refused, as the reference APIs refuse it.

Found by trial 40: an assistant turn with two calls followed by results for only one of
them was accepted in Chat Completions and Claude Messages (and Responses), and the model
was prompted with a call that never got an answer. OpenAI answers 400 "An assistant message
with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The
following tool_call_ids did not have response messages: call_b"; Anthropic answers 400
"messages.2: `tool_use` ids were found without `tool_result` blocks immediately after:
toolu_b. Each `tool_use` block must have a corresponding `tool_result` block in the next
message." exo checks only the other direction (a result without its call).
"""

from __future__ import annotations

from typing import Any

import pytest

from exo.api.claude_messages.request import to_task_params as claude_params
from exo.api.claude_messages.wire_types import MessagesRequest
from exo.api.openai_chat.request import to_task_params as chat_params
from exo.api.openai_chat.wire_types import ChatCompletionRequest
from exo.api.wire.errors import InvalidRequestError

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
