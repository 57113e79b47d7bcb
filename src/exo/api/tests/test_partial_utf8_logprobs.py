"""Logprobs of tokens that end inside a UTF-8 character, with SmolLM2's byte-level BPE
tokenizer: "✓" and "😀" are each split over tokens whose bytes alone are no character.

OpenAI writes such a token's string as its bytes escaped, `"\\xe2\\x9c"`, next to the exact
`bytes` on Chat Completions (and Responses), and as `"bytes:\\xe2\\x9c"` in the legacy
Completions `tokens` and `top_logprobs` keys, never as "\ufffd" (which would merge
distinct tokens). The generation's chunks are scripted as the engine sends them (an
unfinished character holds its text back) and go through the real app over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import Chunk, TokenChunk, TokenLogprob, TopLogprob, Usage
from exo.shared.types.common import CommandId
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster
from exo.worker.engines.torch.decoding.vocabulary import TokenVocabulary

# Shared with the engine tests' fixtures: SmolLM2 converted once from PyPI.
TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    directory = prepare_model(load_builtin_cards()[SMOLLM2], TEST_MODELS_DIR, offline=False)
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="module")
def vocabulary(tokenizer: Any) -> TokenVocabulary:
    return TokenVocabulary(tokenizer, len(tokenizer))


def ids_of(tokenizer: Any, text: str) -> list[int]:
    token_ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return token_ids


class LogprobCluster(ScriptedCluster):
    """Answers every generation with `script`: (chunk text, token ids) pairs."""

    def __init__(
        self,
        vocabulary: TokenVocabulary,
        script: Sequence[tuple[str, list[int]]],
        alternatives: Sequence[int],
    ) -> None:
        super().__init__()
        self.vocabulary = vocabulary
        self.script = script
        self.alternatives = alternatives  # every position's top logprobs

    def entry(self, token_id: int) -> TokenLogprob:
        vocabulary = self.vocabulary
        return TokenLogprob(
            token=vocabulary.text(token_id),
            token_id=token_id,
            logprob=-0.5,
            bytes=tuple(vocabulary.token_bytes[token_id]),
            top_logprobs=tuple(
                TopLogprob(
                    token=vocabulary.text(other),
                    token_id=other,
                    logprob=-1.0 - index,
                    bytes=tuple(vocabulary.token_bytes[other]),
                )
                for index, other in enumerate(self.alternatives)
            ),
        )

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        for index, (text, token_ids) in enumerate(self.script):
            last = index == len(self.script) - 1
            yield TokenChunk(
                command_id=command_id,
                model=SMOLLM2,
                text=text,
                token_ids=tuple(token_ids),
                logprobs=tuple(self.entry(token_id) for token_id in token_ids),
                finish_reason="stop" if last else None,
                usage=Usage(prompt_tokens=5, completion_tokens=7) if last else None,
            )


@pytest.fixture(scope="module")
def app(tokenizer: Any, vocabulary: TokenVocabulary) -> Iterator[tuple[TestClient, list[int]]]:
    """ "A✓😀!": "✓"'s first token alone in a chunk (its text held back), its second in the
    next, all of "😀" and "!" in one chunk."""
    a, check, smile, bang = (ids_of(tokenizer, text) for text in ("A", "✓", "😀", "!"))
    assert (len(a), len(check), len(smile), len(bang)) == (1, 2, 3, 1)
    script = [("A", a), ("", check[:1]), ("✓", check[1:]), ("😀!", smile + bang)]
    # The alternatives: the first bytes of "😀" and of "✓" (both partial).
    cluster = LogprobCluster(vocabulary, script, alternatives=[smile[0], check[0]])
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        yield client, a + check + smile + bang


def escaped(raw: bytes, prefix: str = "") -> str:
    return prefix + "".join(f"\\x{byte:02x}" if byte >= 0x80 else chr(byte) for byte in raw)


def expected_tokens(vocabulary: TokenVocabulary, token_ids: list[int], prefix: str) -> list[str]:
    return [
        vocabulary.text(token_id)
        if vocabulary.text(token_id) != "\ufffd"
        else escaped(vocabulary.token_bytes[token_id], prefix)
        for token_id in token_ids
    ]


CHAT_BODY = {
    "model": SMOLLM2,
    "messages": [{"role": "user", "content": "hi"}],
    "logprobs": True,
    "top_logprobs": 2,
}


def sse_events(response: Any) -> list[dict[str, Any]]:
    """The JSON events of a streamed (server-sent events) response body, in order."""
    return [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: {")
    ]


def chat_entries(client: TestClient, stream: bool) -> list[dict[str, Any]]:
    response = client.post("/v1/chat/completions", json={**CHAT_BODY, "stream": stream})
    assert response.status_code == 200, response.text
    if not stream:
        entries: list[dict[str, Any]] = response.json()["choices"][0]["logprobs"]["content"]
        return entries
    entries = []
    for event in sse_events(response):
        choices = event["choices"]
        if choices and choices[0].get("logprobs"):
            entries.extend(choices[0]["logprobs"]["content"])
    return entries


@pytest.mark.parametrize("stream", [False, True])
def test_chat_writes_a_partial_token_as_its_escaped_bytes(
    app: tuple[TestClient, list[int]], vocabulary: TokenVocabulary, stream: bool
) -> None:
    client, token_ids = app
    entries = chat_entries(client, stream)
    assert [entry["token"] for entry in entries] == expected_tokens(vocabulary, token_ids, "")
    assert [entry["token"] for entry in entries][1:3] == ["\\xe2\\x9c", "\\x93"]
    assert bytes(byte for entry in entries for byte in entry["bytes"]).decode() == "A✓😀!"
    alternatives = [top["token"] for top in entries[0]["top_logprobs"]]
    assert alternatives == ["\\xf0\\x9f", "\\xe2\\x9c"]
    assert all("\ufffd" not in entry["token"] for entry in entries)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_writes_a_partial_token_as_its_escaped_bytes(
    app: tuple[TestClient, list[int]], vocabulary: TokenVocabulary, stream: bool
) -> None:
    """The token alone in a chunk without text keeps its entry (it goes with the next
    text delta)."""
    client, token_ids = app
    body = {"model": SMOLLM2, "input": "hi", "top_logprobs": 2, "stream": stream}
    response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response)
        deltas = [event for event in events if event["type"] == "response.output_text.delta"]
        assert all(delta["delta"] for delta in deltas)
        entries = [entry for delta in deltas for entry in delta["logprobs"]]
    else:
        output = response.json()["output"]
        message = next(item for item in output if item["type"] == "message")
        entries = message["content"][0]["logprobs"]
    assert [entry["token"] for entry in entries] == expected_tokens(vocabulary, token_ids, "")
    assert [top["token"] for top in entries[1]["top_logprobs"]] == ["\\xf0\\x9f", "\\xe2\\x9c"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_write_bytes_tokens_and_offsets_by_character(
    app: tuple[TestClient, list[int]], vocabulary: TokenVocabulary, stream: bool
) -> None:
    client, token_ids = app
    body = {"model": SMOLLM2, "prompt": "hi", "logprobs": 2, "stream": stream}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        parts = [event["choices"][0] for event in sse_events(response)]
        text = "".join(part["text"] for part in parts)
        logprobs = [part["logprobs"] for part in parts if part.get("logprobs")]
        tokens = [token for part in logprobs for token in part["tokens"]]
        offsets = [offset for part in logprobs for offset in part["text_offset"]]
        tops = [top for part in logprobs for top in part["top_logprobs"]]
    else:
        choice = response.json()["choices"][0]
        text = choice["text"]
        tokens = choice["logprobs"]["tokens"]
        offsets = choice["logprobs"]["text_offset"]
        tops = choice["logprobs"]["top_logprobs"]
    assert text == "A✓😀!"
    assert tokens == expected_tokens(vocabulary, token_ids, "bytes:")
    assert tokens[1:3] == ["bytes:\\xe2\\x9c", "bytes:\\x93"]
    # Each token starts where its character does: "✓" at 1, "😀" at 2, "!" at 3.
    assert offsets == [0, 1, 1, 2, 2, 2, 3]
    # Distinct partial tokens stay distinct keys (with "\ufffd" they were one).
    assert tops[0] == {"bytes:\\xf0\\x9f": -1.0, "bytes:\\xe2\\x9c": -2.0, "A": -0.5}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("answer", ["A✓", ""])
def test_responses_keep_the_logprobs_of_a_character_the_generation_did_not_finish(
    tokenizer: Any, vocabulary: TokenVocabulary, stream: bool, answer: str
) -> None:
    """A generation that ends inside "😀" (max_output_tokens reached after its first token)
    drops that character's bytes from the text; its token's logprob stays, in a last delta
    without text, as Chat Completions keeps it (before, the response lost it, or had no
    message at all when that token was the whole answer)."""
    script = [(text, ids_of(tokenizer, text)) for text in [answer] if text]
    script.append(("", ids_of(tokenizer, "😀")[:1]))
    token_ids = [token_id for _, ids in script for token_id in ids]
    cluster = LogprobCluster(vocabulary, script, alternatives=[])
    with TestClient(create_app(cast(ClusterClient, cluster))) as client:
        body = {"model": SMOLLM2, "input": "hi", "top_logprobs": 1, "stream": stream}
        response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response)
        deltas = [event for event in events if event["type"] == "response.output_text.delta"]
        assert "".join(delta["delta"] for delta in deltas) == answer
        entries = [entry for delta in deltas for entry in delta["logprobs"]]
        done = next(event for event in events if event["type"] == "response.output_text.done")
        assert done["logprobs"] == entries
        output = events[-1]["response"]["output"]
    else:
        output = response.json()["output"]
    message = next(item for item in output if item["type"] == "message")
    assert message["content"][0]["text"] == answer
    if not stream:
        entries = message["content"][0]["logprobs"]
    assert message["content"][0]["logprobs"] == entries
    assert [entry["token"] for entry in entries] == expected_tokens(vocabulary, token_ids, "")
    assert entries[-1]["token"] == "\\xf0\\x9f"
