"""Prompt tokens served from the runner's prefix cache (`Usage.cached_tokens`) are reported
in every dialect's usage, streamed and not: OpenAI Chat Completions and legacy Completions
`prompt_tokens_details.cached_tokens`, Responses `input_tokens_details.cached_tokens`,
Claude `cache_read_input_tokens` (and `input_tokens` without them, as Anthropic counts),
while Ollama's `prompt_eval_count` stays the whole prompt.

Through the real app over a scripted cluster whose generations report 40 prompt tokens, 32
of them cached.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from exo.api.app import create_app
from exo.shared.types.chunks import Chunk, TokenChunk, Usage
from exo.shared.types.common import CommandId
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

PROMPT_TOKENS = 40
CACHED_TOKENS = 32
COMPLETION_TOKENS = 2
USER_HI = {"role": "user", "content": "hi"}


class CachedPrefixCluster(ScriptedCluster):
    """Answers "Hi" + " there." with a usage whose prompt was mostly cached; the first
    chunk carries the prompt and cached counts, as a runner sends them."""

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        (command,) = [item for item in self.submitted if item.command_id == command_id]
        model = command.params.model
        yield TokenChunk(
            command_id=command_id,
            model=model,
            text="Hi",
            token_ids=(1,),
            prompt_tokens=PROMPT_TOKENS,
            cached_tokens=CACHED_TOKENS,
        )
        yield TokenChunk(
            command_id=command_id,
            model=model,
            text=" there.",
            token_ids=(2,),
            finish_reason="stop",
            usage=Usage(
                prompt_tokens=PROMPT_TOKENS,
                completion_tokens=COMPLETION_TOKENS,
                cached_tokens=CACHED_TOKENS,
            ),
        )


@pytest.fixture
def client() -> TestClient:
    return TestClient(create_app(CachedPrefixCluster()))  # type: ignore[arg-type]


def sse_data(text: str) -> list[Any]:
    """The JSON payloads of an SSE body (`[DONE]` left out)."""
    payloads = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            payloads.append(json.loads(line.removeprefix("data: ")))
    return payloads


def test_usage_refuses_more_cached_tokens_than_prompt_tokens() -> None:
    with pytest.raises(ValidationError, match="cached_tokens"):
        Usage(prompt_tokens=3, completion_tokens=0, cached_tokens=4)
    assert Usage(prompt_tokens=3, completion_tokens=0).cached_tokens == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_openai_usage_reports_cached_prompt_tokens(client: TestClient, path: str) -> None:
    body: dict[str, Any] = {"model": SMOLLM2, "max_tokens": 4}
    body |= {"messages": [USER_HI]} if "chat" in path else {"prompt": "hi"}
    expected = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": COMPLETION_TOKENS,
        "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
    }

    answer = client.post(path, json=body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert {key: usage[key] for key in expected} == expected

    streamed = client.post(
        path, json=body | {"stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.status_code == 200, streamed.text
    (usage_event,) = [event for event in sse_data(streamed.text) if event.get("usage")]
    assert usage_event["choices"] == []
    assert {key: usage_event["usage"][key] for key in expected} == expected


def test_responses_usage_reports_cached_input_tokens(client: TestClient) -> None:
    body = {"model": SMOLLM2, "input": "hi", "max_output_tokens": 16}

    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["input_tokens"] == PROMPT_TOKENS
    assert usage["input_tokens_details"]["cached_tokens"] == CACHED_TOKENS
    assert usage["total_tokens"] == PROMPT_TOKENS + COMPLETION_TOKENS

    streamed = client.post("/v1/responses", json=body | {"stream": True})
    assert streamed.status_code == 200, streamed.text
    (completed,) = [
        event for event in sse_data(streamed.text) if event["type"] == "response.completed"
    ]
    assert completed["response"]["usage"] == usage


def test_claude_usage_counts_cache_reads_apart_from_input_tokens(client: TestClient) -> None:
    body = {"model": SMOLLM2, "messages": [USER_HI], "max_tokens": 4}
    expected = {
        "input_tokens": PROMPT_TOKENS - CACHED_TOKENS,
        "cache_read_input_tokens": CACHED_TOKENS,
        "cache_creation_input_tokens": 0,
    }

    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert {key: usage[key] for key in expected} == expected
    assert usage["output_tokens"] == COMPLETION_TOKENS

    streamed = client.post("/v1/messages", json=body | {"stream": True})
    assert streamed.status_code == 200, streamed.text
    events = sse_data(streamed.text)
    start_usage = events[0]["message"]["usage"]
    assert {key: start_usage[key] for key in expected} == expected
    assert start_usage["output_tokens"] == 0
    (delta,) = [event for event in events if event["type"] == "message_delta"]
    assert {key: delta["usage"][key] for key in expected} == expected
    assert delta["usage"]["output_tokens"] == COMPLETION_TOKENS


@pytest.mark.parametrize("path", ["/ollama/api/chat", "/ollama/api/generate"])
def test_ollama_prompt_eval_count_is_the_whole_prompt(client: TestClient, path: str) -> None:
    body: dict[str, Any] = {"model": SMOLLM2, "options": {"num_predict": 4}}
    body |= {"messages": [USER_HI]} if path.endswith("chat") else {"prompt": "hi"}

    answer = client.post(path, json=body | {"stream": False})
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_eval_count"] == PROMPT_TOKENS
    assert answer.json()["eval_count"] == COMPLETION_TOKENS

    streamed = client.post(path, json=body | {"stream": True})
    assert streamed.status_code == 200, streamed.text
    last = json.loads(streamed.text.strip().splitlines()[-1])
    assert last["done"] is True
    assert last["prompt_eval_count"] == PROMPT_TOKENS
