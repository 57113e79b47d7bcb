"""The 400 for a response format's JSON schema that no answer can follow, in every dialect
(Chat `response_format`, Responses `text.format`, Claude `output_config.format`, Ollama
`format`): what `exo.shared.json_schema.find_unfollowable` finds, worded as OpenAI words
an invalid schema ("Invalid schema for response_format 'name': In context=('properties',
'color'), ..."), the dialect's own heading in place of OpenAI's."""

from __future__ import annotations

from typing import Any

from exo.api.wire.errors import InvalidRequestError
from exo.shared.json_schema import find_unfollowable


def check_response_schema(schema: Any, heading: str, param: str) -> None:
    """Refuse a response schema that is not valid JSON Schema or matches no value.

    Args:
        schema: the schema as the client sent it.
        heading: the message's start, naming the format (`Invalid schema for
            response_format 'answer'`).
        param: the request field holding the schema (`response_format`,
            `text.format.schema`, ...).

    Raises:
        InvalidRequestError: `"{heading}: In context=(...), {reason}."`, the context being
            the path from the schema's root to the subschema at fault, as OpenAI writes it.
    """
    problem = find_unfollowable(schema)
    if problem is not None:
        raise InvalidRequestError(
            f"{heading}: In context={problem.context!r}, {problem.reason}.", param
        )


def openai_schema_heading(name: str | None) -> str:
    """OpenAI's heading (Chat and Responses alike), with the format's `name` when given."""
    return "Invalid schema for response_format" + ("" if name is None else f" '{name}'")
