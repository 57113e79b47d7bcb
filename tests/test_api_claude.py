"""One real `exo` node, driven through the official `anthropic` client (Claude Messages)."""

from __future__ import annotations

from typing import Any, cast

import anthropic
import httpx
import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

# anthropic 2.x's `create` has no sampling parameters any more (newer Claude models ignore
# them); exo honours them, so greedy decoding travels as an extra body field.
GREEDY = {"temperature": 0}
# Its greedy answer leads by >= 1.0 logit at every step, so a prefix-cache hit (int4 rounding
# differs by row count) cannot flip it; the bare question leads "The" over "L" by 0.125.
QUESTION: list[Any] = [
    {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
]


def client_for(node: ExoNode) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=node.url, api_key="unused", timeout=120.0, max_retries=0)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_tokens(usage: Any) -> int:
    """The whole prompt: Anthropic's input_tokens leaves out the cache reads."""
    return int(usage.input_tokens) + int(usage.cache_read_input_tokens or 0)


def test_create_stream_and_count_tokens_agree(default_node: ExoNode) -> None:
    client = client_for(default_node)
    message = client.messages.create(
        model=DEFAULT_MODEL_ID, max_tokens=30, extra_body=GREEDY, messages=QUESTION
    )
    assert message.id.startswith("msg_")
    assert message.type == "message" and message.role == "assistant"
    assert message.model == DEFAULT_MODEL_ID
    assert "Paris" in text_of(message)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.stop_sequence is None
    assert message.usage.output_tokens > 0

    with client.messages.stream(
        model=DEFAULT_MODEL_ID, max_tokens=30, extra_body=GREEDY, messages=QUESTION
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    # The prompt's size is known when the stream opens, as Anthropic reports it.
    [start] = [event for event in events if event.type == "message_start"]
    # A prefix-cache hit moves prompt tokens from input_tokens to cache_read_input_tokens.
    assert prompt_tokens(start.message.usage) == prompt_tokens(message.usage) > 5
    pieces = [event.text for event in events if event.type == "text"]
    assert "".join(pieces) == text_of(message)
    # More than one piece: the first token leaves alone (TTFT), later ones may be grouped
    # (`--stream-interval-ms`), so how many pieces depends on the decode speed.
    assert len(pieces) >= 2, "streaming sends the answer piece by piece"
    assert text_of(final) == text_of(message)
    assert final.stop_reason == message.stop_reason
    assert prompt_tokens(final.usage) == prompt_tokens(message.usage)
    assert final.usage.output_tokens == message.usage.output_tokens
    # The same prompt again: message_start splits it into cached and uncached tokens as the
    # final usage does (the runner knows the prefix-cache hit before the first token).
    cached = final.usage.cache_read_input_tokens or 0
    assert cached > 0
    assert start.message.usage.cache_read_input_tokens == cached
    assert start.message.usage.input_tokens == final.usage.input_tokens

    # count_tokens renders the prompt exactly as the engine did.
    counted = client.messages.count_tokens(model=DEFAULT_MODEL_ID, messages=QUESTION)
    assert counted.input_tokens == prompt_tokens(message.usage) > 5


def test_system_prompt_and_history_reach_the_prompt(default_node: ExoNode) -> None:
    client = client_for(default_node)
    history: list[Any] = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "text", "text": "Nice to meet you, Ada."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]},
    ]
    system = "You are a helpful assistant. Answer in one short sentence."
    message = client.messages.create(
        model=DEFAULT_MODEL_ID,
        max_tokens=20,
        extra_body=GREEDY,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        messages=history,
        metadata={"user_id": "test-user"},
    )
    assert message.content and message.usage.output_tokens > 0
    with_system = client.messages.count_tokens(
        model=DEFAULT_MODEL_ID, system=system, messages=history
    ).input_tokens
    without_system = client.messages.count_tokens(
        model=DEFAULT_MODEL_ID, messages=history
    ).input_tokens
    last_turn_only = client.messages.count_tokens(
        model=DEFAULT_MODEL_ID, messages=history[-1:]
    ).input_tokens
    longer_system = client.messages.count_tokens(
        model=DEFAULT_MODEL_ID, system=system + " Be kind and precise.", messages=history
    ).input_tokens
    assert prompt_tokens(message.usage) == with_system
    # (Without a system prompt, SmolLM2's template inserts a default one of its own.)
    assert longer_system > with_system != without_system
    assert without_system > last_turn_only


def test_max_tokens_and_stop_sequences(default_node: ExoNode) -> None:
    client = client_for(default_node)
    limited = client.messages.create(
        model=DEFAULT_MODEL_ID, max_tokens=3, extra_body=GREEDY, messages=QUESTION
    )
    assert limited.stop_reason == "max_tokens"
    assert limited.usage.output_tokens == 3

    stopped = client.messages.create(
        model=DEFAULT_MODEL_ID,
        max_tokens=30,
        extra_body=GREEDY,
        messages=QUESTION,
        stop_sequences=["Paris"],
    )
    assert "Paris" not in text_of(stopped)
    # Greedy, the answer names Paris: the stop string ends it and is reported.
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")


def test_errors_have_anthropic_statuses_and_shape(default_node: ExoNode) -> None:
    client = client_for(default_node)
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="no/such-model", max_tokens=5, messages=QUESTION)
    body = cast(dict[str, Any], not_found.value.body)
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no/such-model", messages=QUESTION)

    with pytest.raises(anthropic.BadRequestError) as empty:
        client.messages.create(model=DEFAULT_MODEL_ID, max_tokens=5, messages=[])
    assert cast(dict[str, Any], empty.value.body)["error"]["type"] == "invalid_request_error"

    image: Any = {
        "role": "user",
        "content": [
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
            }
        ],
    }
    with pytest.raises(anthropic.BadRequestError, match="image input"):
        client.messages.create(model=DEFAULT_MODEL_ID, max_tokens=5, messages=[image])
    with pytest.raises(anthropic.BadRequestError, match="server tool"):
        client.messages.create(
            model=DEFAULT_MODEL_ID,
            max_tokens=5,
            messages=QUESTION,
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )

    # The SDK will not send these; raw HTTP does.
    for broken in (
        {"model": DEFAULT_MODEL_ID, "messages": QUESTION},  # no max_tokens
        {"model": DEFAULT_MODEL_ID, "max_tokens": "many", "messages": QUESTION},
    ):
        response = httpx.post(f"{default_node.url}/v1/messages", json=broken, timeout=30)
        assert response.status_code == 400
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "invalid_request_error"


WEATHER_TOOL: Any = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name"}},
        "required": ["city"],
    },
}


def test_tool_round_trip(default_node: ExoNode) -> None:
    """Needs the engine's forced tool calls (tool_choice naming a tool)."""
    client = client_for(default_node)
    question: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(
        model=DEFAULT_MODEL_ID,
        max_tokens=60,
        extra_body=GREEDY,
        messages=question,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert called.stop_reason == "tool_use"
    calls = [block for block in called.content if block.type == "tool_use"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(calls[0].input, dict)

    answer = client.messages.create(
        model=DEFAULT_MODEL_ID,
        max_tokens=30,
        extra_body=GREEDY,
        tools=[WEATHER_TOOL],
        messages=[
            *question,
            {"role": "assistant", "content": cast(Any, called.content)},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": calls[0].id,
                        "content": "Sunny, 24 degrees Celsius.",
                    }
                ],
            },
        ],
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert text_of(answer).strip()
