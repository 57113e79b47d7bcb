"""A JSON recogniser that follows a JSON Schema (a subset of it), used for a forced tool
call's `arguments` and for a JSON-schema response format's whole answer.

Supported (anything else is read as "any JSON value", so an unsupported schema never makes
a valid call impossible). A response format's schema that is invalid or matches no value
never gets here: the API refuses it first (`exo.shared.json_schema.find_unfollowable`).
Tool parameter schemas are checked for validity only (`find_invalid`), so the "any value"
fallback below for an unsatisfiable `enum` serves them; the one for an unknown `type`
only guards callers that skip the API's checks:

- `type`: "string", "integer" (integer syntax only: no fraction or exponent), "number",
  "boolean", "null", "array", "object", or a list of these (any one of them).
- `enum` / `const`: exactly one of the listed values, written as `json.dumps` writes it
  (ASCII, `", "` and `": "` inside containers); filtered by `type` when both are given.
- "array": elements follow `items` (any value without it). Length limits are not enforced.
- "object" with `properties`: keys are only the declared names (plus undeclared `required`
  names, whose values are then any value; never a name whose schema is `false`), each at
  most once, written as `json.dumps` writes them (non-ASCII characters as `\\uXXXX`); `}`
  only once every `required` key is present. Other keys are refused even when
  `additionalProperties` is not false: a small model left free tends to copy the tool
  definition instead of filling the parameters.
  An object without `properties` is any object.
- No `type`, or `anyOf`/`oneOf`/`allOf`/`$ref`/`not`/`if`: any JSON value. String formats,
  patterns, lengths and numeric bounds are not enforced.

The top level of a tool call's arguments is always an object; a parameters schema that
declares no properties and no other keys (`{}`, `{"type": "object"}`) means "no
parameters": `{}`. A response format's schema may describe any value at the top level
(`compile_document_schema`); a top-level number ends as soon as it may (the constraint
stops generation once the document is complete).

The state is a few scalars plus an immutable tuple of container frames that point into the
compiled (shared, immutable) schema, so `copy` is O(1), as `TokenConstraint` needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from exo.shared.json_schema import (
    ANY_KIND,
    ARRAY,
    BOOLEAN,
    INTEGER,
    NULL,
    NUMBER,
    OBJECT,
    STRING,
    kinds_of,
    value_fits,
)
from exo.worker.engines.torch.decoding.json_lexing import (
    ARRAY_FIRST,
    COLON,
    DIGITS,
    DONE,
    KEY,
    LITERAL,
    NUMBER_CAN_END,
    OBJECT_FIRST,
    OBJECT_KEY,
    VALUE,
    JsonLexer,
    number_start_mode,
)
from exo.worker.engines.torch.decoding.json_lexing import (
    STRING as STRING_MODE,  # STRING: a kind here
)

# Keywords whose meaning this subset does not follow: the schema becomes "any value".
_UNSUPPORTED = ("anyOf", "oneOf", "allOf", "$ref", "not", "if")
# Keywords after which a top-level object without `properties` still takes keys.
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "propertyNames", "minProperties")
# Deeper schemas are read as any value (a recursive or hostile schema stays bounded).
_MAX_SCHEMA_DEPTH = 16


@dataclass(frozen=True, slots=True, eq=False)
class Literals:
    """A finite set of JSON texts, matched character by character."""

    texts: frozenset[str]
    prefixes: frozenset[str]  # every non-empty prefix of every text
    # Texts no other text extends: the value ends on their last character.
    terminal: frozenset[str]

    @staticmethod
    def of(texts: Iterable[str]) -> Literals:
        texts = frozenset(texts)
        prefixes = frozenset(text[:end] for text in texts for end in range(1, len(text) + 1))
        extended = {text[:end] for text in texts for end in range(1, len(text))}
        return Literals(texts, prefixes, texts - extended)


@dataclass(frozen=True, slots=True, eq=False)
class ObjectKeys:
    """The declared keys of an object schema, as JSON string texts (with quotes)."""

    texts: tuple[str, ...]
    values: tuple[ValueSchema, ...]
    index: Mapping[str, int]  # key text -> position
    prefix_masks: Mapping[str, int]  # key text prefix -> bit mask of keys starting with it
    required: int  # bit mask
    all: int  # bit mask of every key

    @staticmethod
    def of(keys: Mapping[str, ValueSchema], required: Iterable[str]) -> ObjectKeys:
        texts = tuple(json.dumps(name) for name in keys)
        prefix_masks: dict[str, int] = {}
        for position, text in enumerate(texts):
            for end in range(1, len(text) + 1):
                prefix_masks[text[:end]] = prefix_masks.get(text[:end], 0) | 1 << position
        names = list(keys)
        required_mask = 0
        for name in required:
            required_mask |= 1 << names.index(name)
        return ObjectKeys(
            texts=texts,
            values=tuple(keys.values()),
            index={text: position for position, text in enumerate(texts)},
            prefix_masks=prefix_masks,
            required=required_mask,
            all=(1 << len(texts)) - 1,
        )


@dataclass(frozen=True, slots=True, eq=False)
class ValueSchema:
    """What one JSON value may be (compiled from a JSON Schema by `compile_schema`).

    `literals`, when set, overrides `kinds`. `items` None: any elements. `keys` None: any
    object.
    """

    kinds: int = ANY_KIND
    items: ValueSchema | None = None
    keys: ObjectKeys | None = None
    literals: Literals | None = field(default=None)


ANY_VALUE = ValueSchema()
ANY_OBJECT = ValueSchema(kinds=OBJECT)
NO_PARAMETERS = ValueSchema(kinds=OBJECT, keys=ObjectKeys.of({}, ()))
_BOOLEAN_LITERALS = ValueSchema(literals=Literals.of(("true", "false")))
_NULL_LITERAL = ValueSchema(literals=Literals.of(("null",)))


def _literal_text(value: Any) -> str | None:
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return None


def compile_schema(schema: Any, depth: int = 0) -> ValueSchema:
    """The supported part of a JSON Schema (see the module docstring); unsupported or
    unsatisfiable parts become `ANY_VALUE`."""
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return ANY_VALUE
    if any(keyword in schema for keyword in _UNSUPPORTED):
        return ANY_VALUE
    kinds = kinds_of(schema["type"]) if "type" in schema else ANY_KIND
    if kinds == 0:  # an unknown type name only
        kinds = ANY_KIND
    if isinstance(schema.get("enum"), list) or "const" in schema:
        values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]]
        texts = [_literal_text(value) for value in values if value_fits(value, kinds)]
        present = [text for text in texts if text is not None]
        # An unsatisfiable enum falls back to any value rather than to a dead end.
        return ValueSchema(literals=Literals.of(present)) if present else ANY_VALUE
    if "type" not in schema:
        return ANY_VALUE
    items = None
    if kinds & ARRAY and isinstance(schema.get("items"), dict):
        items = compile_schema(schema["items"], depth + 1)
    keys = None
    if kinds & OBJECT and isinstance(schema.get("properties"), dict):
        keys = _compile_keys(schema, depth)
    return ValueSchema(kinds=kinds, items=items, keys=keys)


def _compile_keys(schema: dict[str, Any], depth: int) -> ObjectKeys:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        properties = {}
    # A property whose schema is `false` may not be present: its key is never written.
    forbidden = {name for name, value in properties.items() if value is False}
    values = {
        name: compile_schema(value, depth + 1)
        for name, value in properties.items()
        if isinstance(name, str) and name not in forbidden
    }
    required_field = schema.get("required")
    # A forbidden required name (only a tool schema gets here: the API refuses such a
    # response schema) is dropped rather than leaving the object no way to close.
    required = [
        name for name in dict.fromkeys(required_field or ())
        if isinstance(name, str) and name not in forbidden
    ] if isinstance(required_field, list) else []  # fmt: skip
    for name in required:  # a required name without a declaration: any value
        values.setdefault(name, ANY_VALUE)
    return ObjectKeys.of(values, required)


def compile_arguments_schema(parameters: Mapping[str, Any]) -> ValueSchema:
    """The schema of a tool call's `arguments`: always an object.

    Args:
        parameters: `ToolDefinition.parameters` (a JSON Schema; `{}`: no parameters).

    Returns:
        the compiled object schema when it declares `properties` or `required`;
        `NO_PARAMETERS` when it declares nothing (no open-object keywords such as
        `additionalProperties`, no combinators, `type` absent or "object"); else
        `ANY_OBJECT`.
    """
    schema = dict(parameters)
    if any(keyword in schema for keyword in _UNSUPPORTED):
        return ANY_OBJECT
    if "properties" in schema or "required" in schema:
        # Arguments are an object whatever `type` says (often missing at the top level).
        return ValueSchema(kinds=OBJECT, keys=_compile_keys(schema, 0))
    if any(keyword in schema for keyword in _OPEN_OBJECT):
        return ANY_OBJECT
    return NO_PARAMETERS if kinds_of(schema.get("type", "object")) & OBJECT else ANY_OBJECT


def compile_document_schema(schema: Mapping[str, Any]) -> ValueSchema:
    """The schema of a whole structured answer (a JSON-schema response format).

    Args:
        schema: a JSON Schema of any value; one that declares `properties` or `required`
            without a `type` is read as an object schema (as tool parameters are).

    Returns:
        the compiled schema (`ANY_VALUE` for what this subset cannot follow).
    """
    if "type" not in schema and ("properties" in schema or "required" in schema):
        return compile_schema({**schema, "type": "object"})
    return compile_schema(dict(schema))


# A container frame: (is an object, its schema, bit mask of declared keys already written).
Frame = tuple[bool, ValueSchema, int]


class SchemaJsonRecognizer(JsonLexer[Frame]):
    """Accepts exactly the prefixes of one JSON value that follows a compiled schema,
    character by character (the `CharRecognizer` protocol of `constrained`).

    The lexical modes (strings, numbers, whitespace) are `json_lexing.JsonLexer`'s, shared
    with `constrained.JsonRecognizer`, so both read JSON (RFC 8259) identically; this class
    adds which values and keys the schema allows. Declared keys and enum strings are read
    in KEY and LITERAL mode, not STRING_MODE: they are ASCII (JSON-escaped), so
    `in_string` (no partial UTF-8 allowed outside it) is right for them too.

    Args:
        schema: from `compile_schema` / `compile_arguments_schema`.
        max_whitespace_run: most whitespace characters in a row outside strings.
    """

    __slots__ = ("_is_key", "_node", "_typed")

    def __init__(self, schema: ValueSchema, max_whitespace_run: int) -> None:
        self._max_whitespace_run = max_whitespace_run
        self._mode = VALUE
        self._node = schema  # the schema of the value being read or about to start
        self._stack = ()
        self._is_key = False  # the free string is a key
        self._typed = ""  # characters of the literal or key read so far
        self._whitespace_run = 0

    def copy(self) -> SchemaJsonRecognizer:
        other = SchemaJsonRecognizer.__new__(SchemaJsonRecognizer)
        other._max_whitespace_run = self._max_whitespace_run
        other._mode = self._mode
        other._node = self._node
        other._stack = self._stack
        other._is_key = self._is_key
        other._typed = self._typed
        other._whitespace_run = self._whitespace_run
        return other

    @property
    def is_complete(self) -> bool:
        if self._mode == DONE:
            return True
        if self._stack:
            return False
        if self._mode == LITERAL:
            literals = self._node.literals
            return literals is not None and self._typed in literals.texts
        return self._mode in NUMBER_CAN_END

    def _end_string(self) -> None:
        if self._is_key:
            self._is_key, self._mode, self._node = False, COLON, ANY_VALUE
        else:
            self._end_value()

    def _start_value(self, character: str) -> bool:
        node = self._node
        literals = node.literals
        if literals is not None:
            if character not in literals.prefixes:
                return False
            self._mode, self._typed = LITERAL, ""
            return self._feed_literal(character)
        kinds = node.kinds
        if character == '"' and kinds & STRING:
            self._mode, self._is_key = STRING_MODE, False
        elif character == "{" and kinds & OBJECT:
            self._stack += ((True, node, 0),)
            self._mode = OBJECT_FIRST
        elif character == "[" and kinds & ARRAY:
            self._stack += ((False, node, 0),)
            self._mode = ARRAY_FIRST
            self._node = node.items or ANY_VALUE
        elif character in DIGITS or character == "-":
            if not kinds & (INTEGER | NUMBER):
                return False
            self._mode = number_start_mode(character, integer_only=not kinds & NUMBER)
        elif character in "tf" and kinds & BOOLEAN:
            self._node, self._mode, self._typed = _BOOLEAN_LITERALS, LITERAL, character
        elif character == "n" and kinds & NULL:
            self._node, self._mode, self._typed = _NULL_LITERAL, LITERAL, character
        else:
            return False
        return True

    def _feed_literal(self, character: str) -> bool:
        literals = self._node.literals
        assert literals is not None
        typed = self._typed + character
        if typed in literals.prefixes:
            self._typed = typed
            if typed in literals.terminal:
                self._end_value()
            return True
        if self._typed in literals.texts:
            # A literal another one extends (enum [1, 12]) ended; the character follows it.
            self._end_value()
            return self.feed(character)
        return False

    def _start_key(self, character: str, closing_allowed: bool) -> bool:
        _is_object, node, seen = self._stack[-1]
        keys = node.keys
        if character == "}":
            if not closing_allowed or (keys is not None and keys.required & ~seen):
                return False
            self._close()
            return True
        if character != '"':
            return False
        if keys is None:
            self._mode, self._is_key = STRING_MODE, True
            return True
        if not keys.all & ~seen:  # every declared key is written (or there are none)
            return False
        self._mode, self._typed = KEY, '"'
        return True

    def _feed_key(self, character: str) -> bool:
        is_object, node, seen = self._stack[-1]
        keys = node.keys
        assert keys is not None
        typed = self._typed + character
        if not keys.prefix_masks.get(typed, 0) & ~seen:
            return False
        position = keys.index.get(typed)
        if position is None:
            self._typed = typed
            return True
        self._stack = (*self._stack[:-1], (is_object, node, seen | 1 << position))
        self._mode, self._node = COLON, keys.values[position]
        return True

    def _after_value(self, character: str) -> bool:
        is_object, node, seen = self._stack[-1]
        if not is_object:
            if character == ",":
                self._mode, self._node = VALUE, node.items or ANY_VALUE
                return True
            if character == "]":
                self._close()
                return True
            return False
        keys = node.keys
        if character == ",":
            # A comma needs a key left to write.
            if keys is not None and not keys.all & ~seen:
                return False
            self._mode = OBJECT_KEY
            return True
        if character == "}":
            if keys is not None and keys.required & ~seen:
                return False
            self._close()
            return True
        return False
