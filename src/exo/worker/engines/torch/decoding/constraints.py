"""Constrained decoding: generation that can only produce one JSON object, one JSON value
that follows a JSON Schema, or one forced tool call `{"name": ..., "arguments": {...}}`.

Two layers:

- character level: `JsonRecognizer`, an incremental pushdown automaton over the JSON grammar
  (RFC 8259: objects, arrays, strings with escapes including `\\uXXXX`, numbers, literals),
  and `ToolCallRecognizer`, a fixed frame around a JSON object that follows the named
  tool's parameter schema (`json_schema_grammar.SchemaJsonRecognizer`). Feeding a
  character either advances the state or rejects the character; states copy in O(1) (the
  container stack is an immutable tuple), so a candidate token is checked on a copy. Both
  recognisers read strings, numbers and whitespace with the same lexer
  (`json_lexing.JsonLexer`), so they agree on what JSON text is.
- token level: `TokenConstraint` checks a token by feeding its bytes (UTF-8) to a copy of
  the recogniser. `TokenVocabulary` holds each token's raw bytes, precomputed once per
  engine.

Token policy (why some tokens are never allowed):
- special tokens (chat markers, EOS): their text is skipped when the output is decoded, so
  the recogniser's view and the visible text would disagree. EOS is allowed only once the
  value is complete (the engine stops there anyway).
- tokens with empty text: they make no progress (a model could loop on them).
- byte tokens that are only part of a UTF-8 character: allowed only inside JSON strings
  (the only place a multi-byte character may appear), and only while the bytes so far can
  still form a valid character; the character is checked when its last byte arrives.
- whitespace outside strings: at most `max_whitespace_run` characters in a row (default 2),
  so a model cannot spin on spaces or newlines until it runs out of tokens.

If `max_tokens` or the context ends first, the output is an incomplete prefix of a valid
document (the engine reports finish_reason "length").
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from typing import Any, Protocol

from exo.shared.types.text_generation import ToolDefinition
from exo.worker.engines.torch.decoding.json_lexing import (
    ARRAY_FIRST,
    COLON,
    LITERAL,
    OBJECT_FIRST,
    OBJECT_KEY,
    REJECT,
    STRING,
    VALUE,
    JsonLexer,
    number_start_mode,
)
from exo.worker.engines.torch.decoding.json_schema_grammar import (
    ANY_OBJECT,
    SchemaJsonRecognizer,
    ValueSchema,
    compile_arguments_schema,
    compile_document_schema,
)
from exo.worker.engines.torch.decoding.vocabulary import TokenVocabulary, split_incomplete_utf8

# At most this many whitespace characters in a row outside strings.
DEFAULT_MAX_WHITESPACE_RUN = 2

# The rest of a literal after its first character (RFC 8259 section 3).
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class CharRecognizer(Protocol):
    """An incremental recogniser over characters (what `TokenConstraint` drives)."""

    def copy(self) -> CharRecognizer: ...

    def feed(self, character: str) -> bool:
        """Advance by one character; False (state then undefined) if it is rejected."""
        ...

    @property
    def is_complete(self) -> bool:
        """The input so far is a complete document."""
        ...

    @property
    def in_string(self) -> bool:
        """Inside a JSON string's contents, where any character above U+001F may follow."""
        ...


class JsonRecognizer(JsonLexer[bool]):
    """Accepts exactly the prefixes of one JSON value (RFC 8259), character by character.

    The lexical modes (strings, numbers, whitespace) are `json_lexing.JsonLexer`'s, shared
    with `SchemaJsonRecognizer`; this class adds the grammar of any value. A stack entry is
    True for an object, False for an array.

    Args:
        top_level_object: the top-level value must be an object (`response_format`
            "json_object").
        max_whitespace_run: most whitespace characters in a row outside strings.
    """

    __slots__ = ("_is_key", "_literal", "_top_level_object")

    def __init__(
        self,
        top_level_object: bool = False,
        max_whitespace_run: int = DEFAULT_MAX_WHITESPACE_RUN,
    ) -> None:
        self._top_level_object = top_level_object
        self._max_whitespace_run = max_whitespace_run
        self._mode = VALUE
        self._stack = ()
        self._is_key = False  # the current string is an object key
        self._literal = ""  # characters left in true/false/null
        self._whitespace_run = 0

    def copy(self) -> JsonRecognizer:
        other = JsonRecognizer.__new__(JsonRecognizer)
        other._top_level_object = self._top_level_object
        other._max_whitespace_run = self._max_whitespace_run
        other._mode = self._mode
        other._stack = self._stack
        other._is_key = self._is_key
        other._literal = self._literal
        other._whitespace_run = self._whitespace_run
        return other

    def _end_string(self) -> None:
        if self._is_key:
            self._is_key = False
            self._mode = COLON
        else:
            self._end_value()

    def _start_key(self, character: str, closing_allowed: bool) -> bool:
        if character == "}" and closing_allowed:
            self._close()
            return True
        if character != '"':
            return False
        self._mode, self._is_key = STRING, True
        return True

    def _after_value(self, character: str) -> bool:
        in_object = self._stack[-1]
        if character == ",":
            self._mode = OBJECT_KEY if in_object else VALUE
            return True
        if character == ("}" if in_object else "]"):
            self._close()
            return True
        return False

    def _feed_literal(self, character: str) -> bool:
        if not self._literal.startswith(character):
            return False
        self._literal = self._literal[1:]
        if not self._literal:
            self._end_value()
        return True

    def _start_value(self, character: str) -> bool:
        if self._top_level_object and not self._stack and character != "{":
            return False
        if character == "{":
            self._stack += (True,)
            self._mode = OBJECT_FIRST
        elif character == "[":
            self._stack += (False,)
            self._mode = ARRAY_FIRST
        elif character == '"':
            self._mode, self._is_key = STRING, False
        elif character in _LITERALS:
            self._mode, self._literal = LITERAL, _LITERALS[character]
        else:
            mode = number_start_mode(character, integer_only=False)
            if mode == REJECT:
                return False
            self._mode = mode
        return True


class ToolCallRecognizer:
    """Accepts exactly `{"name": "<tool>", "arguments": <JSON object>}` with `<tool>` one of
    the offered names (JSON-escaped) and the keys in that order, spaced as written. The
    arguments follow the schema of the tool whose name was written (`json_schema_grammar`
    says which schemas are followed; the others allow any object).

    Args:
        tools: the tools the call may use (at least one), or bare names (any object).
        max_whitespace_run: as `JsonRecognizer`, inside the arguments.

    Raises:
        ValueError: no tools.
    """

    PREFIX = '{"name": "'
    MIDDLE = ', "arguments": '
    SUFFIX = "}"

    __slots__ = (
        "_arguments",
        "_max_whitespace_run",
        "_names",
        "_phase",
        "_schema",
        "_schemas",
        "_typed",
    )

    def __init__(
        self,
        tools: Sequence[ToolDefinition | str],
        max_whitespace_run: int = DEFAULT_MAX_WHITESPACE_RUN,
    ) -> None:
        if not tools:
            raise ValueError("a forced tool call needs at least one tool name")
        # Each name as it appears between the quotes (JSON-escaped, ASCII only), followed by
        # the closing quote, with its arguments schema; a repeated name keeps its first.
        schemas: dict[str, ValueSchema] = {}
        for tool in tools:
            if isinstance(tool, str):
                name, schema = tool, ANY_OBJECT
            else:
                name, schema = tool.name, compile_arguments_schema(tool.parameters)
            schemas.setdefault(json.dumps(name)[1:], schema)
        self._names: tuple[str, ...] = tuple(schemas)
        self._schemas: dict[str, ValueSchema] = schemas
        self._max_whitespace_run = max_whitespace_run
        self._phase = 0  # 0 prefix, 1 name, 2 middle, 3 arguments, 4 suffix, 5 done
        self._typed = ""  # characters of the current literal / name read so far
        self._schema = ANY_OBJECT  # the written name's arguments schema (set in phase 1)
        self._arguments: SchemaJsonRecognizer | None = None  # created on entering phase 3

    def copy(self) -> ToolCallRecognizer:
        other = ToolCallRecognizer.__new__(ToolCallRecognizer)
        other._names = self._names
        other._schemas = self._schemas
        other._max_whitespace_run = self._max_whitespace_run
        other._phase = self._phase
        other._typed = self._typed
        other._schema = self._schema
        other._arguments = None if self._arguments is None else self._arguments.copy()
        return other

    @property
    def is_complete(self) -> bool:
        return self._phase == 5

    @property
    def in_string(self) -> bool:
        # Names are ASCII (escaped), so partial UTF-8 bytes are not allowed in them.
        return self._arguments is not None and self._phase == 3 and self._arguments.in_string

    def feed(self, character: str) -> bool:
        match self._phase:
            case 0 | 2 | 4:
                literal = (self.PREFIX, "", self.MIDDLE, "", self.SUFFIX)[self._phase]
                typed = self._typed + character
                if not literal.startswith(typed):
                    return False
                if typed == literal:
                    self._phase, self._typed = self._phase + 1, ""
                    if self._phase == 3:
                        self._arguments = SchemaJsonRecognizer(
                            self._schema, self._max_whitespace_run
                        )
                else:
                    self._typed = typed
                return True
            case 1:
                typed = self._typed + character
                if not any(name.startswith(typed) for name in self._names):
                    return False
                schema = self._schemas.get(typed)
                if schema is not None:
                    self._phase, self._typed, self._schema = 2, "", schema
                else:
                    self._typed = typed
                return True
            case 3:
                assert self._arguments is not None
                if not self._arguments.feed(character):
                    return False
                if self._arguments.is_complete:
                    self._phase, self._arguments = 4, None
                return True
            case _:
                return False


def parse_forced_tool_call(text: str) -> tuple[str, str]:
    """Split the text of a completed forced tool call into its name and arguments.

    Returns:
        (tool name, arguments as compact JSON object text).

    Raises:
        ValueError: the text is not a complete tool call of the constrained shape.
    """
    try:
        value: Any = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"incomplete or invalid tool call: {error}") from error
    if (
        not isinstance(value, dict)
        or set(value) != {"name", "arguments"}
        or not isinstance(value["name"], str)
        or not isinstance(value["arguments"], dict)
    ):
        raise ValueError("a tool call is an object with a string name and object arguments")
    return value["name"], json.dumps(value["arguments"], ensure_ascii=False)


class TokenConstraint:
    """Which tokens may come next, given what the recogniser accepted so far.

    Args:
        recognizer: the character-level grammar (a fresh one; this object owns it).
        vocabulary: the engine's token table.
        eos_token_ids: ids that end generation; allowed only once the document is complete.
    """

    __slots__ = (
        "_checked",
        "_eos_token_ids",
        "_pending",
        "_pieces",
        "_recognizer",
        "_vocabulary",
    )

    def __init__(
        self,
        recognizer: CharRecognizer,
        vocabulary: TokenVocabulary,
        eos_token_ids: frozenset[int],
    ) -> None:
        self._recognizer = recognizer
        self._vocabulary = vocabulary
        self._pieces = vocabulary.constraint_pieces()
        self._eos_token_ids = eos_token_ids
        self._pending = b""  # bytes of a character started but not finished
        # The last checked token and the state it leads to (advance reuses it).
        self._checked: tuple[int, CharRecognizer, bytes] | None = None

    @property
    def is_complete(self) -> bool:
        return not self._pending and self._recognizer.is_complete

    def allowed(self, token_id: int) -> bool:
        """Whether `token_id` keeps the output a prefix of a valid document."""
        if token_id in self._eos_token_ids:
            return self.is_complete
        result = self._try(token_id)
        if result is None:
            return False
        self._checked = (token_id, *result)
        return True

    def allowed_tokens(self) -> list[int]:
        """Every token id allowed next, in no particular order.

        Walks the vocabulary sorted by text, feeding each token only the characters it does
        not share with the previous one, and skipping every token that starts with a
        rejected prefix; so it is cheap exactly when few tokens are allowed (when drawing
        and rejecting is slow), and costs about one pass over the vocabulary's characters
        at worst.
        """
        result = [token_id for token_id in self._eos_token_ids if self.is_complete]
        result.extend(
            token_id
            for token_id in self._vocabulary.constraint_index().byte_piece_ids
            if self._try(token_id) is not None
        )
        if self._pending:  # mid-character: only byte pieces can continue it
            return result
        index = self._vocabulary.constraint_index()
        texts, ids = index.texts, index.ids
        # states[k]: the recogniser after the first k characters of the previous text.
        states: list[CharRecognizer] = [self._recognizer]
        previous = ""
        position = 0
        while position < len(texts):
            text = texts[position]
            common = 0
            limit = min(len(previous), len(text), len(states) - 1)
            while common < limit and previous[common] == text[common]:
                common += 1
            del states[common + 1 :]
            previous = text
            for offset in range(common, len(text)):
                state = states[offset].copy()
                if not state.feed(text[offset]):
                    rejected = text[: offset + 1]
                    # Past every text that starts with the rejected prefix.
                    position = max(
                        position + 1, bisect.bisect_right(texts, rejected + "\U0010ffff", position)
                    )
                    break
                states.append(state)
            else:
                result.append(ids[position])
                position += 1
        return result

    def advance(self, token_id: int) -> None:
        """Accept `token_id` as the next token.

        Raises:
            ValueError: the token is not allowed.
        """
        if token_id in self._eos_token_ids:
            if not self.is_complete:
                raise ValueError(f"token {token_id} (EOS) is not allowed before completion")
            return
        if self._checked is not None and self._checked[0] == token_id:
            _token, recognizer, pending = self._checked
        else:
            result = self._try(token_id)
            if result is None:
                raise ValueError(f"token {token_id} is not allowed here")
            recognizer, pending = result
        self._recognizer, self._pending, self._checked = recognizer, pending, None

    def _try(self, token_id: int) -> tuple[CharRecognizer, bytes] | None:
        if not 0 <= token_id < len(self._pieces):
            return None
        piece = self._pieces[token_id]
        if piece is None:
            return None
        recognizer = self._recognizer.copy()
        if isinstance(piece, str) and not self._pending:
            for character in piece:
                if not recognizer.feed(character):
                    return None
            return recognizer, b""
        data = self._pending + (piece.encode("utf-8") if isinstance(piece, str) else piece)
        whole, tail = split_incomplete_utf8(data)
        try:
            text = whole.decode("utf-8")
        except UnicodeDecodeError:
            return None
        for character in text:
            if not recognizer.feed(character):
                return None
        if tail:
            if not recognizer.in_string:
                return None
            try:  # a tail that can never become a character (e.g. an overlong lead byte)
                tail.decode("utf-8")
            except UnicodeDecodeError as error:
                if error.reason != "unexpected end of data":
                    return None
        return recognizer, tail


def json_object_constraint(
    vocabulary: TokenVocabulary, eos_token_ids: frozenset[int]
) -> TokenConstraint:
    """Decoding restricted to one JSON object (`response_format` "json_object")."""
    return TokenConstraint(JsonRecognizer(top_level_object=True), vocabulary, eos_token_ids)


def json_schema_constraint(
    schema: dict[str, Any], vocabulary: TokenVocabulary, eos_token_ids: frozenset[int]
) -> TokenConstraint:
    """Decoding restricted to one JSON value that follows `schema` (`response_format`
    "json_schema"), as far as `json_schema_grammar` enforces JSON Schema."""
    recognizer = SchemaJsonRecognizer(compile_document_schema(schema), DEFAULT_MAX_WHITESPACE_RUN)
    return TokenConstraint(recognizer, vocabulary, eos_token_ids)


def tool_call_constraint(
    tools: Sequence[ToolDefinition], vocabulary: TokenVocabulary, eos_token_ids: frozenset[int]
) -> TokenConstraint:
    """Decoding restricted to one call of one of `tools` (a forced tool call), its
    arguments following that tool's parameter schema where `json_schema_grammar` can.

    Raises:
        ValueError: no tools.
    """
    recognizer = ToolCallRecognizer(tools)
    return TokenConstraint(recognizer, vocabulary, eos_token_ids)
