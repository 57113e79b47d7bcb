"""A length cut inside a character, through every dialect of one real node: the text ends
with the last whole character (the unfinished one's bytes are dropped, never shown as
U+FFFD), and logprobs keep every token's exact bytes (issue 9, item 4)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from exo.worker.engines.torch.decoding.vocabulary import split_incomplete_utf8

PROMPT = "Repeat exactly: 你好 😀 ✓ 🇫🇷 👨\u200d👩\u200d👧 日本語"
MESSAGES: list[Any] = [{"role": "user", "content": PROMPT}]
# The greedy answer repeats the emoji: its first tokens hold several cuts inside one.
CALIBRATION_TOKENS = 40
# The cut is looked for at or past OpenAI Responses' smallest `max_output_tokens`.
SMALLEST_CUT = 16
REPLACEMENT = "\ufffd"


def no_replacement_character(raw_body: str) -> None:
    assert REPLACEMENT not in raw_body and "\\ufffd" not in raw_body.lower(), raw_body[-300:]


def cut_inside_a_character(node: ExoNode) -> tuple[int, str]:
    """A `max_tokens` whose cut falls inside a character of the greedy answer, and the text
    that must come back: found from one request's logprob bytes."""
    response = httpx.post(
        f"{node.url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID, "messages": MESSAGES, "temperature": 0,
            "max_tokens": CALIBRATION_TOKENS, "logprobs": True,
        },
        timeout=120,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    entries = response.json()["choices"][0]["logprobs"]["content"]
    token_bytes = [bytes(entry["bytes"]) for entry in entries]
    for max_tokens in range(len(token_bytes) - 1, SMALLEST_CUT - 1, -1):
        whole, unfinished = split_incomplete_utf8(b"".join(token_bytes[:max_tokens]))
        if unfinished:
            return max_tokens, whole.decode("utf-8")
    raise AssertionError(f"no cut falls inside a character: {response.json()}")


def test_a_cut_inside_a_character_drops_its_bytes_in_every_dialect(
    default_node: ExoNode,
) -> None:
    max_tokens, expected = cut_inside_a_character(default_node)
    assert expected, "the cut leaves whole characters before the unfinished one"
    url = default_node.url

    # OpenAI Chat Completions, with logprobs: their bytes hold the unfinished character.
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID, "messages": MESSAGES, "temperature": 0,
            "max_tokens": max_tokens, "logprobs": True,
        },
        timeout=120,
    )  # fmt: skip
    choice = chat.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == expected
    # A logprob's `token` may be part of a character (then U+FFFD); its bytes are exact.
    logprob_bytes = b"".join(bytes(entry["bytes"]) for entry in choice["logprobs"]["content"])
    assert logprob_bytes.startswith(expected.encode()) and len(logprob_bytes) > len(
        expected.encode()
    )

    # OpenAI Responses, streamed (an incomplete response ends with `response.incomplete`).
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    events = list(
        client.responses.create(
            model=DEFAULT_MODEL_ID, input=PROMPT, temperature=0, max_output_tokens=max_tokens,
            stream=True,
        )
    )  # fmt: skip
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert "".join(deltas) == expected
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == expected
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"

    # Claude Messages, streamed.
    claude = anthropic.Anthropic(base_url=url, api_key="unused", timeout=120, max_retries=0)
    with claude.messages.stream(
        model=DEFAULT_MODEL_ID,
        max_tokens=max_tokens,
        messages=MESSAGES,
        extra_body={"temperature": 0},
    ) as message_stream:
        pieces = list(message_stream.text_stream)
        message = message_stream.get_final_message()
    assert not any(REPLACEMENT in piece for piece in pieces)
    assert "".join(pieces) == expected
    assert message.stop_reason == "max_tokens"

    # Ollama, newline-delimited JSON.
    ollama_body = {
        "model": DEFAULT_MODEL_ID, "messages": MESSAGES, "stream": True,
        "options": {"temperature": 0, "num_predict": max_tokens},
    }  # fmt: skip
    lines = httpx.post(f"{url}/ollama/api/chat", json=ollama_body, timeout=120).text
    no_replacement_character(lines)
    parts = [json.loads(line) for line in lines.splitlines() if line.strip()]
    assert "".join(part["message"]["content"] for part in parts) == expected
    assert parts[-1]["done"] and parts[-1]["done_reason"] == "length"
