"""A response schema that is not valid JSON Schema, or that no value can follow, is a 400
in every dialect (Chat `response_format`, Responses `text.format`, Claude
`output_config.format`, Ollama `format`), worded as OpenAI words it and naming where in the
schema it is; before, the constraint read such a schema as "any value" and a node asked for
`{"type": "string", "enum": []}` answered `1`. Schemas that only use what the constraint
does not enforce (docs/api.md, "Structured output") are still accepted."""

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


def _chat(schema: dict[str, Any]) -> TextGenerationTaskParams:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return chat_params(
        ChatCompletionRequest.model_validate(
            {"model": MODEL, "messages": [HI], "response_format": response_format}
        )
    )


def _responses(schema: dict[str, Any]) -> TextGenerationTaskParams:
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    return responses_params(
        ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "text": text})
    )


def _claude(schema: dict[str, Any]) -> TextGenerationTaskParams:
    output_config = {"format": {"type": "json_schema", "schema": schema}}
    return claude_params(
        MessagesRequest.model_validate(
            {"model": MODEL, "max_tokens": 8, "messages": [HI], "output_config": output_config}
        )
    )


def _ollama(schema: dict[str, Any]) -> TextGenerationTaskParams:
    request = OllamaChatRequest.model_validate({"model": MODEL, "messages": [HI], "format": schema})
    return chat_to_task_params(request, ModelId(MODEL))


# (dialect, converter, the error's param, the message's start)
DIALECTS: list[tuple[str, Callable[[dict[str, Any]], TextGenerationTaskParams], str, str]] = [
    ("chat", _chat, "response_format", "Invalid schema for response_format 'x': In context="),
    ("responses", _responses, "text.format.schema", "Invalid schema for response_format 'x'"),
    ("claude", _claude, "output_config.format.schema", "output_config.format.schema: Invalid"),
    ("ollama", _ollama, "format", "format: invalid JSON schema: In context="),
]
UNFOLLOWABLE = [
    ({"type": "foo"}, "()", "'foo' is not a valid 'type'"),
    ({"type": "string", "enum": []}, "()", "'enum' is empty"),
    ({"not": {}}, "()", "'not' holds a schema that matches every value"),
    ({"type": "integer", "const": "a"}, "()", "'const' is not of the type 'integer'"),
    (
        {"type": "object", "properties": {"color": {"type": "string", "enum": []}}},
        "('properties', 'color')",
        "'enum' is empty",
    ),
    (
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        "()",
        "the types of value allowed by 'allOf' have none in common",
    ),
]


@pytest.mark.parametrize(("schema", "context", "reason"), UNFOLLOWABLE)
@pytest.mark.parametrize(("dialect", "convert", "param", "start"), DIALECTS)
def test_a_schema_no_answer_can_follow_is_a_400_naming_where(
    dialect: str,
    convert: Callable[[dict[str, Any]], TextGenerationTaskParams],
    param: str,
    start: str,
    schema: dict[str, Any],
    context: str,
    reason: str,
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        convert(schema)
    assert caught.value.status_code == 400
    assert caught.value.param == param, dialect
    assert caught.value.message.startswith(start), caught.value.message
    assert f"In context={context}, {reason}" in caught.value.message


FOLLOWABLE = [
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": {}}},
    {"anyOf": [{"type": "string", "pattern": "^a", "minLength": 2}, {"type": "null"}]},
    {"type": "number", "minimum": 0, "maximum": 10, "format": "float"},
    {"type": "object", "properties": {"a": False}, "additionalProperties": False},
    {"type": "integer", "enum": [1, 2.0]},
    {},
]


@pytest.mark.parametrize("schema", FOLLOWABLE)
@pytest.mark.parametrize(("dialect", "convert", "param", "start"), DIALECTS)
def test_schemas_with_keywords_the_constraint_does_not_enforce_are_accepted(
    dialect: str,
    convert: Callable[[dict[str, Any]], TextGenerationTaskParams],
    param: str,
    start: str,
    schema: dict[str, Any],
) -> None:
    params = convert(schema)
    assert (params.response_format, params.json_schema) == ("json_schema", schema), dialect


def test_a_format_without_a_name_is_named_by_its_field_alone() -> None:
    response_format = {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}
    request = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [HI], "response_format": response_format}
    )
    with pytest.raises(InvalidRequestError) as caught:
        chat_params(request)
    assert caught.value.message.startswith("Invalid schema for response_format: In context=()")
