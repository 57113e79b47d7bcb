"""Strict request types: every dialect refuses a value of another JSON type where its
reference API does (OpenAI and Anthropic: a string, boolean or decimal for an integer, a
string or boolean for a number, anything but `true`/`false` for a boolean; Ollama the same
through Go's JSON decoding, except that its integer options take any number), with a 400
naming the field in the reference's words."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from exo.api.app import create_app
from exo.api.claude_messages.wire_types import MessagesRequest
from exo.api.embeddings.wire_types import EmbeddingRequest, OllamaEmbedRequest
from exo.api.ollama.wire_types import OllamaChatRequest, OllamaGenerateRequest, OllamaOptions
from exo.api.openai_chat.wire_types import ChatCompletionRequest
from exo.api.openai_completions.wire_types import CompletionRequest
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.serving.cluster_client import ClusterClient
from exo.api.tests.serving import scripted_app
from exo.api.wire.errors import SCALAR_TYPE_ERRORS
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    # Validation runs before any handler: no refused request reaches the cluster.
    with TestClient(create_app(cast(ClusterClient, object()))) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("path", "extra", "message", "param"),
    [
        ("/v1/chat/completions", {"stream": "yes"},
         "Invalid type for 'stream': expected a boolean, but got a string instead.", "stream"),
        ("/v1/chat/completions", {"max_tokens": "12"},
         "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
         "max_tokens"),
        ("/v1/chat/completions", {"temperature": "0.5"},
         "Invalid type for 'temperature': expected a decimal, but got a string instead.",
         "temperature"),
        ("/v1/chat/completions", {"n": True},
         "Invalid type for 'n': expected an integer, but got a boolean instead.", "n"),
        ("/v1/chat/completions", {"seed": 1.5},
         "Invalid type for 'seed': expected an integer, but got a decimal number instead.",
         "seed"),
        ("/ollama/v1/chat/completions", {"stream": 1},
         "Invalid type for 'stream': expected a boolean, but got an integer instead.", "stream"),
    ],
)  # fmt: skip
def test_openai_words_a_wrong_type_as_openai_does(
    http: TestClient, path: str, extra: dict[str, Any], message: str, param: str
) -> None:
    answer = http.post(path, json={"model": SMOLLM2, "messages": MESSAGES, **extra})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_type",
    }


@pytest.mark.parametrize(
    ("path", "extra", "value", "supported", "param"),
    [
        ("/v1/responses", {"input": "Hi", "reasoning": {"effort": "ultra"}}, "ultra",
         "'none', 'minimal', 'low', 'medium', 'high', 'xhigh', and 'max'", "reasoning.effort"),
        ("/v1/responses", {"input": "Hi", "tool_choice": "sometimes"}, "sometimes",
         "'auto', 'none', and 'required'", "tool_choice"),
        ("/v1/responses", {"input": [{"role": "wizard", "content": "Hi"}]}, "wizard",
         "'user', 'assistant', 'system', and 'developer'", "input[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "wizard",
         "'system', 'developer', 'user', 'assistant', 'tool', and 'function'",
         "messages[0].role"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "xml",
         "'text', 'json_object', and 'json_schema'", "response_format.type"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, "video",
         "'text', 'image_url', 'input_audio', and 'file'", "messages[0].content[0].type"),
    ],
)  # fmt: skip
def test_openai_words_a_value_outside_the_allowed_ones_as_openai_does(
    http: TestClient, path: str, extra: dict[str, Any], value: str, supported: str, param: str
) -> None:
    """A string outside an enum (or a message's role, a part's type) is OpenAI's
    "Invalid value: ..." with code `invalid_value`, not pydantic's "Input should be ..."
    (`reasoning.effort: "ultra"` was answered so in the trial of session 44)."""
    body = {"model": SMOLLM2, **({"messages": MESSAGES} if "chat" in path else {}), **extra}
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {
        "message": f"Invalid value: '{value}'. Supported values are: {supported}.",
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_value",
    }


def test_anthropic_and_ollama_word_it_as_theirs(http: TestClient) -> None:
    claude = {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 8}
    for extra, message in (
        ({"stream": "yes"}, "stream: Input should be a valid boolean"),
        ({"max_tokens": "12"}, "max_tokens: Input should be a valid integer"),
        ({"temperature": "0.5"}, "temperature: Input should be a valid number"),
    ):
        answer = http.post("/v1/messages", json={**claude, **extra})
        assert answer.status_code == 400, answer.text
        assert answer.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    chat = {"model": SMOLLM2, "messages": MESSAGES}
    for path, body, message in (
        ("/ollama/api/chat", {**chat, "stream": "yes"},
         "json: cannot unmarshal string into Go struct field ChatRequest.stream of type bool"),
        ("/ollama/api/generate", {"model": SMOLLM2, "prompt": "x", "top_logprobs": 1.5},
         "json: cannot unmarshal number 1.5 into Go struct field GenerateRequest.top_logprobs "
         "of type int"),
        ("/ollama/api/chat", {**chat, "options": {"top_k": "4"}},
         'option "top_k" must be of type integer'),
        ("/ollama/api/chat", {**chat, "options": {"temperature": "0.5"}},
         'option "temperature" must be of type float32'),
        ("/ollama/api/chat", {**chat, "options": {"numa": 1}},
         'option "numa" must be of type boolean'),
    ):  # fmt: skip
        answer = http.post(path, json=body)
        assert answer.status_code == 400, answer.text
        assert answer.json() == {"error": message}


@pytest.mark.parametrize("path", ["/ollama/api/chat", "/api/generate"])
@pytest.mark.parametrize(
    ("think", "message"),
    [
        ("max", 'invalid think value: "max" (must be "high", "medium", "low", true, or false)'),
        (1, 'think must be a boolean or string ("high", "medium", "low", true, or false)'),
    ],
)
def test_ollama_words_a_bad_think_as_ollama_does(
    http: TestClient, path: str, think: Any, message: str
) -> None:
    """Ollama reads `think` with a decoder of its own: a string that is not a level is
    "invalid think value: ...", which clients (Ollama's CLI among them) match to fall back
    to `true`; the trial of session 44 got Go's type sentence with a pydantic branch in it
    ("... Go struct field ChatRequest.think.bool of type bool")."""
    body = {"model": SMOLLM2, "think": think}
    body.update({"messages": MESSAGES} if path.endswith("chat") else {"prompt": "Hi"})
    answer = http.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json() == {"error": message}


def test_ollama_integer_options_take_any_number_and_drop_the_fraction() -> None:
    """Ollama decodes `options` into a map of float64s and converts with Go's int64():
    40.7 is 40, and the answer is served, not refused."""
    options = OllamaOptions.model_validate({"top_k": 40.7, "num_ctx": 2048.0, "seed": -3.9})
    assert (options.top_k, options.num_ctx, options.seed) == (40, 2048, -3)
    with pytest.raises(ValidationError):
        OllamaOptions.model_validate({"num_predict": 12.0})  # the token-limit rule
    cluster = ScriptedCluster()
    with TestClient(scripted_app(cluster)) as http:
        body = {"model": SMOLLM2, "messages": MESSAGES, "stream": False}
        answer = http.post("/ollama/api/chat", json={**body, "options": {"top_k": 4.7}})
        assert answer.status_code == 200, answer.text
        assert cluster.last_params.top_k == 4


# --- over every scalar field of every dialect (derandomized) -----------------------------

_KINDS = {int: "integer", float: "number", bool: "boolean"}


def _scalar_kind(annotation: Any) -> str | None:
    """ "integer" / "number" / "boolean" for a field typed `int`, `float`, `bool` (optional
    or not); None for any other field."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) != 1:
            return None
        annotation = members[0]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return _KINDS.get(annotation)


def _scalar_fields(model: type[BaseModel]) -> list[tuple[str, str]]:
    fields = []
    for name, field in model.model_fields.items():
        kind = _scalar_kind(field.annotation)
        if kind is not None:
            fields.append((field.alias or name, kind))
    return fields


# (path, request model, a valid body, "openai" | "anthropic" | "ollama")
_ROUTES: list[tuple[str, type[BaseModel], dict[str, Any], str]] = [
    ("/v1/chat/completions", ChatCompletionRequest,
     {"model": SMOLLM2, "messages": MESSAGES}, "openai"),
    ("/v1/completions", CompletionRequest, {"model": SMOLLM2, "prompt": "x"}, "openai"),
    ("/v1/responses", ResponsesRequest, {"model": SMOLLM2, "input": "x"}, "openai"),
    ("/v1/embeddings", EmbeddingRequest, {"model": SMOLLM2, "input": "x"}, "openai"),
    ("/v1/messages", MessagesRequest,
     {"model": SMOLLM2, "messages": MESSAGES, "max_tokens": 8}, "anthropic"),
    ("/ollama/api/chat", OllamaChatRequest, {"model": SMOLLM2, "messages": MESSAGES}, "ollama"),
    ("/ollama/api/generate", OllamaGenerateRequest, {"model": SMOLLM2, "prompt": "x"}, "ollama"),
    ("/ollama/api/embed", OllamaEmbedRequest, {"model": SMOLLM2, "input": "x"}, "ollama"),
]  # fmt: skip
_CASES = [
    (path, model, body, dialect, name, kind)
    for path, model, body, dialect in _ROUTES
    for name, kind in _scalar_fields(model)
] + [
    ("/ollama/api/chat", OllamaOptions, {"model": SMOLLM2, "messages": MESSAGES}, "option",
     name, kind)
    for name, kind in _scalar_fields(OllamaOptions)
]  # fmt: skip

_NOT_NUMBERS = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["12", "0.5", "1e3", "-1", "true"]),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
)
_WRONG: dict[str, st.SearchStrategy[Any]] = {
    "integer": st.one_of(_NOT_NUMBERS, st.floats(allow_nan=False, allow_infinity=False)),
    "number": _NOT_NUMBERS,
    "boolean": st.one_of(
        st.sampled_from(["yes", "true", "false", "1", ""]),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(st.booleans(), max_size=2),
    ),
}


def test_every_route_has_scalar_fields_to_check() -> None:
    covered = {path for path, *_ in _CASES}
    assert covered == {path for path, *_ in _ROUTES}
    assert len(_CASES) > 60


@settings(derandomize=True, max_examples=150, deadline=None, database=None)
@given(data=st.data())
def test_a_wrong_type_is_a_400_naming_the_field_in_every_dialect(
    http: TestClient, data: st.DataObject
) -> None:
    path, _, body, dialect, name, kind = data.draw(st.sampled_from(_CASES))
    wrong = data.draw(_WRONG[kind])
    if dialect == "option":
        if kind == "integer" and isinstance(wrong, float):
            return  # Ollama's integer options take any number (the test above)
        sent = {**body, "options": {name: wrong}}
    else:
        sent = {**body, name: wrong}
    answer = http.post(path, json=sent)
    assert answer.status_code == 400, (path, name, wrong, answer.text)
    match dialect:
        case "openai":
            error = answer.json()["error"]
            assert (error["param"], error["code"]) == (name, "invalid_type"), error
            assert error["message"].startswith(f"Invalid type for '{name}': expected "), error
        case "anthropic":
            message = answer.json()["error"]["message"]
            assert message.startswith(f"{name}: Input should be a valid "), message
        case "ollama":
            message = answer.json()["error"]
            assert message.startswith("json: cannot unmarshal "), message
            assert f".{name} of type " in message, message
        case _:
            assert answer.json()["error"].startswith(f'option "{name}" must be of type '), answer


@pytest.mark.parametrize(("path", "model", "body", "dialect", "name", "kind"), _CASES)
def test_the_right_type_is_never_a_type_error(
    path: str,
    model: type[BaseModel],
    body: dict[str, Any],
    dialect: str,
    name: str,
    kind: str,
) -> None:
    """An integer where a number belongs is a number, in every dialect (JSON has one
    number type); the right type is never refused for its type (a range may still be)."""
    right: dict[str, list[Any]] = {"integer": [1], "number": [1, 0.5], "boolean": [True, False]}
    values = right[kind]
    for value in values:
        try:
            model.model_validate({**body, name: value} if dialect != "option" else {name: value})
        except ValidationError as error:
            assert not [e for e in error.errors() if e["type"] in SCALAR_TYPE_ERRORS], error


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "Hi"}], '
         '"temperature": NaN}', "temperature"),
        ("/v1/messages", '{"model": "m", "max_tokens": 5, "messages": [{"role": "user", '
         '"content": "Hi"}], "top_p": Infinity}', "top_p"),
        ("/v1/responses", '{"model": "m", "input": "Hi", "temperature": -Infinity}',
         "temperature"),
        ("/api/chat", '{"model": "m", "messages": [{"role": "user", "content": "Hi"}], '
         '"options": {"temperature": NaN}}', "options.temperature"),
    ],
)  # fmt: skip
def test_a_number_that_is_not_finite_is_refused_by_name(
    http: TestClient, path: str, body: str, field: str
) -> None:
    """NaN and the infinities are not JSON, but Python's parser reads them: a request
    carrying one is a 400 saying the field must be a finite number (it was refused as
    "less than or equal to 2", or a NaN passed the range checks)."""
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert f"{field}: Input should be a finite number" in response.text
