"""Errors the API answers clients with, and OpenAI's JSON shape for them.

The exception classes are dialect-neutral (a message, the offending parameter, an HTTP
status); each dialect renders them in its own body shape. `openai_error_body` is the shape
the OpenAI-compatible routes use, both as an HTTP body and as an in-stream SSE error event.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple


class ApiError(Exception):
    """An error to answer the client with, carrying its HTTP status and error type.

    Args:
        message: Human-readable, says what was wrong and, where it helps, what to do.
        param: The request parameter at fault, in OpenAI's dotted/indexed form
            (`messages[2].content`), or None when no single parameter is to blame.
        code: A short machine-readable code (`model_not_found`), or None.
    """

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(ApiError):
    """The request is well-formed JSON but asks for something we cannot or will not do."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(ApiError):
    """The requested model is unknown to the cluster (OpenAI answers 404 for this too)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = "model", code: str | None = None) -> None:
        super().__init__(message, param, code or "model_not_found")


class NoCapacityError(ApiError):
    """No instance can serve the request right now; the client may retry later (after
    `retry_after_seconds`, sent as a `Retry-After` header, when it is known)."""

    status_code = 503
    error_type = "service_unavailable_error"

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_seconds: int | None = None,
    ) -> None:
        super().__init__(message, param, code)
        self.retry_after_seconds = retry_after_seconds


class QueueFullError(NoCapacityError):
    """Every instance of the model is running and queueing as many requests from this node
    as it may (`exo.api.serving.admission`), and none finished within the wait; answered with a
    `Retry-After: retry_after_seconds` header."""

    retry_after_seconds: int

    def __init__(self, message: str, retry_after_seconds: int) -> None:
        super().__init__(message, code="queue_full", retry_after_seconds=retry_after_seconds)


class GenerationError(ApiError):
    """The generation failed (or was cancelled) after it was accepted."""

    status_code = 500
    error_type = "server_error"


def openai_error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`.

    The official clients read `error.message` for the exception text, so it must be a
    non-empty string.
    """
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def openai_error_body_for(error: ApiError) -> dict[str, Any]:
    """The OpenAI error body for one of our `ApiError`s."""
    return openai_error_body(error.message, error.error_type, error.param, error.code)


_ERROR_TYPE_BY_STATUS: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "conflict_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_type_for_status(status_code: int) -> str:
    """The OpenAI error `type` string for an HTTP status (for errors raised outside our
    own `ApiError`s, e.g. Starlette's 404/405)."""
    if status_code in _ERROR_TYPE_BY_STATUS:
        return _ERROR_TYPE_BY_STATUS[status_code]
    return "invalid_request_error" if 400 <= status_code < 500 else "server_error"


_UNION_BRANCH_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "null"})


def param_from_location(location: Sequence[str | int]) -> str | None:
    """Turn a pydantic error location into OpenAI's parameter notation.

    `("body", "messages", 0, "content")` becomes `messages[0].content`; the leading
    FastAPI source segment (`body`, `query`, ...) is dropped.
    """
    parts = list(location)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    # Pydantic names the union member it tried (`str`, `list[...]`, `function-after[...]`);
    # those are not request fields.
    parts = [
        part
        for part in parts
        if isinstance(part, int) or not (part in _UNION_BRANCH_NAMES or part.endswith("]"))
    ]
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else part
    return param or None


def without_union_tags(errors: Sequence[Mapping[str, Any]], body: Any) -> list[dict[str, Any]]:
    """The errors with the union tags pydantic puts in a location removed, found by walking
    the request body along it.

    A tagged union's branch is part of pydantic's location (`("body", "messages", 0, "user",
    "content")` for a user message), which is no request field: a segment that is not a key
    of the JSON object reached so far (and is not the last, which may name a missing field)
    is such a tag. `param_from_location` then reads `messages[0].content`, as the client
    wrote it.

    Args:
        errors: `RequestValidationError.errors()` entries (FastAPI's `body` segment first).
        body: The parsed JSON body the errors are about.
    """
    cleaned: list[dict[str, Any]] = []
    for error in errors:
        location = tuple(error.get("loc", ()))
        if not location or location[0] != "body":
            cleaned.append(dict(error))
            continue
        kept: list[str | int] = [location[0]]
        node: Any = body
        last = len(location) - 1
        for index, part in enumerate(location[1:], start=1):
            in_list = isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node)
            if in_list or (isinstance(part, str) and isinstance(node, dict) and part in node):
                node = node[part]
            elif isinstance(part, str) and isinstance(node, dict | list) and index < last:
                continue  # a union tag: the JSON has no such key here
            else:
                node = None
            kept.append(part)
        cleaned.append({**error, "loc": tuple(kept)})
    return cleaned


def describe_validation_errors(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """Summarise pydantic/FastAPI validation errors as one client-facing message.

    Args:
        errors: `ValidationError.errors()` / `RequestValidationError.errors()` entries.

    Returns:
        (message naming every failing parameter, the first failing parameter or None).
    """
    descriptions: list[str] = []
    first_param: str | None = None
    for error in errors:
        param = param_from_location(tuple(error.get("loc", ())))
        if first_param is None:
            first_param = param
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        descriptions.append(f"{param}: {message}" if param else message)
    if not descriptions:
        return "invalid request", None
    return "; ".join(descriptions), first_param


SCALAR_TYPE_ERRORS = frozenset({"int_type", "float_type", "bool_type", "string_type"})
"""pydantic's error types for a value of the wrong JSON type where a number, boolean or
string belongs. Request models are strict (`exo.api.wire.request_model`), so `"12"`,
`true` or `12.0` for an integer, `"0.5"` for a number and `"yes"` or `1` for a boolean
all end up here."""


def first_scalar_type_error(
    errors: Sequence[Mapping[str, Any]],
) -> tuple[tuple[str | int, ...], str, Any] | None:
    """(location without FastAPI's source segment, pydantic error type, the value sent)
    when the first failing field failed only for being of the wrong scalar type, else None.
    A field that is a union of several types (each branch its own error) is not one."""
    if not errors:
        return None
    location = tuple(errors[0].get("loc", ()))
    same_field = [error for error in errors if tuple(error.get("loc", ())) == location]
    if len(same_field) != 1 or same_field[0].get("type") not in SCALAR_TYPE_ERRORS:
        return None
    if location and location[0] in ("body", "query", "path", "header"):
        location = location[1:]
    return location, str(same_field[0]["type"]), same_field[0].get("input")


_OPENAI_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a decimal",
    "bool_type": "a boolean",
    "string_type": "a string",
}


def _openai_kind(value: Any) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int():
            return "an integer"
        case float():
            return "a decimal number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return "an object"


def _without_other_branches(errors: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The errors less those of a union's scalar branch that an array or object was sent to
    (the `str` branch of `str | list[...]` answering "should be a valid string" for a list)
    while the branch the value is of has errors of its own: those say what is wrong."""

    def field_of(error: Mapping[str, Any]) -> tuple[Any, ...]:
        location = tuple(error.get("loc", ()))
        return location[:-1] if location and location[-1] in _UNION_BRANCH_NAMES else location

    def other_branch(error: Mapping[str, Any]) -> bool:
        if error.get("type") not in SCALAR_TYPE_ERRORS:
            return False
        if not isinstance(error.get("input"), list | dict):
            return False
        field = field_of(error)
        return any(
            other is not error and tuple(other.get("loc", ()))[: len(field)] == field
            for other in errors
        )

    kept = [error for error in errors if not other_branch(error)]
    return kept or list(errors)


def _first_missing_field(errors: Sequence[Mapping[str, Any]]) -> str | None:
    """The parameter of the first error when it is a required field left out (pydantic's
    `missing`), else None."""
    if not errors or errors[0].get("type") != "missing":
        return None
    return param_from_location(tuple(errors[0].get("loc", ())))  # None for the whole body


SPECULATIVE_VALUES = 'true, false or "auto"'
"""What exo's `speculative` extension takes (`exo.api.wire.request_model.Speculative`)."""


def speculative_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str | None, Any] | None:
    """(param, the value sent) when the first error is a bad `speculative`, else None.

    `speculative` is a union of a strict boolean and "auto": pydantic answers with one
    error per branch ("should be a valid boolean", "should be 'auto'"), neither of which
    names what the field takes, so every dialect words it whole (`SPECULATIVE_VALUES`)."""
    if not errors:
        return None
    location = tuple(errors[0].get("loc", ()))
    fields = [part for part in location if isinstance(part, int) or not _is_branch(part)]
    if not fields or fields[-1] != "speculative":
        return None
    return param_from_location(location), errors[0].get("input")


def _is_branch(part: str) -> bool:
    """A union member's name in a pydantic location (`bool`, `literal['auto']`)."""
    return part in _UNION_BRANCH_NAMES or part.endswith("]")


def describe_openai_validation_errors(
    path: str, errors: Sequence[Mapping[str, Any]]
) -> tuple[str, str | None, str | None]:
    """OpenAI's wording for a required field left out (code `missing_required_parameter`):
    "Missing required parameter: 'messages[0].content'.", for a value of the wrong type
    (code `invalid_type`): "Invalid type for 'max_tokens': expected an integer, but got a
    string instead.", for an integer out of its range (codes `integer_below_min_value` /
    `integer_above_max_value`): "Invalid 'max_output_tokens': integer below minimum value.
    Expected a value >= 16, but got 10 instead.", "Invalid 'n': integer above maximum value.
    Expected a value <= 128, but got 200 instead." and for an array over its length (code
    `array_above_max_length`): "Invalid 'stop': array too long. Expected an array with
    maximum length 4, but got an array with length 9 instead." (OpenAI names the first such
    field only; sentences as OpenAI's API answers them, seen in its clients' bug reports);
    `describe_validation_errors` for everything else.

    Returns:
        (message, param, code).
    """
    speculative = speculative_error(errors)
    if speculative is not None:
        param, value = speculative
        if isinstance(value, str):  # a string, but not "auto": a value outside the set
            return (
                f"Invalid value: '{value}'. Supported values are: true, false, and 'auto'.",
                param,
                "invalid_value",
            )
        return (
            f"Invalid type for '{param}': expected {SPECULATIVE_VALUES}, but got "
            f"{_openai_kind(value)} instead.",
            param,
            "invalid_type",
        )
    errors = _without_other_branches(errors)
    missing = _first_missing_field(errors)
    if missing is not None:
        return f"Missing required parameter: '{missing}'.", missing, "missing_required_parameter"
    out_of_bounds = _first_out_of_bounds(errors)
    if out_of_bounds is not None:
        return out_of_bounds
    invalid_value = _first_invalid_value(errors)
    if invalid_value is not None:
        return invalid_value
    mismatch = first_scalar_type_error(errors)
    if mismatch is None:
        return (*describe_validation_errors(errors), None)
    location, error_type, value = mismatch
    param = param_from_location(location)
    message = (
        f"Invalid type for '{param}': expected {_OPENAI_EXPECTED[error_type]}, but got "
        f"{_openai_kind(value)} instead."
    )
    return message, param, "invalid_type"


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_out_of_bounds(
    errors: Sequence[Mapping[str, Any]],
) -> tuple[str, str | None, str] | None:
    """OpenAI's (message, param, code) when the first failing field fails only for being an
    integer outside its `ge` / `le` bounds or an array longer than its `max_length`, else
    None."""
    if not errors:
        return None
    first = errors[0]
    location = tuple(first.get("loc", ()))
    if any(tuple(error.get("loc", ())) == location for error in errors[1:]):
        return None
    value, context = first.get("input"), first.get("ctx") or {}
    param = param_from_location(location)
    match first.get("type"):
        case "greater_than_equal" if _is_integer(value) and _is_integer(context.get("ge")):
            return (
                f"Invalid '{param}': integer below minimum value. Expected a value >= "
                f"{context['ge']}, but got {value} instead.",
                param,
                "integer_below_min_value",
            )
        case "less_than_equal" if _is_integer(value) and _is_integer(context.get("le")):
            return (
                f"Invalid '{param}': integer above maximum value. Expected a value <= "
                f"{context['le']}, but got {value} instead.",
                param,
                "integer_above_max_value",
            )
        case "too_long" if isinstance(value, list) and _is_integer(context.get("max_length")):
            return (
                f"Invalid '{param}': array too long. Expected an array with maximum length "
                f"{context['max_length']}, but got an array with length {len(value)} instead.",
                param,
                "array_above_max_length",
            )
        case _:
            return None


_OBJECT_BRANCH_ERRORS = frozenset({"model_type", "dict_type", "model_attributes_type"})


def _first_invalid_value(
    errors: Sequence[Mapping[str, Any]],
) -> tuple[str, str | None, str] | None:
    """OpenAI's "Invalid value: 'ultra'. Supported values are: 'low', 'medium', and 'high'."
    (its clients' bug reports quote it), param and code `invalid_value` when the first
    failing field is a string outside its values (`literal_error`; `union_tag_invalid` for a
    tag such as a message's `role`, the param OpenAI names) and fails nothing else but its
    union's object branches (`tool_choice`); else None."""
    if not errors or not isinstance(errors[0].get("input"), str | dict):
        return None
    context, location = errors[0].get("ctx") or {}, tuple(errors[0].get("loc", ()))
    match errors[0].get("type"), errors[0].get("input"):
        case "literal_error", str(value):
            allowed, param = context.get("expected", ""), param_from_location(location)
        case "union_tag_invalid", dict():
            value, allowed = str(context.get("tag", "")), context.get("expected_tags", "")
            discriminator = str(context.get("discriminator", "")).strip("'")
            param = param_from_location((*location, discriminator))
        case _:
            return None

    def top(param: str | None) -> str:  # the body's top-level field of a param
        return (param or "").split(".")[0].split("[")[0]

    if any(
        error.get("type") not in _OBJECT_BRANCH_ERRORS
        for error in errors[1:]
        if top(param_from_location(tuple(error.get("loc", ())))) == top(param)
    ):
        return None
    names = re.findall(r"'[^']*'", allowed)
    listed = " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + f", and {names[-1]}"
    return f"Invalid value: '{value}'. Supported values are: {listed}.", param, "invalid_value"


def describe_plain_validation_errors(
    path: str, errors: Sequence[Mapping[str, Any]]
) -> tuple[str, str | None, str | None]:
    """`describe_validation_errors` with no code: pydantic's own sentences, which are
    Anthropic's too ("max_tokens: Input should be a valid integer"); a bad `speculative`
    in the same form, naming what it takes."""
    speculative = speculative_error(errors)
    if speculative is not None:
        param = speculative[0]
        return f"{param}: Input should be {SPECULATIVE_VALUES}", param, None
    return (*describe_validation_errors(errors), None)


ErrorBodyRenderer = Callable[[int, str, str, "str | None", "str | None"], dict[str, Any]]
"""(HTTP status, OpenAI-style error type, message, param, code) -> the dialect's JSON body."""
ValidationDescriber = Callable[
    [str, Sequence[Mapping[str, Any]]], tuple[str, "str | None", "str | None"]
]
"""(request path, pydantic errors of the body) -> (message, param, code), worded as the
dialect's reference API words a body that does not match its schema."""


@dataclass(frozen=True, slots=True)
class ErrorDialect:
    """How the routes under `path_prefixes` shape error bodies and word a body that does
    not match the schema (a 400 in every dialect, as OpenAI, Anthropic and Ollama answer
    it)."""

    name: str
    path_prefixes: tuple[str, ...]
    render: ErrorBodyRenderer
    describe: ValidationDescriber = describe_plain_validation_errors

    def matches(self, path: str) -> bool:
        return any(path == prefix or path.startswith(prefix + "/") for prefix in self.path_prefixes)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

# The engine's sentence for a prompt that leaves no room for a reply
# (`exo.worker.engines.torch.engine_requests.PromptTooLongError`), which gives the model's
# context beside a smaller bound (the instance's KV cache budget, or Ollama's `num_ctx`).
_ENGINE_OVERFLOW = re.compile(
    r"the prompt is (\d+) tokens; the (model's|request's) (context|KV cache budget) is "
    r"(\d+) tokens(?: \(the model's context is (\d+) tokens\))?"
)


class ContextOverflow(NamedTuple):
    """A context-overflow error's numbers.

    Attributes:
        prompt_tokens: the prompt's tokens.
        limit: the most tokens the request may hold (the bound it is over).
        bound: what sets `limit`: "context" (the model's), "kv_cache" (the instance's KV
            cache budget: `--kv-cache-tokens` or the node's free memory) or "request"
            (the request's own context, Ollama's `num_ctx`).
        context_length: the model's context where another bound is lower, else None.
    """

    prompt_tokens: int
    limit: int
    bound: str = "context"
    context_length: int | None = None

    def note(self) -> str:
        """Why the limit is not the model's context, as a clause to append ("" where it
        is): clients read the dialect's numbers (`limit`, the bound that applies), people
        read this."""
        if self.bound == "kv_cache":
            context = f"; the model's context is {self.context_length} tokens" if (
                self.context_length is not None
            ) else ""  # fmt: skip
            return (
                " (the most this instance's KV cache holds for a request, set by "
                f"--kv-cache-tokens or the node's free memory{context})"
            )
        if self.bound == "request":
            return f" (the request's context, num_ctx, is {self.limit} tokens)"
        return ""


def context_overflow(message: str, code: str | None) -> ContextOverflow | None:
    """The numbers of a context-overflow error whose message gives them, else None. Each
    dialect rewords it as its reference API does, since clients (Claude Code's compaction,
    LiteLLM's `ContextWindowExceededError`) match those sentences, with the bound that
    applies in the number's place and `ContextOverflow.note` after it where that bound is
    not the model's context."""
    if code != CONTEXT_LENGTH_EXCEEDED:
        return None
    match = _ENGINE_OVERFLOW.search(message)
    if match is None:
        return None
    prompt_tokens, whose, what, limit, context = match.groups()
    bound = "request" if whose == "request's" else "kv_cache" if what != "context" else "context"
    return ContextOverflow(
        int(prompt_tokens), int(limit), bound, None if context is None else int(context)
    )


OverflowMessage = Callable[[ContextOverflow], str]
"""A context overflow's numbers -> the reference API's sentence."""


def openai_context_overflow_message(overflow: ContextOverflow) -> str:
    """OpenAI's Chat Completions sentence for messages over the context."""
    return (
        f"This model's maximum context length is {overflow.limit} tokens{overflow.note()}. "
        f"However, your messages resulted in {overflow.prompt_tokens} tokens. Please reduce "
        "the length of the messages."
    )


def completions_context_overflow_message(overflow: ContextOverflow) -> str:
    """OpenAI's legacy Completions sentence for a prompt over the context: the prompt alone
    overflows (exo caps `max_tokens` to the room a prompt leaves), so the completion asks
    for 0 tokens."""
    prompt_tokens = overflow.prompt_tokens
    return (
        f"This model's maximum context length is {overflow.limit} tokens{overflow.note()}, "
        f"however you requested {prompt_tokens} tokens ({prompt_tokens} in your prompt; 0 "
        "for the completion). Please reduce your prompt; or completion length."
    )


def responses_context_overflow_message(overflow: ContextOverflow) -> str:
    """OpenAI's Responses sentence for an input over the context window, then the numbers
    (OpenAI's gives none; clients match the sentence and the code)."""
    what = "the model's context" if overflow.bound == "context" else "the limit"
    return (
        "Your input exceeds the context window of this model. Please adjust your input and "
        f"try again. (The input is {overflow.prompt_tokens} tokens; {what} is "
        f"{overflow.limit}{overflow.note()}.)"
    )


def openai_renderer(overflow_message: OverflowMessage) -> ErrorBodyRenderer:
    """OpenAI's error body, a context overflow worded by `overflow_message` (each OpenAI
    API words it its own way: clients such as LiteLLM match those sentences)."""

    def render(
        status_code: int, error_type: str, message: str, param: str | None, code: str | None
    ) -> dict[str, Any]:
        overflow = context_overflow(message, code)
        if overflow is not None:
            message = overflow_message(overflow)
        return openai_error_body(message, error_type, param, code)

    return render


OPENAI_ERRORS = ErrorDialect(
    "openai",
    (),
    openai_renderer(openai_context_overflow_message),
    describe_openai_validation_errors,
)
"""The default for every route no other dialect claims (Chat Completions' wording)."""
