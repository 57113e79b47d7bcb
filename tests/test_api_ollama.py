"""One real `exo` node, driven through the official `ollama` client at `<node>/ollama`."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0, "num_predict": 40}


def client_for(node: ExoNode) -> ollama.Client:
    # The client appends `/api/chat` etc. to the host's path.
    return ollama.Client(host=f"{node.url}/ollama", timeout=120)


def test_chat_plain_and_streaming(default_node: ExoNode) -> None:
    client = client_for(default_node)
    answer = client.chat(model=DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY)
    assert answer.message.role == "assistant"
    assert answer.message.content and "Paris" in answer.message.content
    assert answer.done and answer.done_reason == "stop"
    assert answer.prompt_eval_count is not None and answer.prompt_eval_count > 5
    assert answer.eval_count is not None and answer.eval_count > 0
    assert answer.total_duration and answer.prompt_eval_duration and answer.eval_duration
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration

    parts = list(
        client.chat(model=DEFAULT_MODEL_ID, messages=QUESTION, options=GREEDY, stream=True)
    )
    assert "".join(part.message.content or "" for part in parts) == answer.message.content
    # More than one piece: the first token leaves alone (TTFT), later ones may be grouped
    # (`--stream-interval-ms`), so how many pieces depends on the decode speed.
    assert len(parts) >= 2, "streaming sends the answer piece by piece"
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "stop" and parts[-1].eval_count == answer.eval_count


def test_history_system_prompt_stop_and_length(default_node: ExoNode) -> None:
    client = client_for(default_node)
    messages = [
        {"role": "system", "content": "You are a helpful geography assistant."},
        *QUESTION,
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And what is the capital of Germany?"},
    ]
    answer = client.chat(model=DEFAULT_MODEL_ID, messages=messages, options=GREEDY)
    assert answer.message.content and "Berlin" in answer.message.content

    stopped = client.chat(
        model=DEFAULT_MODEL_ID, messages=QUESTION, options={**GREEDY, "stop": ["Paris"]}
    )
    assert stopped.message.content is not None and "Paris" not in stopped.message.content
    assert stopped.done_reason == "stop"

    limited = client.generate(
        model=DEFAULT_MODEL_ID,
        prompt="Write a long story about a dragon.",
        options={"temperature": 0, "num_predict": 5},
    )
    assert limited.done_reason == "length" and limited.eval_count == 5
    assert limited.response and limited.context is None


def test_generate_and_load(default_node: ExoNode) -> None:
    client = client_for(default_node)
    generated = client.generate(
        model=f"{DEFAULT_MODEL_ID}:latest",
        prompt="What is the capital of France? Answer in one sentence.",
        options=GREEDY,
    )
    assert generated.response and "Paris" in generated.response
    assert generated.model == f"{DEFAULT_MODEL_ID}:latest"
    loaded = client.generate(model=DEFAULT_MODEL_ID, prompt="")
    assert loaded.done and loaded.done_reason == "load"


def test_list_show_ps_version(default_node: ExoNode) -> None:
    client = client_for(default_node)
    listed = {model.model: model for model in client.list().models}
    assert DEFAULT_MODEL_ID in listed
    entry = listed[DEFAULT_MODEL_ID]
    assert entry.size and entry.size > 100_000_000 and entry.digest and len(entry.digest) == 64
    assert entry.details is not None and entry.details.family == "llama"

    shown = client.show(DEFAULT_MODEL_ID)
    assert shown.capabilities is not None and "completion" in shown.capabilities
    # The converted model keeps its tokenizer config, chat template included.
    assert shown.template and "im_start" in shown.template
    assert shown.modelinfo is not None and shown.modelinfo["llama.block_count"] == 30

    running = client.ps()
    assert DEFAULT_MODEL_ID in [model.model for model in running.models]

    version = httpx.get(f"{default_node.url}/ollama/api/version", timeout=10)
    assert version.status_code == 200 and version.json()["version"].startswith("0.")


def test_errors_in_ollama_shape(default_node: ExoNode) -> None:
    client = client_for(default_node)
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="no/such-model", messages=QUESTION)
    assert raised.value.status_code == 404
    assert raised.value.error == "model 'no/such-model' not found"

    base = f"{default_node.url}/ollama/api"
    missing_model = httpx.post(f"{base}/chat", json={"messages": QUESTION}, timeout=10)
    assert missing_model.status_code == 400 and set(missing_model.json()) == {"error"}
    wrong_type = httpx.post(
        f"{base}/chat", json={"model": DEFAULT_MODEL_ID, "messages": "hi"}, timeout=10
    )
    assert wrong_type.status_code == 400 and "messages" in wrong_type.json()["error"]
    images = httpx.post(
        f"{base}/chat",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": "what is this?", "images": ["aGk="]}],
        },
        timeout=10,
    )
    assert images.status_code == 400 and "vision" in images.json()["error"]
    # No messages: Ollama only loads the model and says so.
    empty = httpx.post(f"{base}/chat", json={"model": DEFAULT_MODEL_ID, "messages": []}, timeout=10)
    assert empty.status_code == 200 and empty.json()["done_reason"] == "load"


def test_tool_call_round_trip(default_node: ExoNode) -> None:
    """Needs the engine's forced tool calls: `tool_choice` (an exo extension to Ollama's
    API) constrains decoding to a call of the named tool."""
    tool = {
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
    messages: list[dict[str, object]] = [
        {"role": "user", "content": "What is the weather in Paris?"}
    ]
    response = httpx.post(
        f"{default_node.url}/ollama/api/chat",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": messages,
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "stream": False,
            "options": {"temperature": 0, "num_predict": 60},
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    message = response.json()["message"]
    calls = message.get("tool_calls")
    assert calls, f"no tool call in {json.dumps(message)}"
    assert calls[0]["function"]["name"] == "get_weather"
    assert isinstance(calls[0]["function"]["arguments"], dict)

    messages += [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 22 degrees Celsius"},
    ]
    final = client_for(default_node).chat(
        model=DEFAULT_MODEL_ID, messages=messages, tools=[tool], options=GREEDY
    )
    assert final.message.content and not final.message.tool_calls
