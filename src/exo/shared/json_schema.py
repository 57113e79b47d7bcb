"""JSON Schema facts the API and the engine's schema constraint share: the kinds of value a
`type` names, whether a value is of a kind, and `find_unfollowable`, which tells the API to
refuse a response schema no answer can follow (rather than answer with output that ignores
it, as the constraint's "any value" fallback would). A tool's parameter schema is checked
for validity only (`find_invalid`): OpenAI and Anthropic refuse an invalid one, and a tool
whose arguments cannot exist is the client's concern, not a reason to refuse its request.

A schema is refused (the first problem found, depth first, in the order its keywords are
written) when it is not valid JSON Schema — as draft 2020-12's meta-schema has it for the
keywords below, earlier drafts' tuple `items`, boolean `exclusiveMinimum` and
`definitions` included — or when a subschema in it matches no value at all:

- invalid: `type` not one of the seven type names or a non-empty list of them without
  repeats; `enum` not a list; `pattern`, `format`, `$ref`, `title`, `description` not a
  string; `uniqueItems` not a boolean; `required` not a list of strings; a subschema (the
  values of `properties`, `patternProperties`, `$defs`, `items`, `not`, the members of
  `anyOf`, `oneOf`, `allOf`, ...) neither an object nor a boolean; `anyOf`/`oneOf`/`allOf` not a
  non-empty list; a length or count keyword (`minLength`, `maxItems`, ...) not a
  non-negative integer, a numeric bound not a number, `multipleOf` not above 0.
- matches nothing: `false` as the whole schema or as a required property's schema; an
  object schema with an empty `enum`, with no `enum`/`const` value of the `type` it names
  (`{"type": "integer", "const": "a"}`), with a `const` outside its `enum`, with `not` of
  a schema that matches everything (`{}`, `true`), with `allOf` holding a schema that
  matches nothing or `anyOf`/`oneOf` holding only such schemas, with a lower bound above
  its upper bound (`minimum`/`maximum`, `minLength`/`maxLength`, `minItems`/`maxItems`,
  `minProperties`/`maxProperties`), or whose `type`, `enum`/`const` and `allOf`/`anyOf`/
  `oneOf` members allow no type of value in common (`{"allOf": [{"type": "string"},
  {"type": "integer"}]}`; an integer is a number).

What the constraint does not enforce (`$ref`, `anyOf`, patterns, formats, bounds: docs/api.md,
"Structured output") is otherwise accepted as it is: only contradictions are refused, not
what is merely unsupported. `false` elsewhere (`additionalProperties: false`, an optional
property `false`) is the usual way to forbid something and stays valid (the constraint
never writes such a property). Contradictions other than of types (`allOf` of two
different `const`s, a `$ref` to a schema that matches nothing) are not looked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

# Kinds of value a schema allows (a bit mask).
STRING = 1
INTEGER = 2
NUMBER = 4  # includes integers
BOOLEAN = 8
NULL = 16
ARRAY = 32
OBJECT = 64
ANY_KIND = STRING | INTEGER | NUMBER | BOOLEAN | NULL | ARRAY | OBJECT
KIND_NAMES = {
    "string": STRING,
    "integer": INTEGER,
    "number": NUMBER,
    "boolean": BOOLEAN,
    "null": NULL,
    "array": ARRAY,
    "object": OBJECT,
}

# Keywords whose value is one subschema / an object of subschemas / a list of them.
_SUBSCHEMA = (
    "additionalProperties", "propertyNames", "unevaluatedProperties", "contains", "not",
    "if", "then", "else", "additionalItems", "unevaluatedItems",
)  # fmt: skip
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = (
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
    "minContains", "maxContains",
)  # fmt: skip
_NUMBERS = ("minimum", "maximum")
_STRINGS = ("pattern", "format", "$ref", "title", "description")
_NUMBERS_OR_FLAGS = ("exclusiveMinimum", "exclusiveMaximum")  # a flag in draft 4
_BOUNDS = (
    ("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SchemaProblem:
    """Why a schema cannot be followed, and where.

    Attributes:
        context: the keywords and names leading from the schema's root to the subschema at
            fault (`("properties", "color", "enum")`; indexes as strings, as OpenAI writes
            its `In context=(...)`); empty for the root.
        reason: a sentence fragment without a final period (`'enum' is empty: no value
            can be one of none`).
    """

    context: tuple[str, ...]
    reason: str


def kinds_of(type_field: Any) -> int:
    """The kinds a `type` value names (unknown names count as none)."""
    names = type_field if isinstance(type_field, list) else [type_field]
    kinds = 0
    for name in names:
        if isinstance(name, str):
            kinds |= KIND_NAMES.get(name, 0)
    return kinds


def value_fits(value: Any, kinds: int) -> bool:
    """Whether a JSON value has one of the kinds (a boolean is not a number; 1.0 is an
    integer, as JSON Schema counts it)."""
    if isinstance(value, bool):
        return bool(kinds & BOOLEAN)
    if isinstance(value, int):
        return bool(kinds & (INTEGER | NUMBER))
    if isinstance(value, float):
        return bool(kinds & NUMBER) or (bool(kinds & INTEGER) and value.is_integer())
    if isinstance(value, str):
        return bool(kinds & STRING)
    if value is None:
        return bool(kinds & NULL)
    if isinstance(value, list):
        return bool(kinds & ARRAY)
    return isinstance(value, dict) and bool(kinds & OBJECT)


def find_unfollowable(schema: Any) -> SchemaProblem | None:
    """The first reason no answer can follow `schema` (see the module docstring), or None.

    Args:
        schema: a response format's JSON Schema, as the client sent it (parsed JSON).

    Returns:
        the problem and where it is, or None when the schema is valid and some value can
        follow it.
    """
    if schema is False:
        return SchemaProblem((), "the schema false matches no value")
    return next(_problems(schema, (), satisfiable=True), None)


def find_invalid(schema: Any) -> SchemaProblem | None:
    """The first way `schema` is not valid JSON Schema (the "invalid" list of the module
    docstring), or None; a valid schema that matches no value passes.

    Args:
        schema: a tool's parameter schema, as the client sent it (parsed JSON).

    Returns:
        the problem and where it is, or None when the schema is valid.
    """
    return next(_problems(schema, (), satisfiable=False), None)


def _problems(
    schema: Any, context: tuple[str, ...], *, satisfiable: bool
) -> Iterator[SchemaProblem]:
    """Problems of `schema` and its subschemas; those of matching no value too when
    `satisfiable` (the schema must be one some value can follow)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        yield SchemaProblem(context, f"a schema is an object or a boolean, not {_kind(schema)}")
        return
    yield from _invalid_values(schema, context)
    yield from _subschema_problems(schema, context, satisfiable=satisfiable)
    reason = _matches_nothing(schema) if satisfiable else None
    if reason is not None:
        yield SchemaProblem(context, reason)


def _invalid_values(schema: dict[str, Any], context: tuple[str, ...]) -> Iterator[SchemaProblem]:
    """Keyword values that are not what the meta-schema allows."""
    if "type" in schema and not _valid_type(schema["type"]):
        yield SchemaProblem(
            context,
            f"{_quoted(schema['type'])} is not a valid 'type': use one of "
            f"{', '.join(repr(name) for name in sorted(KIND_NAMES))}, or a list of them",
        )
    if "enum" in schema and not isinstance(schema["enum"], list):
        yield SchemaProblem(context, "'enum' must be an array of the values allowed")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        yield SchemaProblem(context, "'required' must be an array of property names")
    for keyword in _COUNTS:
        value = schema.get(keyword, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            yield SchemaProblem(context, f"'{keyword}' must be a non-negative integer")
    for keyword in _NUMBERS + _NUMBERS_OR_FLAGS + ("multipleOf",):
        value = schema.get(keyword, 1)
        flag_allowed = keyword in _NUMBERS_OR_FLAGS and isinstance(value, bool)
        if not flag_allowed and not _is_number(value):
            yield SchemaProblem(context, f"'{keyword}' must be a number")
    if _is_number(schema.get("multipleOf", 1)) and schema.get("multipleOf", 1) <= 0:
        yield SchemaProblem(context, "'multipleOf' must be greater than 0")
    for keyword in _STRINGS:
        if keyword in schema and not isinstance(schema[keyword], str):
            yield SchemaProblem(context, f"'{keyword}' must be a string")
    if "uniqueItems" in schema and not isinstance(schema["uniqueItems"], bool):
        yield SchemaProblem(context, "'uniqueItems' must be a boolean")


def _subschema_problems(
    schema: dict[str, Any], context: tuple[str, ...], *, satisfiable: bool
) -> Iterator[SchemaProblem]:
    for keyword, value in schema.items():
        here = (*context, keyword)
        if keyword in _SUBSCHEMA or (keyword == "items" and not isinstance(value, list)):
            yield from _problems(value, here, satisfiable=satisfiable)
        elif keyword in _SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                yield SchemaProblem(here, f"'{keyword}' must be an object of schemas")
                continue
            for name, subschema in value.items():
                yield from _problems(subschema, (*here, str(name)), satisfiable=satisfiable)
        elif keyword in _SUBSCHEMA_LISTS or keyword == "items":
            if not isinstance(value, list) or (keyword != "prefixItems" and not value):
                yield SchemaProblem(here, f"'{keyword}' must be a non-empty array of schemas")
                continue
            for index, subschema in enumerate(value):
                yield from _problems(subschema, (*here, str(index)), satisfiable=satisfiable)
    properties = schema.get("properties")
    if satisfiable and isinstance(properties, dict) and isinstance(schema.get("required"), list):
        for name in schema["required"]:
            if properties.get(name) is False:
                yield SchemaProblem(
                    (*context, "properties", name),
                    f"the required property '{name}' has the schema false, which matches no value",
                )


def _matches_nothing(schema: dict[str, Any]) -> str | None:
    """Why this (otherwise valid) object schema matches no value, or None."""
    enum = schema.get("enum")
    if isinstance(enum, list) and not enum:
        return "'enum' is empty: no value can be one of none"
    if isinstance(enum, list) or "const" in schema:
        values = list(enum) if isinstance(enum, list) else [schema["const"]]
        if "const" in schema:
            values = [value for value in values if _json_equal(value, schema["const"])]
            if not values:
                return "'const' is not one of the values in 'enum'"
        if "type" in schema and not any(value_fits(v, kinds_of(schema["type"])) for v in values):
            named = "no value in 'enum' is" if isinstance(enum, list) else "'const' is not"
            return f"{named} of the type {_quoted(schema['type'])}"
    if "not" in schema and _matches_everything(schema["not"]):
        return "'not' holds a schema that matches every value, so this matches none"
    members = schema.get("allOf")
    if isinstance(members, list) and any(map(_matches_nothing_at_all, members)):
        return "'allOf' holds a schema that matches no value"
    for keyword in ("anyOf", "oneOf"):
        members = schema.get(keyword)
        if isinstance(members, list) and members and all(map(_matches_nothing_at_all, members)):
            return f"every schema in '{keyword}' matches no value"
    for low, high in _BOUNDS:
        lower, upper = schema.get(low), schema.get(high)
        if _is_number(lower) and _is_number(upper) and lower > upper:
            return f"'{low}' ({lower}) is above '{high}' ({upper})"
    combined = [keyword for keyword in _COMBINATORS if isinstance(schema.get(keyword), list)]
    if combined and _allowed_kinds(schema) == 0:
        restricting = [keyword for keyword in ("type", "enum", "const") if keyword in schema]
        return (
            f"the types of value allowed by {', '.join(map(repr, restricting + combined))} have "
            "none in common, so no value matches"
        )
    return None


_COMBINATORS = ("allOf", "anyOf", "oneOf")


def _allowed_kinds(schema: Any) -> int:
    """The kinds of value `schema` may match as far as its `type`, `enum`/`const` and
    combinators' members say (a bit mask; NUMBER includes INTEGER here)."""
    if schema is False:
        return 0
    if not isinstance(schema, dict):
        return ANY_KIND
    kinds = _with_integers(kinds_of(schema["type"])) if "type" in schema else ANY_KIND
    values = schema["enum"] if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        values = [schema["const"]]
    if values is not None:
        kinds &= _or(_value_kinds(value) for value in values)
    all_of = schema.get("allOf")
    for member in all_of if isinstance(all_of, list) else ():
        kinds &= _allowed_kinds(member)
    for keyword in ("anyOf", "oneOf"):
        members = schema.get(keyword)
        if isinstance(members, list) and members:
            kinds &= _or(_allowed_kinds(member) for member in members)
    return kinds


def _with_integers(kinds: int) -> int:
    return kinds | INTEGER if kinds & NUMBER else kinds


def _value_kinds(value: Any) -> int:
    return _or(kind for kind in KIND_NAMES.values() if value_fits(value, kind))


def _or(masks: Iterable[int]) -> int:
    combined = 0
    for mask in masks:
        combined |= mask
    return combined


def _matches_nothing_at_all(schema: Any) -> bool:
    return schema is False or (isinstance(schema, dict) and _matches_nothing(schema) is not None)


# Keywords that annotate a schema without restricting its values.
_ANNOTATIONS = frozenset(
    {"title", "description", "$comment", "examples", "default", "$id", "$schema", "$anchor",
     "deprecated", "readOnly", "writeOnly"}
)  # fmt: skip


def _matches_everything(schema: Any) -> bool:
    return schema is True or (isinstance(schema, dict) and set(schema) <= _ANNOTATIONS)


def _valid_type(type_field: Any) -> bool:
    if isinstance(type_field, str):
        return type_field in KIND_NAMES
    return (
        isinstance(type_field, list)
        and bool(type_field)
        and all(isinstance(name, str) and name in KIND_NAMES for name in type_field)
        and len(set(type_field)) == len(type_field)
    )


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _json_equal(left: Any, right: Any) -> bool:
    """Equality as JSON Schema's `const`/`enum` compare (1 == 1.0; true != 1)."""
    if isinstance(left, bool) or isinstance(right, bool):
        return left is right
    if _is_number(left) and _is_number(right):
        return bool(left == right)
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(map(_json_equal, left, right))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_json_equal(left[k], right[k]) for k in left)
    return type(left) is type(right) and bool(left == right)


def _kind(value: Any) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return "an object"


def _quoted(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
