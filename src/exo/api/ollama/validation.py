"""How Ollama words a request body of the wrong types, so that its clients read the same
sentence from exo.

Ollama decodes a body with Go's `encoding/json` into its request structs (`api/types.go`),
which refuses a JSON value of another type than the field's ("json: cannot unmarshal string
into Go struct field ChatRequest.stream of type bool"), and reads `options` into a map first,
then converts each entry with its own check (`Options.FromMap`: `option "top_k" must be of
type integer`). exo's request models are strict in the same places; this module only words
their errors. (Facts from Ollama's source; no code taken.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from exo.api.ollama.wire_types import MAX_TOP_LOGPROBS
from exo.api.wire.errors import (
    SPECULATIVE_VALUES,
    describe_validation_errors,
    first_scalar_type_error,
    param_from_location,
    speculative_error,
)

# The Go struct each route decodes into (the name Go's error gives).
_STRUCTS = {
    "/api/chat": "ChatRequest",
    "/api/generate": "GenerateRequest",
    "/api/embed": "EmbedRequest",
    "/api/embeddings": "EmbeddingRequest",
    "/api/show": "ShowRequest",
    "/api/pull": "PullRequest",
    "/api/delete": "DeleteRequest",
}
_GO_TYPES = {
    "int_type": "int",
    "float_type": "float64",
    "bool_type": "bool",
    "string_type": "string",
}
_OPTION_TYPES = {
    "int_type": "integer",
    "float_type": "float32",
    "bool_type": "boolean",
    "string_type": "string",
}


def _go_kind(value: Any) -> str:
    match value:
        case bool():
            return "bool"
        case int() | float():
            return f"number {value!r}"
        case str():
            return "string"
        case list():
            return "array"
        case _:
            return "object"


_INT64_RANGE = range(-(2**63), 2**63)
_RANGE_ERRORS = {"greater_than_equal": ("ge", "at least"), "less_than_equal": ("le", "at most")}


def _out_of_range(path: str, errors: Sequence[Mapping[str, Any]]) -> str | None:
    """Ollama's sentence when the first error is an integer outside its bounds, else None:
    `top_logprobs` outside 0..20 is Ollama's own 400 ("top_logprobs must be between 0 and
    20"), past 64 bits Go's ("json: cannot unmarshal number ... of type int"); an option
    outside exo's bounds (`seed`, which Ollama would wrap into 64 bits) is worded as
    `Options.FromMap` words an option it refuses."""
    first = errors[0] if errors else {}
    kind = _RANGE_ERRORS.get(str(first.get("type")))
    value, location = first.get("input"), tuple(first.get("loc", ()))[1:]
    if kind is None or not isinstance(value, int) or isinstance(value, bool):
        return None
    if location == ("top_logprobs",):
        if value not in _INT64_RANGE:
            return (
                f"json: cannot unmarshal number {value} into Go struct field "
                f"{_struct(path)}.top_logprobs of type int"
            )
        return f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}"
    if len(location) == 2 and location[0] == "options":
        bound_name, relation = kind
        bound = (first.get("ctx") or {}).get(bound_name)
        return f'option "{location[1]}" must be {relation} {bound}'
    return None


_THINK_VALUES = '"high", "medium", "low", true, or false'


def _think_error(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """Ollama's sentence when the first error is `think`'s, else None. Ollama decodes
    `think` with a method of its own, not Go's type errors: a string that is not a level is
    `invalid think value: "max" (must be ...)`, which clients (Ollama's CLI among them)
    match to retry with `true`, and any other JSON type `think must be a boolean or string
    (...)`."""
    location = tuple(errors[0].get("loc", ())) if errors else ()
    if location[1:2] != ("think",):
        return None
    value = errors[0].get("input")
    if isinstance(value, str):
        return f"invalid think value: {json.dumps(value)} (must be {_THINK_VALUES})"
    return f"think must be a boolean or string ({_THINK_VALUES})"


def _struct(path: str) -> str:
    return next((name for suffix, name in _STRUCTS.items() if path.endswith(suffix)), "Request")


def describe_ollama_validation_errors(
    path: str, errors: Sequence[Mapping[str, Any]]
) -> tuple[str, str | None, str | None]:
    """Go's sentence for a field of the wrong type, `Options.FromMap`'s for an option of
    the wrong type, Ollama's for an integer out of range (`_out_of_range`), else pydantic's
    sentences (`describe_validation_errors`).

    Args:
        path: the request's path (`/ollama/api/chat`), which names the Go struct.

    Returns:
        (message, the field at fault in dotted form, None).
    """
    speculative = speculative_error(errors)
    if speculative is not None:
        # exo's option, worded as `Options.FromMap` words an option of the wrong type.
        return f'option "speculative" must be {SPECULATIVE_VALUES}', speculative[0], None
    think = _think_error(errors)
    if think is not None:
        return think, "think", None
    out_of_range = _out_of_range(path, errors)
    if out_of_range is not None:
        return out_of_range, param_from_location(tuple(errors[0].get("loc", ()))), None
    mismatch = first_scalar_type_error(errors)
    if mismatch is None:
        return (*describe_validation_errors(errors), None)
    location, error_type, value = mismatch
    names = [str(part) for part in location if isinstance(part, str)]
    param = ".".join(names) or None
    if len(names) == 2 and names[0] == "options":
        if error_type == "int_type" and isinstance(value, float):
            # Only `num_predict` refuses a number with a fraction (the token-limit rule,
            # not Ollama's): no Ollama sentence says so.
            return (*describe_validation_errors(errors), None)
        return f'option "{names[1]}" must be of type {_OPTION_TYPES[error_type]}', param, None
    message = (
        f"json: cannot unmarshal {_go_kind(value)} into Go struct field {_struct(path)}.{param} of "
        f"type {_GO_TYPES[error_type]}"
    )
    return message, param, None
