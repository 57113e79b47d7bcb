"""One real `exo` node serves embeddings from its chat model (SmolLM2, mean-pooled) through
the official `openai` and `ollama` clients, and refuses what it must with each dialect's
400; two concurrent requests get what each gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import ollama
import openai
import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

TEXTS = ["The capital of France is Paris.", "Gravity pulls two bodies together."]
HIDDEN = 576  # SmolLM2-135M's hidden size


def _openai(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120)


def _cosine(a: list[float], b: list[float]) -> float:
    first, second = np.asarray(a), np.asarray(b)
    return float(first @ second / np.linalg.norm(first) / np.linalg.norm(second))


def test_openai_embeddings_float_base64_and_token_ids(default_node: ExoNode) -> None:
    client = _openai(default_node)
    floats = client.embeddings.create(model=DEFAULT_MODEL_ID, input=TEXTS, encoding_format="float")
    assert [item.index for item in floats.data] == [0, 1]
    vectors = [item.embedding for item in floats.data]
    assert all(len(vector) == HIDDEN for vector in vectors)
    assert all(abs(np.linalg.norm(vector) - 1) < 1e-5 for vector in vectors)
    assert floats.usage.prompt_tokens > 10
    assert _cosine(vectors[0], vectors[1]) < 0.9999  # different texts, different vectors
    # The SDK's default: it asks for base64 and decodes it itself.
    sdk = client.embeddings.create(model=DEFAULT_MODEL_ID, input=TEXTS)
    assert all(
        np.allclose(np.asarray(item.embedding, dtype=np.float32), vector, atol=1e-6)
        for item, vector in zip(sdk.data, vectors, strict=True)
    )
    tokens = client.embeddings.create(model=DEFAULT_MODEL_ID, input=[[1, 2, 3], [4, 5]])
    assert len(tokens.data) == 2 and tokens.usage.prompt_tokens == 5


def test_openai_embeddings_refusals(default_node: ExoNode) -> None:
    client = _openai(default_node)
    for kwargs, param in [
        ({"input": []}, "input"),
        ({"input": "hi", "dimensions": 64}, "dimensions"),
        ({"input": "hello " * 9000}, "input"),  # over the 8192-token context
    ]:
        with pytest.raises(openai.BadRequestError) as raised:
            client.embeddings.create(model=DEFAULT_MODEL_ID, **kwargs)  # type: ignore[arg-type]
        body = raised.value.body
        assert isinstance(body, dict) and body["param"] == param, (kwargs, body)
        if "dimensions" not in kwargs and kwargs["input"]:
            assert body["code"] == "context_length_exceeded"
            assert body["message"].startswith(
                "Invalid 'input': maximum context length is 8192 tokens."
            )
    rerank = httpx.post(
        f"{default_node.url}/v1/rerank",
        json={"model": DEFAULT_MODEL_ID, "query": "q", "documents": ["a"]},
        timeout=30,
    )
    assert rerank.status_code == 400
    assert '"rerank" capability' in rerank.json()["error"]["message"]


def test_ollama_embed_legacy_and_over_context(default_node: ExoNode) -> None:
    client = ollama.Client(host=f"{default_node.url}/ollama", timeout=120)
    answer = client.embed(model=DEFAULT_MODEL_ID, input=TEXTS)
    assert len(answer.embeddings) == 2 and len(answer.embeddings[0]) == HIDDEN
    assert answer.prompt_eval_count and answer.prompt_eval_count > 10
    legacy = client.embeddings(model=DEFAULT_MODEL_ID, prompt=TEXTS[0])
    assert _cosine(list(legacy.embedding), answer.embeddings[0]) > 1 - 1e-6
    with pytest.raises(ollama.ResponseError) as raised:
        client.embed(model=DEFAULT_MODEL_ID, input="hello " * 9000, truncate=False)
    assert raised.value.status_code == 400
    assert raised.value.error.startswith("the input length exceeds the context length")


@pytest.mark.slow  # six forwards; the engine's batch = alone check is in test_embedding.py
def test_concurrent_requests_equal_each_alone(default_node: ExoNode) -> None:
    client = _openai(default_node)
    alone = [
        client.embeddings.create(model=DEFAULT_MODEL_ID, input=text, encoding_format="float")
        .data[0]
        .embedding
        for text in TEXTS
    ]
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(
                lambda text: (
                    client.embeddings.create(
                        model=DEFAULT_MODEL_ID, input=text, encoding_format="float"
                    )
                    .data[0]
                    .embedding
                ),
                TEXTS * 2,
            )
        )
    for index, vector in enumerate(together):
        assert _cosine(vector, alone[index % 2]) > 1 - 1e-5
