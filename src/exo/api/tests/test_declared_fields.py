"""Every field a dialect declares has a decision, and each decision is shown to hold.

The declared fields are found programmatically: every request model that a route of the app
takes as its body, and every model nested in one (messages, content parts, tools, options).
Each field must be covered by one of:

- `Effect`: a body that sets the field reaches the engine changed
  (`TextGenerationTaskParams`, captured by a scripted cluster) and the same body without
  the field does not, so the effect is visible;
- `Shows`: the field changes the HTTP answer itself (streaming, echoed settings);
- `Refused`: the field (or the value given) is answered with a 400 that names it;
- `NoOp`: the field is accepted and changes nothing, and it is on the README's short list
  of compatibility no-ops ("Accepted and ignored").

A new declared field without a decision fails `test_every_declared_field_has_a_decision`.
The request goes through the real app (routes, adapters, error handlers) over
`ScriptedCluster`; `count_tokens` is checked through its adapter (counting needs the
model's tokenizer on disk).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from loguru import logger
from pydantic import BaseModel

from exo.api.app import ROUTE_MODULES, create_app
from exo.api.claude_messages.request import count_tokens_params
from exo.api.claude_messages.wire_types import CountTokensRequest
from exo.api.ollama.wire_types import OllamaGenerateRequest, OllamaOptions
from exo.api.openai_completions.wire_types import CompletionRequest
from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.request_loading import LoadOnRequest
from exo.api.tests.field_decisions import (
    BASE_BODIES,
    CHAT,
    CLAUDE,
    COMPLETIONS,
    COUNT_TOKENS,
    DIALECT_OF_ENDPOINT,
    EMBEDDING_ENDPOINTS,
    NO_OP_SECTION,
    OLLAMA_CHAT,
    OLLAMA_DELETE,
    OLLAMA_GENERATE,
    OLLAMA_SHOW,
    README,
    RERANKER,
    RESPONSES,
    THINKING_MODEL,
    Answer,
    Decision,
    Effect,
    NoOp,
    Params,
    Refused,
    Sends,
    Shows,
)
from exo.api.tests.field_decisions_chat import chat_effects
from exo.api.tests.field_decisions_claude import claude_effects
from exo.api.tests.field_decisions_completions import completions_effects
from exo.api.tests.field_decisions_embeddings import embeddings_effects
from exo.api.tests.field_decisions_ollama import ollama_effects
from exo.api.tests.field_decisions_responses import responses_effects
from exo.download.pypi_gguf import COMPLETION_MARKER, CONVERSION_FORMAT, model_directory_name
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import ComputeEmbeddings, GenerateText
from exo.shared.types.common import ModelId
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

DECISIONS: list[Decision] = [
    *chat_effects(),
    *completions_effects(),
    *responses_effects(),
    *claude_effects(),
    *ollama_effects(),
    *embeddings_effects(),
]


# ---------------------------------------------------------------- declared fields


def _request_models(annotation: Any, found: dict[str, type[BaseModel]]) -> None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation.__name__ in found:
            assert found[annotation.__name__] is annotation, (
                f"two request models are named {annotation.__name__}; the table keys on names"
            )
            return
        found[annotation.__name__] = annotation
        for model_field in annotation.model_fields.values():
            _request_models(model_field.annotation, found)
        return
    for argument in typing.get_args(annotation):
        _request_models(argument, found)


def declared_fields() -> set[str]:
    """`Model.field` for every field of every request body model a dialect route takes
    (models from the dialects' `*_types` modules), nested models included."""
    found: dict[str, type[BaseModel]] = {}
    for module in ROUTE_MODULES:
        for route in module.router.routes:
            if not isinstance(route, APIRoute):
                continue
            for parameter in route.dependant.body_params:
                annotation = parameter.field_info.annotation
                module_name = getattr(annotation, "__module__", "")
                if module_name.startswith("exo.api.") and module_name.endswith("_types"):
                    _request_models(annotation, found)
    return {
        f"{name}.{field_name}" for name, model in found.items() for field_name in model.model_fields
    }


def test_every_declared_field_has_a_decision() -> None:
    declared = declared_fields()
    decided = {name for decision in DECISIONS for name in decision.fields}
    assert len(declared) > 250  # the walk found the dialects' models
    assert sorted(declared - decided) == [], "declared fields without a decision"
    assert sorted(decided - declared) == [], "decisions for fields that are not declared"


# ---------------------------------------------------------------- checking the decisions


@pytest.fixture(scope="module")
def prepared_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory holding a prepared SmolLM2 (a current conversion's completion
    marker only) and nothing else, so Ollama's pull finds it at once."""
    models = tmp_path_factory.mktemp("models")
    prepared = models / model_directory_name(SMOLLM2)
    prepared.mkdir()
    (prepared / COMPLETION_MARKER).write_text(json.dumps({"conversion": CONVERSION_FORMAT}))
    return models


@pytest.fixture(autouse=True)
def empty_models_directory(prepared_models: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Replaces the conftest's fixture of this name (a fresh empty directory per test), which
    hid the prepared one: every pull then fetched SmolLM2's wheel from PyPI and converted
    it in its own directory, and failed when PyPI did not answer in time. Only this
    module's directory is searched (no `EXO_MODELS_DIRS` of the machine's)."""
    monkeypatch.setenv("EXO_MODELS_DIR", str(prepared_models))
    monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
    monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
    return prepared_models


@pytest.fixture(scope="module")
def app(prepared_models: Path) -> Iterator[tuple[TestClient, ScriptedCluster]]:
    cluster = ScriptedCluster()
    cluster.add_model(load_builtin_cards()[ModelId(RERANKER)])
    cluster.add_model(load_builtin_cards()[ModelId(THINKING_MODEL)])
    # Offline: a pull that does not find the prepared model fails at once, never downloads.
    cluster.load_on_request = LoadOnRequest(offline=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_MODELS_DIR", str(prepared_models))
        with TestClient(
            create_app(cast(ClusterClient, cluster)), raise_server_exceptions=False
        ) as client:
            yield client, cluster


def body_of(endpoint: str, changes: dict[str, Any]) -> dict[str, Any]:
    return {**BASE_BODIES[endpoint], **changes}


def answer(client: TestClient, endpoint: str, body: dict[str, Any]) -> Answer:
    method = "DELETE" if endpoint == OLLAMA_DELETE else "POST"
    response = client.request(method, endpoint, json=body)
    result: Answer = {
        "status": response.status_code,
        "text": response.text,
        "headers": dict(response.headers),
    }
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        result["events"] = [
            json.loads(line.removeprefix("data: "))
            for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    elif response.headers.get("content-type", "").startswith("application/x-ndjson"):
        result["events"] = [json.loads(line) for line in response.text.splitlines() if line]
    elif response.content:
        result["json"] = response.json()
    return result


def params_for(
    app: tuple[TestClient, ScriptedCluster], endpoint: str, body: dict[str, Any]
) -> Params:
    client, cluster = app
    if endpoint == COUNT_TOKENS:
        return count_tokens_params(CountTokensRequest.model_validate(body))
    submitted = len(cluster.submitted)
    result = answer(client, endpoint, body)
    assert result["status"] == 200, result["text"]
    assert len(cluster.submitted) == submitted + 1
    return cluster.last_params


def embedding_command_for(
    app: tuple[TestClient, ScriptedCluster], endpoint: str, body: dict[str, Any]
) -> ComputeEmbeddings:
    client, cluster = app
    sent = len(cluster.embedding_commands)
    result = answer(client, endpoint, body)
    assert result["status"] == 200, result["text"]
    assert len(cluster.embedding_commands) == sent + 1
    return cluster.embedding_commands[-1]


def command_for(
    app: tuple[TestClient, ScriptedCluster], endpoint: str, body: dict[str, Any]
) -> GenerateText | ComputeEmbeddings:
    if endpoint in EMBEDDING_ENDPOINTS:
        return embedding_command_for(app, endpoint, body)
    params_for(app, endpoint, body)
    return app[1].submitted[-1]


def no_op_line(dialect: str) -> str:
    """The README's no-op list item of `dialect`, its wrapped lines joined."""
    text = README.read_text(encoding="utf-8")
    assert NO_OP_SECTION in text, "the README lists the accepted no-ops"
    section = text.split(NO_OP_SECTION, 1)[1].split("\n#", 1)[0]
    items: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            items.append(line)
        elif items and line.startswith("  "):
            items[-1] += " " + line.strip()
    matching = [item for item in items if item.startswith(f"- **{dialect}**")]
    assert len(matching) == 1, f"one README no-op item for {dialect}"
    return matching[0]


def holds(check: Callable[[Any], bool], observed: Any) -> bool:
    """`check(observed)`, False when what it looks for is not there at all (the base body
    has fewer messages, a JSON answer has no stream events)."""
    try:
        return check(observed)
    except (IndexError, KeyError, TypeError):
        return False


def _decision_id(decision: Decision) -> str:
    return f"{type(decision).__name__}-{decision.fields[0]}"


@pytest.mark.parametrize("decision", DECISIONS, ids=[_decision_id(d) for d in DECISIONS])
def test_decision_holds(decision: Decision, app: tuple[TestClient, ScriptedCluster]) -> None:
    client, _cluster = app
    endpoint = decision.endpoint
    match decision:
        case Effect():
            assert decision.check(params_for(app, endpoint, body_of(endpoint, decision.body)))
            if not decision.always:
                assert not holds(decision.check, params_for(app, endpoint, BASE_BODIES[endpoint]))
        case Shows():
            assert decision.check(answer(client, endpoint, body_of(endpoint, decision.body)))
            assert not holds(decision.check, answer(client, endpoint, BASE_BODIES[endpoint]))
        case Sends():
            assert decision.check(command_for(app, endpoint, body_of(endpoint, decision.body)))
            assert not decision.check(command_for(app, endpoint, BASE_BODIES[endpoint]))
        case Refused():
            result = answer(client, endpoint, body_of(endpoint, decision.body))
            assert result["status"] == 400, result["text"]
            error = result["json"]["error"]
            named = (
                error if isinstance(error, str) else f"{error.get('message')} {error.get('param')}"
            )
            assert decision.names in named, named
        case NoOp():
            assert decision.listed_as in no_op_line(DIALECT_OF_ENDPOINT[endpoint])
            with_field = body_of(endpoint, decision.body)
            without = body_of(endpoint, decision.without)
            if endpoint in EMBEDDING_ENDPOINTS:
                assert (
                    embedding_command_for(app, endpoint, with_field).params
                    == embedding_command_for(app, endpoint, without).params
                )
            elif endpoint == OLLAMA_SHOW:
                assert (
                    answer(client, endpoint, with_field)["json"]
                    == answer(client, endpoint, without)["json"]
                )
            else:
                assert params_for(app, endpoint, with_field) == params_for(app, endpoint, without)


# A bad `speculative` in each dialect: the body, and where the dialect's error puts its text.
BAD_SPECULATIVE = [
    (CHAT, {"speculative": "sometimes"}, "openai"),
    (COMPLETIONS, {"speculative": "sometimes"}, "openai"),
    (RESPONSES, {"speculative": 2}, "openai"),
    (CLAUDE, {"speculative": "always"}, "claude"),
    (OLLAMA_CHAT, {"options": {"num_predict": 4, "speculative": "sometimes"}}, "ollama"),
    (OLLAMA_GENERATE, {"options": {"num_predict": 4, "speculative": []}}, "ollama"),
]


@pytest.mark.parametrize(("endpoint", "body", "shape"), BAD_SPECULATIVE)
def test_a_bad_speculative_value_is_a_400_in_the_dialects_error_shape(
    app: tuple[TestClient, ScriptedCluster], endpoint: str, body: dict[str, Any], shape: str
) -> None:
    """The `Refused` decisions' answers, checked for each dialect's error body: OpenAI's
    `{"error": {"message", "type", "param"}}`, Anthropic's `{"type": "error", "error":
    {"type", "message"}}`, Ollama's `{"error": "<text>"}`; each names the field (OpenAI's
    in `param`; the sentence itself is the adapters', not checked here)."""
    client, _cluster = app
    result = answer(client, endpoint, body_of(endpoint, body))
    assert result["status"] == 400, result["text"]
    error = result["json"]["error"]
    match shape:
        case "openai":
            # OpenAI names the field in `param`; its `invalid_value` sentence for a string
            # outside the set ("Invalid value: 'sometimes'. Supported values are: ...") names
            # the values, its `invalid_type` sentence the field.
            assert error["type"] == "invalid_request_error" and error["param"] == "speculative"
            named = "'auto'" if error["code"] == "invalid_value" else "'speculative'"
            assert named in error["message"], error
        case "claude":
            assert result["json"]["type"] == "error"
            assert error["type"] == "invalid_request_error" and "speculative" in error["message"]
        case _:
            assert isinstance(error, str) and "speculative" in error, error


def test_unknown_fields_are_ignored_and_logged_at_debug_level(
    app: tuple[TestClient, ScriptedCluster],
) -> None:
    messages: list[str] = []
    sink = logger.add(lambda message: messages.append(str(message)), level="DEBUG")
    try:
        extra = {
            "prediction": {"type": "content", "content": "x"},
            "messages": [{"role": "user", "content": "hi", "x_trace": 1}],
        }
        params = params_for(app, CHAT, body_of(CHAT, extra))
    finally:
        logger.remove(sink)
    assert params == params_for(app, CHAT, BASE_BODIES[CHAT])
    assert any("of ChatCompletionRequest: prediction" in message for message in messages)
    assert any("of UserMessage: x_trace" in message for message in messages)


# ---------------------------------------------------------------- the docs' field tables

COMPATIBILITY = README.parent / "docs" / "compatibility.md"


def _table_section(title: str) -> str:
    text = COMPATIBILITY.read_text(encoding="utf-8")
    start = text.index(f"### {title}")
    end = text.find("\n#", start + 1)
    return text[start : end if end >= 0 else None]


@pytest.mark.parametrize(
    ("title", "models"),
    [
        ("Completions (`POST /v1/completions`)", (CompletionRequest,)),
        ("Ollama generate (`POST /api/generate`", (OllamaGenerateRequest, OllamaOptions)),
    ],
)
def test_every_declared_field_has_a_row_in_the_docs(
    title: str, models: tuple[type[BaseModel], ...]
) -> None:
    """docs/compatibility.md's table of a route names every field its request declares
    (an option by its own name in the `options.` rows)."""
    section = _table_section(title)
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    missing = [
        f"{model.__name__}.{name}"
        for model in models
        for name in model.model_fields
        if not any(f"`{name}`" in row or f"`options.{name}`" in row for row in rows)
    ]
    assert missing == []
