"""Chat Completions features on a live node with the default model, through the official
`openai` client: a tool-call round trip, logprobs, JSON mode, penalties, cancellation by id."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from exo.worker.engines.torch.batching.scheduler import PREFILL_TOKENS_PER_IDLE_STEP

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
# Text pieces a cancelled stream may still deliver: those already generated or in flight.
CANCEL_SLACK_PIECES = 200


def client_for(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_tool_call_round_trip(default_node: ExoNode) -> None:
    client = client_for(default_node)
    first = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[QUESTION],  # type: ignore[list-item]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict) and isinstance(arguments.get("city"), str)

    # The same call streamed: one tool-call delta with the whole call.
    streamed = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[QUESTION],  # type: ignore[list-item]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="required",
        temperature=0,
        max_tokens=60,
        stream=True,
    )
    deltas = [chunk.choices[0] for chunk in streamed if chunk.choices]
    calls = [call for delta in deltas for call in delta.delta.tool_calls or []]
    assert [c.function.name for c in calls if c.function] == ["get_weather"]
    assert deltas[-1].finish_reason == "tool_calls"

    final = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[
            QUESTION,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
        ],  # type: ignore[list-item]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    answer = final.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")


def test_logprobs_json_mode_and_penalties(default_node: ExoNode) -> None:
    client = client_for(default_node)
    completion = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
        ],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = choice.logprobs.content
    assert "".join(entry.token for entry in entries) == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)

    json_reply = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        # Keys named: asked for "a JSON object" alone, the 135M model's greedy answer may
        # repeat ever longer keys until max_tokens (seen after its LM head became exact).
        messages=[
            {
                "role": "user",
                "content": 'Describe Paris as a JSON object with the keys "name", "country" '
                'and "population".',
            }
        ],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    assert json_reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(json_reply.choices[0].message.content or ""), dict)

    repeat = [{"role": "user", "content": "Repeat the word 'cat' twenty times."}]
    plain = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=repeat,
        temperature=0,
        max_tokens=30,  # type: ignore[arg-type]
    )
    penalised = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=repeat,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=30,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    plain_text = plain.choices[0].message.content or ""
    penalised_text = penalised.choices[0].message.content or ""
    assert plain_text != penalised_text
    assert penalised_text.lower().count("cat") < plain_text.lower().count("cat")


def test_cancel_by_response_id(default_node: ExoNode) -> None:
    client = client_for(default_node)
    # Greedy: the long story is the same on every run (sampled, a short answer could end
    # before the cancel arrives).
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        temperature=0,
        max_tokens=2000,
        stream=True,
    )
    cancelled = False
    pieces_after_cancel = 0
    with pytest.raises(openai.APIError, match="cancelled"):
        for chunk in stream:
            if not (chunk.choices and chunk.choices[0].delta.content):
                continue
            if cancelled:
                pieces_after_cancel += 1
                continue
            response = httpx.post(f"{default_node.url}/v1/cancel/{chunk.id}", timeout=10)
            assert response.status_code == 200, response.text
            cancelled = True
    # The generation stops within a few tokens of the cancel, far short of its 2000 (counted
    # in tokens, not seconds, so a loaded machine does not change the outcome).
    assert cancelled and pieces_after_cancel < CANCEL_SLACK_PIECES, pieces_after_cancel
    unknown = httpx.post(f"{default_node.url}/v1/cancel/chatcmpl-{'0' * 32}", timeout=10)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "generation_not_found"


def test_a_stream_reports_its_prefill_before_the_first_token(default_node: ExoNode) -> None:
    """A prompt that takes more than one prefill step is reported after each step until
    its first token: the stream carries those reports as `: prefill {...}` comment lines
    (what the dashboard's chat shows) before the first token. (The official client skips
    them: `src/exo/api/tests/test_chat_completions_client.py`.)"""
    long_question = "Summarise this: " + "the cat sat on the mat. " * 90
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": long_question}],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{default_node.url}/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    events = [
        json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")
    ]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] > PREFILL_TOKENS_PER_IDLE_STEP  # two steps at least
    comments = [line for line in lines if line.startswith(": prefill ")]
    assert comments, lines[:5]
    progress = [json.loads(line.removeprefix(": prefill ")) for line in comments]
    assert {report["prompt_tokens"] for report in progress} == {usage["prompt_tokens"]}
    assert all(0 <= report["prefilled_tokens"] <= usage["prompt_tokens"] for report in progress)
    first_token = next(
        index
        for index, line in enumerate(lines)
        if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line
    )
    assert lines.index(comments[0]) < first_token
