"""One real node: the default model's short name works in all four dialects, and the model
listings describe what the node serves."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

SHORT_NAME = "smollm2:135m"
QUESTION = "What is the capital of France? Answer in one sentence."


def test_short_name_in_every_dialect(default_node: ExoNode) -> None:
    client = openai.OpenAI(
        base_url=f"{default_node.url}/v1", api_key="x", timeout=120, max_retries=0
    )
    chat = client.chat.completions.create(
        model=SHORT_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=12,
    )
    assert "Paris" in (chat.choices[0].message.content or "") and chat.model == DEFAULT_MODEL_ID
    response = client.responses.create(
        model="smollm2-135m", input=QUESTION, temperature=0, max_output_tokens=16
    )
    assert "Paris" in response.output_text and response.model == DEFAULT_MODEL_ID

    claude = anthropic.Anthropic(base_url=default_node.url, api_key="x", timeout=120, max_retries=0)
    message = claude.messages.create(
        model=SHORT_NAME,
        max_tokens=12,
        messages=[{"role": "user", "content": QUESTION}],
        # anthropic 2.x has no temperature argument; the server still reads the field.
        extra_body={"temperature": 0},
    )
    assert message.content[0].type == "text" and "Paris" in message.content[0].text

    local = ollama.Client(host=f"{default_node.url}/ollama", timeout=120)
    answer = local.chat(
        model=SHORT_NAME,
        messages=[{"role": "user", "content": QUESTION}],
        options={"temperature": 0, "num_predict": 12},
    )
    assert answer.model == SHORT_NAME and "Paris" in (answer.message.content or "")
    shown = local.show(SHORT_NAME)
    assert shown.capabilities == ["completion", "tools"]

    # OpenAI clients' models.retrieve; the id's slash may arrive encoded.
    assert client.models.retrieve(DEFAULT_MODEL_ID).id == DEFAULT_MODEL_ID
    encoded = httpx.get(
        f"{default_node.url}/v1/models/{DEFAULT_MODEL_ID.replace('/', '%2F')}", timeout=10
    )
    assert encoded.status_code == 200 and encoded.json()["id"] == DEFAULT_MODEL_ID
    assert DEFAULT_MODEL_ID in [model.id for model in client.models.list()]
    downloaded = httpx.get(
        f"{default_node.url}/models", params={"status": "downloaded"}, timeout=10
    ).json()
    assert DEFAULT_MODEL_ID in [card["model_id"] for card in downloaded]
