"""`POST /v1/responses` on one real `exo` node, driven through the official OpenAI client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from exo.api.serving.response_ids import command_id_in_response_id
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

QUESTION = "What is the capital of France? Answer in one sentence."
# Typed loosely: the SDK's TypedDict params do not accept a plain dict.
WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": False,
}


def client_for(node: ExoNode, timeout: float = 120.0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{node.url}/v1", api_key="unused", timeout=timeout, max_retries=0
    )


def test_plain_streaming_and_stream_helper_agree(default_node: ExoNode) -> None:
    client = client_for(default_node)
    response = client.responses.create(
        model=DEFAULT_MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=40, store=False
    )
    assert response.object == "response" and response.status == "completed"
    assert response.id.startswith("resp_") and command_id_in_response_id(response.id)
    assert "Paris" in response.output_text
    [message] = response.output
    assert message.type == "message" and message.status == "completed"
    assert response.usage is not None
    assert response.usage.input_tokens > 5 and response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert (response.temperature, response.max_output_tokens) == (0, 40)

    events = list(
        client.responses.create(
            model=DEFAULT_MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=40, stream=True
        )
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    # More than one piece: the first token leaves alone (TTFT), later ones may be grouped
    # (`--stream-interval-ms`), so how many pieces depends on the decode speed.
    assert len(deltas) >= 2, "streaming sends the answer piece by piece"
    assert "".join(deltas) == response.output_text
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.output_text == response.output_text

    with client.responses.stream(
        model=DEFAULT_MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=40
    ) as stream:
        helper_deltas = [
            event.delta for event in stream if event.type == "response.output_text.delta"
        ]
        final = stream.get_final_response()
    assert "".join(helper_deltas) == final.output_text == response.output_text


def test_instructions_and_history_reach_the_model(default_node: ExoNode) -> None:
    client = client_for(default_node)
    alone = client.responses.create(
        model=DEFAULT_MODEL_ID, input=QUESTION, temperature=0, max_output_tokens=16
    )
    history: list[Any] = [
        {"role": "user", "content": QUESTION},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "The capital of France is Paris."}],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "And of Italy?"}],
        },
    ]
    with_history = client.responses.create(
        model=DEFAULT_MODEL_ID,
        instructions="You are a geography teacher. Answer in one sentence.",
        input=history,
        temperature=0,
        max_output_tokens=20,
    )
    assert with_history.instructions == "You are a geography teacher. Answer in one sentence."
    assert with_history.output_text
    assert alone.usage is not None and with_history.usage is not None
    without_instructions = client.responses.create(
        model=DEFAULT_MODEL_ID, input=history, temperature=0, max_output_tokens=16
    )
    assert without_instructions.usage is not None
    # The earlier turns are part of the prompt (two more turns: well over 15 tokens), and
    # so are the instructions (they replace the template's default system prompt, so the
    # count changes rather than only grows).
    assert without_instructions.usage.input_tokens > alone.usage.input_tokens + 15
    assert with_history.usage.input_tokens != without_instructions.usage.input_tokens


def test_max_output_tokens_makes_an_incomplete_response(default_node: ExoNode) -> None:
    client = client_for(default_node)
    story = "Write a very long story about a dragon and a knight."
    response = client.responses.create(
        model=DEFAULT_MODEL_ID, input=story, temperature=0, max_output_tokens=16
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 16
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"

    events = list(
        client.responses.create(
            model=DEFAULT_MODEL_ID, input=story, temperature=0, max_output_tokens=16, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text


def test_errors_in_openai_shape(default_node: ExoNode) -> None:
    url = f"{default_node.url}/v1/responses"
    client = client_for(default_node)

    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="no/such-model", input=QUESTION)
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["code"] == "model_not_found"

    missing = httpx.post(url, json={"model": DEFAULT_MODEL_ID})
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "input"
    assert missing.json()["error"]["type"] == "invalid_request_error"

    wrong_type = httpx.post(url, json={"model": DEFAULT_MODEL_ID, "input": 42})
    assert wrong_type.status_code == 400

    malformed = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400

    refusals: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": "hi", "previous_response_id": "resp_0123"}, "previous_response_id"),
        # Hosted tools are left out (docs/compatibility.md, Codex); forcing one is refused.
        (
            {
                "input": "hi",
                "tools": [{"type": "web_search"}],
                "tool_choice": {"type": "web_search"},
            },
            "tool_choice",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "https://x/y.png"}],
                    }
                ]
            },
            "input[0].content[0]",
        ),
        (
            {
                "input": "hi",
                "text": {"format": {"type": "json_schema", "schema": {}}},
                "tools": [{"type": "function", "name": "f"}],
                "tool_choice": "required",
            },
            "text.format",
        ),
    ]
    for fields, param in refusals:
        refused = httpx.post(url, json={"model": DEFAULT_MODEL_ID, **fields})
        assert refused.status_code == 400, (fields, refused.text)
        error = refused.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert error["message"]

    with pytest.raises(openai.BadRequestError, match="does not store"):
        client.responses.create(
            model=DEFAULT_MODEL_ID, input=QUESTION, previous_response_id="resp_0123"
        )

    # Fields the SDK and Codex send are accepted, not refused.
    accepted = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input=QUESTION,
        temperature=0,
        max_output_tokens=16,  # OpenAI's least
        store=False,
        metadata={"k": "v"},
        include=["reasoning.encrypted_content"],
        truncation="disabled",
        user="tester",
        prompt_cache_key="key",
        service_tier="auto",
        text={"format": {"type": "text"}, "verbosity": "low"},
    )
    assert accepted.status in ("completed", "incomplete") and accepted.output_text


def test_function_call_round_trip(default_node: ExoNode) -> None:
    """Needs the engine's tool-call parsing and forced decoding for a named tool_choice."""
    client = client_for(default_node)
    first = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input="What is the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls, f"no function call in {first.output}"
    call = calls[0]
    assert call.name == "get_weather"
    assert isinstance(json.loads(call.arguments), dict)

    follow_up: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"},
    ]
    second = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input=follow_up,
        tools=[WEATHER_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert second.output_text.strip()
    assert not [item for item in second.output if item.type == "function_call"]
