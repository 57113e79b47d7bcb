"""`find_unfollowable`: which response schemas the API refuses (invalid JSON Schema, or
matching no value) and where it says the problem is; everything else passes, keywords
the constraint does not enforce included; `find_invalid`: which tool parameter schemas it
refuses (invalid JSON Schema only)."""

from __future__ import annotations

from typing import Any

import pytest

from exo.shared.json_schema import find_invalid, find_unfollowable

REFUSED: list[tuple[Any, tuple[str, ...], str]] = [
    ({"type": "foo"}, (), "'foo' is not a valid 'type'"),
    ({"type": []}, (), "[] is not a valid 'type'"),
    ({"type": ["string", "string"]}, (), "is not a valid 'type'"),
    ({"enum": "a"}, (), "'enum' must be an array"),
    ({"required": "a"}, (), "'required' must be an array"),
    ({"properties": {"a": 3}}, ("properties", "a"), "a schema is an object or a boolean"),
    ({"properties": []}, ("properties",), "'properties' must be an object of schemas"),
    ({"anyOf": []}, ("anyOf",), "'anyOf' must be a non-empty array"),
    ({"type": "string", "minLength": -1}, (), "'minLength' must be a non-negative integer"),
    ({"type": "number", "minimum": "0"}, (), "'minimum' must be a number"),
    ({"type": "number", "multipleOf": 0}, (), "'multipleOf' must be greater than 0"),
    (False, (), "the schema false matches no value"),
    ({"type": "string", "enum": []}, (), "'enum' is empty"),
    ({"type": "integer", "const": "a"}, (), "'const' is not of the type 'integer'"),
    ({"type": "integer", "enum": [True, "1"]}, (), "no value in 'enum' is of the type"),
    ({"enum": [1], "const": True}, (), "'const' is not one of the values in 'enum'"),
    ({"not": {}}, (), "'not' holds a schema that matches every value"),
    ({"not": {"description": "anything"}}, (), "'not' holds a schema that matches every"),
    ({"allOf": [{"type": "string"}, False]}, (), "'allOf' holds a schema that matches no"),
    ({"anyOf": [False, False]}, (), "every schema in 'anyOf' matches no value"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, (), "'minLength' (3) is above"),
    ({"type": "number", "minimum": 1, "maximum": 0}, (), "'minimum' (1) is above"),
    (
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        ("properties", "a"),
        "the required property 'a' has the schema false",
    ),
    (
        {"type": "array", "items": {"type": "object", "properties": {"b": {"enum": []}}}},
        ("items", "properties", "b"),
        "'enum' is empty",
    ),
    ({"anyOf": [{"type": "string"}, {"type": "bar"}]}, ("anyOf", "1"), "'bar' is not a valid"),
    ({"$defs": {"x": {"not": True}}}, ("$defs", "x"), "'not' holds a schema"),
    (
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        (),
        "the types of value allowed by 'allOf' have none in common",
    ),
    (
        {"type": "object", "properties": {"a": {"allOf": [{"type": "null"}, {"const": 1}]}}},
        ("properties", "a"),
        "allowed by 'allOf' have none",
    ),
    ({"type": "integer", "anyOf": [{"type": "string"}, {"type": "null"}]}, (), "'type', 'any"),
    ({"enum": [1.5], "allOf": [{"type": "integer"}]}, (), "by 'enum', 'allOf' have none"),
    ({"allOf": [{"allOf": [{"type": "array"}]}, {"oneOf": [{"type": "object"}]}]}, (), "none"),
]


@pytest.mark.parametrize(("schema", "context", "reason"), REFUSED)
def test_refused_schemas_say_why_and_where(
    schema: Any, context: tuple[str, ...], reason: str
) -> None:
    problem = find_unfollowable(schema)
    assert problem is not None
    assert problem.context == context
    assert reason in problem.reason


ACCEPTED: list[Any] = [
    {},
    True,
    {"type": "object"},
    {"type": ["string", "null"]},
    {"type": "integer", "enum": [1, 2.0]},  # 2.0 is an integer to JSON Schema
    {"enum": [1], "const": 1.0},
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
    {"anyOf": [False, {"type": "string"}]},
    {"type": "string", "pattern": "^[a-z]+$", "format": "email", "minLength": 1},
    {"type": "number", "minimum": 0, "exclusiveMinimum": True},  # draft 4's flag
    {"type": "array", "items": [{"type": "string"}], "additionalItems": False},  # tuple form
    {"type": "object", "properties": {"a": False}, "additionalProperties": False},
    {"not": {"type": "string"}},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
    {"allOf": [{"type": "number"}, {"type": "integer"}]},  # an integer is a number
    {"type": "number", "allOf": [{"enum": [2.0, "a"]}]},
    {"allOf": [{"type": ["string", "null"]}, {"anyOf": [{"type": "null"}, {"minimum": 1}]}]},
    {"allOf": [{"minimum": 1}, {"type": "integer"}, True]},
]


@pytest.mark.parametrize("schema", ACCEPTED)
def test_valid_satisfiable_schemas_pass(schema: Any) -> None:
    assert find_unfollowable(schema) is None


INVALID_TOOL_SCHEMAS: list[tuple[Any, tuple[str, ...], str]] = [
    ({"type": "nonsense"}, (), "'nonsense' is not a valid 'type'"),
    ({"type": "object", "properties": 5}, ("properties",), "'properties' must be an object"),
    ({"properties": {"a": {"type": "strin"}}}, ("properties", "a"), "'strin' is not a valid"),
    ({"properties": {"a": {"pattern": 1}}}, ("properties", "a"), "'pattern' must be a string"),
    ({"description": ["a"]}, (), "'description' must be a string"),
    ({"type": "array", "uniqueItems": "yes"}, (), "'uniqueItems' must be a boolean"),
]


@pytest.mark.parametrize(("schema", "context", "reason"), INVALID_TOOL_SCHEMAS)
def test_find_invalid_names_what_is_not_json_schema(
    schema: Any, context: tuple[str, ...], reason: str
) -> None:
    for find in (find_invalid, find_unfollowable):
        problem = find(schema)
        assert problem is not None
        assert (problem.context, reason in problem.reason) == (context, True)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"type": "string", "enum": []}}},
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        {"not": {}},
    ],
)
def test_find_invalid_passes_valid_schemas_that_match_nothing(schema: Any) -> None:
    # A tool that can never be called is valid JSON Schema: only find_unfollowable refuses it.
    assert find_invalid(schema) is None
    assert find_unfollowable(schema) is not None
