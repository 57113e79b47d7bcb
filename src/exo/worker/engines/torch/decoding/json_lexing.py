"""The lexical layer of JSON (RFC 8259), shared by the character-level recognisers of
constrained decoding: `constrained.JsonRecognizer` (any JSON value) and
`json_schema_grammar.SchemaJsonRecognizer` (a value that follows a schema).

Both read JSON one character at a time and differ only in what values and keys they allow,
so the parts where they must agree exactly live here, once:

- the mode numbers (one numbering for both, so the shared code can test them by range);
- strings (RFC 8259 section 7): unescaped characters from U+0020 up, the two-character
  escapes, and `\\uXXXX` (the count of hex digits still expected is part of the mode, so no
  counter needs copying);
- numbers (section 6): `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, as a
  transition table, with an integer-only variant (no fraction or exponent) for schemas of
  type "integer";
- whitespace between tokens (section 2), capped per run so a model cannot spin on it;
- `JsonLexer`, the base of both recognisers: it dispatches a character by mode, handles
  the lexical modes itself and leaves the structural ones (which values, keys and closing
  brackets are allowed) to the subclass.

The dispatch stays in one `feed` call per character with the string fast path first
(string contents are most of a typical document), because this runs in the decode loop for
every candidate token; the state is a few ints plus the subclass's immutable stack tuple,
so the subclasses' `copy` stays O(1).
"""

from __future__ import annotations

from typing import Generic, TypeVar

# RFC 8259 section 2: the four insignificant whitespace characters.
WHITESPACE = frozenset(" \t\n\r")
DIGITS = frozenset("0123456789")
HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
# RFC 8259 section 7: the characters that may follow a backslash (besides `u`).
SIMPLE_ESCAPES = frozenset('"\\/bfnrt')

# Most characters in one number (sign, digits, point, exponent): more than any int64 (20)
# or float64 in exponent notation needs.
MAX_NUMBER_LENGTH = 32

# Modes. Structural modes come first so that "whitespace may appear here" is `mode <= DONE`;
# the number modes come last so that "inside a number" is `mode >= MINUS`.
VALUE = 0  # a value must start here (object value, array element after ',', top level)
ARRAY_FIRST = 1  # after '[': a value or ']'
OBJECT_FIRST = 2  # after '{': a key or '}'
OBJECT_KEY = 3  # after ',' in an object: a key
COLON = 4  # after a key
AFTER_VALUE = 5  # after a value inside a container: ',' or the closing bracket
DONE = 6  # the top-level value is complete
ESCAPE = 7  # after a backslash in a string
STRING = 8  # inside a string (a free one: any characters)
HEX_1 = 9  # inside \uXXXX with 1 hex digit still expected
HEX_2 = 10
HEX_3 = 11
HEX_4 = 12  # right after \u
LITERAL = 13  # inside a literal (true/false/null, or a schema's enum text)
KEY = 14  # inside one of an object schema's declared keys (`SchemaJsonRecognizer` only)
MINUS = 15  # number: after '-'
ZERO = 16  # number: the integer part is '0'
INTEGER = 17  # number: in the integer digits
POINT = 18  # number: after '.'
FRACTION = 19  # number: in the fraction digits
EXPONENT_MARK = 20  # number: after 'e'/'E'
EXPONENT_SIGN = 21  # number: after the exponent's sign
EXPONENT = 22  # number: in the exponent digits
INTEGER_MINUS = 23  # integer-only number: after '-'
INTEGER_ZERO = 24  # integer-only number: '0'
INTEGER_DIGITS = 25  # integer-only number: in the digits

# Number modes where the number may end (the next character is not part of it).
NUMBER_CAN_END = frozenset({ZERO, INTEGER, FRACTION, EXPONENT, INTEGER_ZERO, INTEGER_DIGITS})

# Results of the step functions that are not a next mode.
REJECT = -1  # the character is not allowed here
NUMBER_ENDED = -2  # the number ended before the character, which belongs to what follows

# Number transitions: a row per number mode (from MINUS), a column per character class.
_ZERO_DIGIT, _NONZERO_DIGIT, _POINT, _EXPONENT_LETTER, _SIGN, _OTHER = range(6)
_NUMBER_CLASS = {
    "0": _ZERO_DIGIT,
    **dict.fromkeys("123456789", _NONZERO_DIGIT),
    ".": _POINT,
    "e": _EXPONENT_LETTER,
    "E": _EXPONENT_LETTER,
    "+": _SIGN,
    "-": _SIGN,
}
_R, _E = REJECT, NUMBER_ENDED
_NUMBER_TRANSITIONS: tuple[tuple[int, ...], ...] = (
    # '0'         '1'-'9'       '.'    'e'/'E'        '+'/'-'        other
    (ZERO, INTEGER, _R, _R, _R, _R),  # MINUS
    (_E, _E, POINT, EXPONENT_MARK, _E, _E),  # ZERO (no leading zeros: a digit ends it)
    (INTEGER, INTEGER, POINT, EXPONENT_MARK, _E, _E),  # INTEGER
    (FRACTION, FRACTION, _R, _R, _R, _R),  # POINT
    (FRACTION, FRACTION, _E, EXPONENT_MARK, _E, _E),  # FRACTION
    (EXPONENT, EXPONENT, _R, _R, EXPONENT_SIGN, _R),  # EXPONENT_MARK
    (EXPONENT, EXPONENT, _R, _R, _R, _R),  # EXPONENT_SIGN
    (EXPONENT, EXPONENT, _E, _E, _E, _E),  # EXPONENT
    (INTEGER_ZERO, INTEGER_DIGITS, _R, _R, _R, _R),  # INTEGER_MINUS
    (_E, _E, _E, _E, _E, _E),  # INTEGER_ZERO
    (INTEGER_DIGITS, INTEGER_DIGITS, _E, _E, _E, _E),  # INTEGER_DIGITS
)


def number_start_mode(character: str, integer_only: bool) -> int:
    """The mode after the first character of a number, or REJECT if a number cannot start
    with it.

    Args:
        character: the first character (`-` or a digit).
        integer_only: no fraction or exponent may follow (a schema of type "integer").
    """
    if character == "-":
        return INTEGER_MINUS if integer_only else MINUS
    if character == "0":
        return INTEGER_ZERO if integer_only else ZERO
    if character in DIGITS:
        return INTEGER_DIGITS if integer_only else INTEGER
    return REJECT


def next_number_mode(mode: int, character: str) -> int:
    """The number mode after `character`, NUMBER_ENDED if the number ended before it (the
    caller ends the value and feeds the character again), or REJECT.

    Args:
        mode: a number mode (MINUS to INTEGER_DIGITS).
    """
    return _NUMBER_TRANSITIONS[mode - MINUS][_NUMBER_CLASS.get(character, _OTHER)]


def escape_step(mode: int, character: str) -> int:
    """The string mode after `character` inside an escape (ESCAPE or HEX_1 to HEX_4), or
    REJECT."""
    if mode == ESCAPE:
        if character == "u":
            return HEX_4
        return STRING if character in SIMPLE_ESCAPES else REJECT
    # HEX_n - 1 is HEX_(n-1), and HEX_1 - 1 is STRING: the escape is complete.
    return mode - 1 if character in HEX_DIGITS else REJECT


FrameT = TypeVar("FrameT")


class JsonLexer(Generic[FrameT]):
    """The shared base of the JSON recognisers: the lexical modes and the dispatch.

    A subclass sets every slot in `__init__` and `copy` (both are hot: `TokenConstraint`
    copies a recogniser per candidate token, so there is no shared copy helper to call) and
    implements the structural hooks: `_start_value`, `_start_key`, `_after_value`,
    `_end_string`, `_feed_literal`, and `_feed_key` if it uses KEY.

    Feeding a character that is rejected leaves the state undefined (feed a copy when the
    answer matters).
    """

    __slots__ = ("_max_whitespace_run", "_mode", "_stack", "_whitespace_run")

    _max_whitespace_run: int  # most whitespace characters in a row outside strings
    _mode: int
    _stack: tuple[FrameT, ...]  # open containers, innermost last
    _whitespace_run: int  # also counts a number's characters while one is being read

    @property
    def is_complete(self) -> bool:
        """A whole value was read (a top-level number counts once it could end here)."""
        return self._mode == DONE or (not self._stack and self._mode in NUMBER_CAN_END)

    @property
    def in_string(self) -> bool:
        """Inside a free string's contents, where any character above U+001F may follow."""
        return self._mode == STRING

    @property
    def depth(self) -> int:
        """Open containers."""
        return len(self._stack)

    def feed_text(self, text: str) -> bool:
        """Feed every character of `text`; False at the first rejected one."""
        return all(self.feed(character) for character in text)

    def feed(self, character: str) -> bool:
        """Advance by one character; False if it is rejected (the state is then undefined:
        feed a copy when the answer matters)."""
        mode = self._mode
        if mode == STRING:
            if character == '"':
                self._end_string()
                return True
            if character == "\\":
                self._mode = ESCAPE
                return True
            return character >= " "  # control characters must be escaped
        if mode <= DONE and character in WHITESPACE:
            self._whitespace_run += 1
            return self._whitespace_run <= self._max_whitespace_run
        if mode >= MINUS:
            next_mode = next_number_mode(mode, character)
            if next_mode >= 0:
                self._mode = next_mode
                # A number's length is bounded too: a small model can otherwise write
                # digits until the context is full.
                self._whitespace_run += 1
                return self._whitespace_run < MAX_NUMBER_LENGTH
            if next_mode == REJECT:
                return False
            # The number ended; the character belongs to what follows it.
            self._whitespace_run = 0
            self._end_value()
            return self.feed(character)
        self._whitespace_run = 0
        if mode == AFTER_VALUE:
            return self._after_value(character)
        if mode == VALUE:
            return self._start_value(character)
        if mode == COLON:
            self._mode = VALUE
            return character == ":"
        if mode == LITERAL:
            return self._feed_literal(character)
        if mode == KEY:
            return self._feed_key(character)
        if mode == ARRAY_FIRST:
            if character == "]":
                self._close()
                return True
            return self._start_value(character)
        if mode in (OBJECT_FIRST, OBJECT_KEY):
            return self._start_key(character, closing_allowed=mode == OBJECT_FIRST)
        if ESCAPE <= mode <= HEX_4:
            next_mode = escape_step(mode, character)
            if next_mode == REJECT:
                return False
            self._mode = next_mode
            return True
        return False  # DONE: only whitespace may follow

    def _end_value(self) -> None:
        self._mode = AFTER_VALUE if self._stack else DONE

    def _close(self) -> None:
        self._stack = self._stack[:-1]
        self._end_value()

    # Structural hooks (the subclass's grammar).

    def _start_value(self, character: str) -> bool:
        """In VALUE or ARRAY_FIRST (not ']'): the first character of a value."""
        raise NotImplementedError

    def _start_key(self, character: str, closing_allowed: bool) -> bool:
        """In OBJECT_FIRST (`closing_allowed`) or OBJECT_KEY: a key's '"' or a '}'."""
        raise NotImplementedError

    def _after_value(self, character: str) -> bool:
        """In AFTER_VALUE (inside a container): ',' or the closing bracket."""
        raise NotImplementedError

    def _end_string(self) -> None:
        """A free string's closing quote was read."""
        raise NotImplementedError

    def _feed_literal(self, character: str) -> bool:
        """In LITERAL."""
        raise NotImplementedError

    def _feed_key(self, character: str) -> bool:
        """In KEY (only reached by a subclass that enters it)."""
        return False
