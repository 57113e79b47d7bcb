"""One real node with the default model: `logit_bias` changes the answer, and a JSON schema
given in each dialect's spelling constrains it (the official SDKs' own types where they
have them: anthropic 2.x `messages.parse` / `output_config`, openai's `json_schema`)."""

from __future__ import annotations

import json
from typing import Any, Literal

import anthropic
import httpx
import ollama
import openai
from pydantic import BaseModel

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

QUESTION = "What is the capital of France? Answer in one sentence."
# " Paris" is one token of SmolLM2's vocabulary (its greedy answer is "The capital of France
# is Paris.").
PARIS_TOKEN_ID = 7042
# Enums and booleans: the constraint fixes the keys and the value's shape, so a small model
# finishes well inside the token budget.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Berlin"]},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "is_capital"],
}


class Capital(BaseModel):
    city: Literal["Paris", "London", "Berlin"]
    is_capital: bool


def assert_follows_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "is_capital"}, text
    assert value["city"] in ("Paris", "London", "Berlin") and isinstance(value["is_capital"], bool)


def test_logit_bias_bans_a_token_of_the_greedy_answer(default_node: ExoNode) -> None:
    client = openai.OpenAI(base_url=f"{default_node.url}/v1", api_key="x", max_retries=0)

    def answer_tokens(**fields: Any) -> list[str]:
        completion = client.chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=16,
            logprobs=True,
            **fields,
        )
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.content is not None
        return [entry.token for entry in logprobs.content]

    plain = answer_tokens()
    assert " Paris" in plain, plain  # the effect below is visible
    biased = answer_tokens(logit_bias={str(PARIS_TOKEN_ID): -100})
    assert " Paris" not in biased, biased
    # Not a token id, or outside the vocabulary: a 400 naming the field.
    for bias in ({"Paris": -100}, {"49152": 5}):
        refused = httpx.post(
            f"{default_node.url}/v1/chat/completions",
            json={
                "model": DEFAULT_MODEL_ID,
                "messages": [{"role": "user", "content": QUESTION}],
                "logit_bias": bias,
            },
            timeout=60,
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "logit_bias"


def test_anthropic_sdk_2_output_config_format_and_effort(default_node: ExoNode) -> None:
    client = anthropic.Anthropic(
        base_url=default_node.url, api_key="unused", timeout=120.0, max_retries=0
    )
    question: list[Any] = [{"role": "user", "content": QUESTION}]
    # `parse` sends the model's JSON schema as `output_config.format`, merged with `effort`.
    parsed = client.messages.parse(
        model=DEFAULT_MODEL_ID,
        max_tokens=40,
        messages=question,
        output_format=Capital,
        output_config={"effort": "max"},
        # Greedy (anthropic 2.x has no temperature argument; the server reads the field):
        # sampled, the answer is another one on every run and may not close in 40 tokens.
        extra_body={"temperature": 0},
    )
    assert isinstance(parsed.parsed_output, Capital), parsed.content
    assert parsed.stop_reason == "end_turn"
    assert_follows_schema("".join(b.text for b in parsed.content if b.type == "text"))


def test_json_schema_in_the_openai_and_ollama_spellings(default_node: ExoNode) -> None:
    client = openai.OpenAI(base_url=f"{default_node.url}/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": QUESTION}]
    completion = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=messages,
        max_tokens=40,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": SCHEMA, "strict": True},
        },
    )
    assert completion.choices[0].finish_reason == "stop"
    assert_follows_schema(completion.choices[0].message.content or "")

    response = client.responses.create(
        model=DEFAULT_MODEL_ID,
        input=QUESTION,
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "capital", "schema": SCHEMA}},
    )
    assert response.status == "completed"
    assert_follows_schema(response.output_text)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"

    answer = ollama.Client(host=f"{default_node.url}/ollama").chat(
        model=DEFAULT_MODEL_ID,
        messages=messages,
        format=SCHEMA,
        options={"temperature": 0, "num_predict": 40},
    )
    assert answer.done_reason == "stop"
    assert_follows_schema(answer.message.content or "")
