"""Tool-call arguments coerced to the tool's JSON Schema types.

Small models often write `"5"` for an integer parameter or `"true"` for a boolean; callers
of the tool expect the declared types. Coercion follows the schema's `type` (including type
lists such as `["integer", "null"]`), `properties`, `items`, `additionalProperties`,
`anyOf`/`oneOf`; values that do not convert are left as written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

_NO_VALUE = object()


def coerce_to_schema(value: Any, schema: Any) -> Any:
    """`value` converted where it plainly means the type `schema` asks for.

    Small models often quote numbers or write nested objects as JSON text. Conversions:
    string to integer/number/boolean/object/array when the text parses as that type, number
    to string for string types; objects and arrays recursively where the schema describes
    their properties/items. Values that cannot be converted, and properties the schema
    does not name, are returned unchanged.

    Args:
        value: A decoded JSON value (the arguments object, or a part of it).
        schema: The JSON Schema for it (`{}` or a non-dict means "anything").

    Returns:
        The coerced value (a new object; `value` is not modified).
    """
    if not isinstance(schema, dict):
        return value
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            return _coerce_to_first_fitting(value, [*options])
    declared = schema.get("type")
    if isinstance(declared, list):
        return _coerce_to_first_fitting(value, [{**schema, "type": kind} for kind in declared])
    if not isinstance(declared, str):
        if isinstance(value, dict) and "properties" in schema:
            declared = "object"
        elif isinstance(value, list) and "items" in schema:
            declared = "array"
        else:
            return value
    converted = _convert_scalar(value, declared)
    if converted is _NO_VALUE:
        return value
    if declared == "object" and isinstance(converted, dict):
        return _coerce_object(converted, schema)
    if declared == "array" and isinstance(converted, list):
        items = schema.get("items")
        return [coerce_to_schema(item, items) for item in converted]
    return converted


def _coerce_to_first_fitting(value: Any, options: Sequence[Any]) -> Any:
    """Keep a value that already fits an option; else the first option that converts it."""
    for option in options:
        if _fits(value, option):
            return coerce_to_schema(value, option)
    for option in options:
        if isinstance(option, dict) and isinstance(option.get("type"), str):
            converted = _convert_scalar(value, option["type"])
            if converted is not _NO_VALUE and _fits(converted, option):
                return coerce_to_schema(converted, option)
    return value


def _fits(value: Any, schema: Any) -> bool:
    if not isinstance(schema, dict) or not isinstance(schema.get("type"), str):
        return False
    match schema["type"]:
        case "string":
            return isinstance(value, str)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "boolean":
            return isinstance(value, bool)
        case "object":
            return isinstance(value, dict)
        case "array":
            return isinstance(value, list)
        case "null":
            return value is None
        case _:
            return False


def _coerce_object(value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties")
    extra = schema.get("additionalProperties")
    result: dict[str, Any] = {}
    for key, item in value.items():
        if isinstance(properties, dict) and key in properties:
            result[key] = coerce_to_schema(item, properties[key])
        elif isinstance(extra, dict):
            result[key] = coerce_to_schema(item, extra)
        else:
            result[key] = item
    return result


def _convert_scalar(value: Any, declared: str) -> Any:
    """`value` as JSON type `declared`, or `_NO_VALUE` when it does not plainly mean one."""
    match declared:
        case "string":
            if isinstance(value, int | float) and not isinstance(value, bool):
                return json.dumps(value)
            return value if isinstance(value, str) else _NO_VALUE
        case "integer":
            if isinstance(value, bool):
                return _NO_VALUE
            if isinstance(value, int):
                return value
            if isinstance(value, float):
                return int(value) if value.is_integer() else _NO_VALUE
            if isinstance(value, str):
                number = _parse_number(value)
                if isinstance(number, int):
                    return number
                if isinstance(number, float) and number.is_integer():
                    return int(number)
            return _NO_VALUE
        case "number":
            if isinstance(value, bool):
                return _NO_VALUE
            if isinstance(value, int | float):
                return value
            if isinstance(value, str):
                number = _parse_number(value)
                return _NO_VALUE if number is None else number
            return _NO_VALUE
        case "boolean":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            return _NO_VALUE
        case "object" | "array":
            expected = dict if declared == "object" else list
            if isinstance(value, expected):
                return value
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError:
                    return _NO_VALUE
                return parsed if isinstance(parsed, expected) else _NO_VALUE
            return _NO_VALUE
        case "null":
            if value is None:
                return None
            if isinstance(value, str) and value.strip() == "null":
                return None
            return _NO_VALUE
        case _:
            return _NO_VALUE


def _parse_number(text: str) -> int | float | None:
    """A finite JSON number written as text ("5", " -2.5 ", "1e3"), else None."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
