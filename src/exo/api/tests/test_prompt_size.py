"""A generation too large for its model's context is refused before anything is placed or
sent to the master (`exo.api.serving.prompt_size`), in each dialect's own error shape; a prompt
that fills the context is accepted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.prompt_size import (
    MAX_PROMPT_BYTES_PER_TOKEN,
    check_prompt_size,
    prompt_byte_limit,
)
from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.testing.builders import SMOLLM2, smollm2_card
from exo.testing.scripted_cluster import ScriptedCluster

TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"  # shared with the engine tests
LIMIT = prompt_byte_limit(smollm2_card())
TOO_LONG = "word " * (LIMIT // 5 + 1)
# A prompt of the whole context at 4 bytes per token (English text's average).
FULL_CONTEXT = "word " * (smollm2_card().context_length * 4 // 5)


@pytest.fixture
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture
def http(cluster: ScriptedCluster) -> Iterator[TestClient]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client


def test_the_limit_follows_the_context_length() -> None:
    assert smollm2_card().context_length * MAX_PROMPT_BYTES_PER_TOKEN == LIMIT


def test_too_large_for_the_context_is_a_400_in_each_dialect(
    http: TestClient, cluster: ScriptedCluster
) -> None:
    messages = [{"role": "user", "content": TOO_LONG}]
    chat = http.post("/v1/chat/completions", json={"model": SMOLLM2, "messages": messages})
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    assert f"no request over {LIMIT} bytes" in error["message"]

    legacy = http.post("/v1/completions", json={"model": SMOLLM2, "prompt": TOO_LONG})
    assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "prompt"

    claude = http.post(
        "/v1/messages", json={"model": SMOLLM2, "max_tokens": 4, "messages": messages}
    )
    assert claude.status_code == 400, claude.text
    body = claude.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "shorten the prompt" in body["error"]["message"]

    ollama = http.post(
        "/ollama/api/chat", json={"model": SMOLLM2, "messages": messages, "stream": False}
    )
    assert ollama.status_code == 400, ollama.text
    assert "shorten the prompt" in ollama.json()["error"]

    responses = http.post("/v1/responses", json={"model": SMOLLM2, "input": TOO_LONG})
    assert responses.status_code == 400, responses.text
    # Nothing reached the cluster.
    assert cluster.submitted == []


def test_a_prompt_that_fills_the_context_is_sent(
    http: TestClient, cluster: ScriptedCluster
) -> None:
    messages = [{"role": "user", "content": FULL_CONTEXT}]
    chat = http.post("/v1/chat/completions", json={"model": SMOLLM2, "messages": messages})
    assert chat.status_code == 200, chat.text
    assert cluster.last_params.messages[-1].content == FULL_CONTEXT


def test_a_prompt_of_separator_lines_that_fits_the_context_is_not_refused() -> None:
    # SmolLM2's vocabulary holds runs of up to 81 '#', '=', '-' or spaces: 1,300 lines of 240
    # '#' are 313,300 bytes in 6,500 tokens (48 bytes a token), inside the 8,192-token
    # context; the bound of 32 bytes a token refused them (a new-user trial).
    card = load_builtin_cards()[SMOLLM2]
    directory = prepare_model(card, TEST_MODELS_DIR, offline=False)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompt = ("#" * 240 + "\n") * 1300
    assert len(tokenizer.encode(prompt).ids) + 16 < card.context_length  # it fits
    check_prompt_size(TextGenerationTaskParams(model=SMOLLM2, prompt=prompt, max_tokens=8), card)
