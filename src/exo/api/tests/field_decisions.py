"""The decisions `test_declared_fields` checks, their kinds and the bodies they share
(see that module's docstring).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exo.shared.types.commands import ComputeEmbeddings, GenerateText
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.text_generation import (
    ChatMessage,
    TextGenerationTaskParams,
    ToolCall,
)
from exo.testing.builders import SMOLLM2

README = Path(__file__).resolve().parents[4] / "README.md"
NO_OP_SECTION = "### Accepted and ignored"

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
CLAUDE = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
OLLAMA_CHAT = "/ollama/api/chat"
OLLAMA_GENERATE = "/ollama/api/generate"
OLLAMA_SHOW = "/ollama/api/show"
OLLAMA_PULL = "/ollama/api/pull"
OLLAMA_DELETE = "/ollama/api/delete"
EMBEDDINGS = "/v1/embeddings"
OLLAMA_EMBED = "/ollama/api/embed"
OLLAMA_EMBEDDINGS = "/ollama/api/embeddings"
RERANK = "/v1/rerank"
EMBEDDING_ENDPOINTS = (EMBEDDINGS, OLLAMA_EMBED, OLLAMA_EMBEDDINGS, RERANK)
RERANKER = "Qwen/Qwen3-Reranker-0.6B"
THINKING_MODEL = "Qwen/Qwen3-0.6B"  # a card with the "thinking" capability
"""The reranker the test app has placed beside SmolLM2."""

USER_HI = {"role": "user", "content": "hi"}
BASE_BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": SMOLLM2, "messages": [USER_HI], "max_tokens": 4},
    COMPLETIONS: {"model": SMOLLM2, "prompt": "hi", "max_tokens": 4},
    RESPONSES: {"model": SMOLLM2, "input": "hi", "max_output_tokens": 16},
    CLAUDE: {"model": SMOLLM2, "messages": [USER_HI], "max_tokens": 4},
    COUNT_TOKENS: {"model": SMOLLM2, "messages": [USER_HI]},
    OLLAMA_CHAT: {
        "model": SMOLLM2,
        "messages": [USER_HI],
        "stream": False,
        "options": {"num_predict": 4},
    },
    OLLAMA_GENERATE: {
        "model": SMOLLM2,
        "prompt": "hi",
        "stream": False,
        "options": {"num_predict": 4},
    },
    OLLAMA_SHOW: {},
    # The test app's models directory holds a prepared SmolLM2 (and nothing else).
    OLLAMA_PULL: {"model": SMOLLM2},
    OLLAMA_DELETE: {"model": "no-such-model"},
    EMBEDDINGS: {"model": SMOLLM2, "input": "hi"},
    OLLAMA_EMBED: {"model": SMOLLM2, "input": "hi"},
    OLLAMA_EMBEDDINGS: {"model": SMOLLM2, "prompt": "hi"},
    RERANK: {"model": RERANKER, "query": "q", "documents": ["a", "b", "c"]},
}
# The README line of each dialect's no-ops starts with its name in bold.
DIALECT_OF_ENDPOINT = {
    CHAT: "Chat Completions",
    COMPLETIONS: "Completions",
    RESPONSES: "Responses",
    CLAUDE: "Claude Messages",
    COUNT_TOKENS: "Claude Messages",
    OLLAMA_CHAT: "Ollama",
    OLLAMA_GENERATE: "Ollama",
    OLLAMA_SHOW: "Ollama",
    OLLAMA_PULL: "Ollama",
    OLLAMA_DELETE: "Ollama",
    EMBEDDINGS: "Embeddings",
    OLLAMA_EMBED: "Embeddings",
    OLLAMA_EMBEDDINGS: "Embeddings",
    RERANK: "Embeddings",
}

Params = TextGenerationTaskParams
Answer = dict[str, Any]


@dataclass(frozen=True)
class Effect:
    """`body` (merged over the endpoint's base body) reaches the engine with `check` true;
    the same request without `body`'s changes has `check` false (unless `always`, for
    required fields that the base body must carry)."""

    fields: tuple[str, ...]
    endpoint: str
    body: dict[str, Any]
    check: Callable[[Params], bool]
    always: bool = False


@dataclass(frozen=True)
class Shows:
    """`body` changes the HTTP answer: `check(answer)` is true, and false without it."""

    fields: tuple[str, ...]
    endpoint: str
    body: dict[str, Any]
    check: Callable[[Answer], bool]


@dataclass(frozen=True)
class Sends:
    """`body` changes the command sent to the cluster beyond the params (such as the
    instance's keep-alive): `check(command)` is true, and false without it."""

    fields: tuple[str, ...]
    endpoint: str
    body: dict[str, Any]
    check: Callable[[GenerateText | ComputeEmbeddings], bool]


def embedding_params(command: GenerateText | ComputeEmbeddings) -> EmbeddingTaskParams:
    """The params of an embeddings / rerank command (AssertionError for a generation)."""
    assert isinstance(command, ComputeEmbeddings)
    return command.params


@dataclass(frozen=True)
class Refused:
    """`body` is answered with a 400 whose message or `param` contains `names`."""

    fields: tuple[str, ...]
    endpoint: str
    body: dict[str, Any]
    names: str


@dataclass(frozen=True)
class NoOp:
    """`body` is accepted and reaches the engine exactly as `without` does; `listed_as` is
    written on the dialect's line of the README's no-op list."""

    fields: tuple[str, ...]
    endpoint: str
    body: dict[str, Any]
    listed_as: str
    without: dict[str, Any] = field(default_factory=dict)


Decision = Effect | Shows | Sends | Refused | NoOp


def fields(*names: str) -> tuple[str, ...]:
    return names


# ---------------------------------------------------------------- shared bodies

WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CHAT_TOOL = {"type": "function", "function": WEATHER}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CALL = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
CLAUDE_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}
OLLAMA_TOOL = {"type": "function", "function": WEATHER}


def last(params: Params) -> ChatMessage:
    return params.messages[-1]


def sampling_effects(endpoint: str, model: str, values: dict[str, Any]) -> list[Decision]:
    """One `Effect` per sampling field that reaches the params under the same name."""

    def check_for(name: str, value: Any) -> Callable[[Params], bool]:
        return lambda params: getattr(params, name) == value

    return [
        Effect(fields(f"{model}.{name}"), endpoint, {name: value}, check_for(name, value))
        for name, value in values.items()
    ]
