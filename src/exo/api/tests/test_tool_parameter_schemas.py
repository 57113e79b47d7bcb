"""A function tool whose parameter schema is not valid JSON Schema is a 400 in every dialect
(Chat `tools[].function.parameters` and `functions[].parameters`, Responses
`tools[].parameters`, Claude `tools[].input_schema`, Ollama `tools[].function.parameters`),
worded as OpenAI and Anthropic word it and naming the tool and where in its schema the
problem is; before, `{"type": "nonsense"}` was accepted and the forced-call constraint read
it as "any value". A valid schema that matches no value is still accepted (the references
accept it too; the tool simply cannot be called)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from exo.api.claude_messages.request import to_task_params as claude_params
from exo.api.claude_messages.wire_types import MessagesRequest
from exo.api.ollama.request import chat_to_task_params
from exo.api.ollama.wire_types import OllamaChatRequest
from exo.api.openai_chat.request import to_task_params as chat_params
from exo.api.openai_chat.wire_types import ChatCompletionRequest
from exo.api.openai_responses.request import to_task_params as responses_params
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HI = {"role": "user", "content": "hi"}
GOOD = {"type": "object", "properties": {"city": {"type": "string"}}}


def _chat(schema: dict[str, Any]) -> TextGenerationTaskParams:
    tools = [
        {"type": "function", "function": {"name": name, "parameters": parameters}}
        for name, parameters in (("ok", GOOD), ("f", schema))
    ]
    return chat_params(
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": [HI], "tools": tools})
    )


def _chat_functions(schema: dict[str, Any]) -> TextGenerationTaskParams:
    functions = [{"name": "ok", "parameters": GOOD}, {"name": "f", "parameters": schema}]
    return chat_params(
        ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": [HI], "functions": functions}
        )
    )


def _responses(schema: dict[str, Any]) -> TextGenerationTaskParams:
    tools = [
        {"type": "function", "name": "ok", "parameters": GOOD},
        {"type": "function", "name": "f", "parameters": schema},
    ]
    return responses_params(
        ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "tools": tools})
    )


def _responses_namespace(schema: dict[str, Any]) -> TextGenerationTaskParams:
    functions = [
        {"type": "function", "name": "ok", "parameters": GOOD},
        {"type": "function", "name": "f", "parameters": schema},
    ]
    tools = [{"type": "namespace", "name": "mcp", "tools": functions}]
    return responses_params(
        ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "tools": tools})
    )


def _claude(schema: dict[str, Any]) -> TextGenerationTaskParams:
    tools = [{"name": "ok", "input_schema": GOOD}, {"name": "f", "input_schema": schema}]
    return claude_params(
        MessagesRequest.model_validate(
            {"model": MODEL, "max_tokens": 8, "messages": [HI], "tools": tools}
        )
    )


def _ollama(schema: dict[str, Any]) -> TextGenerationTaskParams:
    tools = [
        {"type": "function", "function": {"name": name, "parameters": parameters}}
        for name, parameters in (("ok", GOOD), ("f", schema))
    ]
    request = OllamaChatRequest.model_validate({"model": MODEL, "messages": [HI], "tools": tools})
    return chat_to_task_params(request, ModelId(MODEL))


OPENAI_START = "Invalid schema for function 'f': In context="
CLAUDE_START = (
    "tools.1.custom.input_schema: JSON schema is invalid. It must match JSON Schema draft "
    "2020-12 (https://json-schema.org/draft/2020-12). In context="
)
# (dialect, converter, the error's param, the message's start, the error's code)
DIALECTS: list[
    tuple[str, Callable[[dict[str, Any]], TextGenerationTaskParams], str, str, str | None]
] = [
    ("chat", _chat, "tools[1].function.parameters", OPENAI_START, "invalid_function_parameters"),
    ("chat functions", _chat_functions, "functions[1].parameters", OPENAI_START, None),
    ("responses", _responses, "tools[1].parameters", OPENAI_START, None),
    ("responses namespace", _responses_namespace, "tools[0].tools[1].parameters", "", None),
    ("claude", _claude, "tools.1.input_schema", CLAUDE_START, None),
    ("ollama", _ollama, "tools[1].function.parameters", OPENAI_START, None),
]
# Claude refuses a non-object `type` before looking further, so every schema here is one.
INVALID = [
    (
        {"type": "object", "properties": 5},
        "('properties',)",
        "'properties' must be an object of schemas",
    ),
    (
        {"type": "object", "properties": {"a": {"type": "nonsense"}}},
        "('properties', 'a')",
        "'nonsense' is not a valid 'type'",
    ),
    ({"type": "object", "required": "a"}, "()", "'required' must be an array"),
    (
        {"type": "object", "properties": {"a": {"type": "array", "items": 3}}},
        "('properties', 'a', 'items')",
        "a schema is an object or a boolean, not a number",
    ),
]


@pytest.mark.parametrize(("schema", "context", "reason"), INVALID)
@pytest.mark.parametrize(("dialect", "convert", "param", "start", "code"), DIALECTS)
def test_an_invalid_parameter_schema_is_a_400_naming_the_tool_and_where(
    dialect: str,
    convert: Callable[[dict[str, Any]], TextGenerationTaskParams],
    param: str,
    start: str,
    code: str | None,
    schema: dict[str, Any],
    context: str,
    reason: str,
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        convert(schema)
    assert caught.value.status_code == 400
    assert caught.value.param == param, dialect
    assert caught.value.message.startswith(start), caught.value.message
    assert f"In context={context}, {reason}" in caught.value.message, dialect
    if code is not None:
        assert caught.value.code == code


@pytest.mark.parametrize(("dialect", "convert", "param", "start", "code"), DIALECTS)
def test_a_top_level_type_that_names_no_type_is_refused(
    dialect: str,
    convert: Callable[[dict[str, Any]], TextGenerationTaskParams],
    param: str,
    start: str,
    code: str | None,
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        convert({"type": "nonsense"})
    # Claude answers its own "must be 'object'" first, at the `type` itself.
    assert caught.value.param in (param, f"{param}.type"), dialect


VALID = [
    {"type": "object", "properties": {"a": {"type": "string", "enum": []}}},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "$defs": {"x": {}}},
    {"type": "object"},
]


@pytest.mark.parametrize("schema", VALID)
@pytest.mark.parametrize(("dialect", "convert", "param", "start", "code"), DIALECTS)
def test_valid_schemas_are_accepted_even_when_no_arguments_can_follow_them(
    dialect: str,
    convert: Callable[[dict[str, Any]], TextGenerationTaskParams],
    param: str,
    start: str,
    code: str | None,
    schema: dict[str, Any],
) -> None:
    params = convert(schema)
    assert params.tools[1].parameters == schema, dialect
