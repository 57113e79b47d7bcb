"""A forced tool call cut short by `max_tokens`, and what each dialect shows of it.

Decoding constrained to a forced call (`tool_choice` "required" or a named function) writes
`{"name": "<tool>", "arguments": {...}}` (`ToolCallRecognizer`); when the tokens run out
first the output is a prefix of that, and the generation finishes "length". OpenAI returns
such a call as a tool call whose `arguments` string stops where the tokens ran out, with
`finish_reason: "length"` (Chat Completions; Responses marks the `function_call` item and
the response incomplete), never as text. Anthropic ends with `stop_reason: "max_tokens"`
and the `tool_use` block holding the input written so far: the members that were complete
(a member whose value was cut is left out).

`cut_forced_call` builds the internal call from the cut output (its `arguments` the
object's text as generated, which does not parse: `is_cut`); `complete_members` is the
input Claude Messages and Ollama (whose arguments are objects, not text) show for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from typing import Any

from exo.shared.types.text_generation import ToolCall

# The constrained frame's opening and its middle (`ToolCallRecognizer.PREFIX` / `MIDDLE`),
# read loosely on whitespace.
_NAME_KEY = re.compile(r'\{\s*"name"\s*:\s*"')
_ARGUMENTS_KEY = re.compile(r'\s*,\s*"arguments"\s*:\s*')
_CLOSERS = {"{": "}", "[": "]"}


def cut_forced_call(text: str, tool_names: Collection[str], call_id: str) -> ToolCall | None:
    """The call a forced-call output cut short began.

    Args:
        text: the output, a prefix of `{"name": "<tool>", "arguments": {...}}`.
        tool_names: the tools the call may name; a name itself cut short counts when
            exactly one of them starts with it.
        call_id: the id the call gets.

    Returns:
        The call with its arguments as far as they were written ("" when they had not
        begun), or None when the output names no tool it could be.
    """
    stripped = text.strip()
    opening = _NAME_KEY.match(stripped)
    if opening is None:
        return None
    rest = stripped[opening.end() :]
    name_end = _string_end(rest)
    if name_end is None:  # the name is cut: function names are plain ASCII, no escapes
        candidates = [name for name in tool_names if name.startswith(rest)]
        if len(candidates) != 1:
            return None
        return ToolCall(id=call_id, name=candidates[0], arguments="")
    try:
        name = json.loads(f'"{rest[:name_end]}"')
    except ValueError:
        return None
    if name not in tool_names:
        return None
    middle = _ARGUMENTS_KEY.match(rest, name_end + 1)
    arguments = "" if middle is None else rest[middle.end() :]
    return ToolCall(id=call_id, name=name, arguments=arguments)


def is_cut(call: ToolCall) -> bool:
    """Whether `call` was cut short (`cut_forced_call`): its arguments are not whole JSON
    text (a parsed call's are a JSON object; whole JSON of another kind is an error the
    dialects report as before)."""
    try:
        json.loads(call.arguments)
    except ValueError:
        return True
    return False


def complete_members(arguments: str) -> dict[str, Any]:
    """The JSON object `arguments` began, holding only what was complete, at any depth:
    `{"a": 1, "b": {"c": 2, "d": "Par` gives `{"a": 1, "b": {"c": 2}}`; `{}` when nothing
    was (a number at the very end counts as cut: more digits may have followed)."""
    for end, closers in reversed(list(_cut_points(arguments))):
        try:
            value = json.loads(arguments[:end] + closers)
        except ValueError:
            continue  # a key without its value, a string cut inside an escape, ...
        if isinstance(value, dict):
            return value
    return {}


def _string_end(text: str, start: int = 0) -> int | None:
    """The index of the quote that ends the JSON string whose text begins at `start`."""
    escaped = False
    for index in range(start, len(text)):
        character = text[index]
        if escaped:
            escaped = False
        elif character == "\\":
            escaped = True
        elif character == '"':
            return index
    return None


def _cut_points(text: str) -> Iterator[tuple[int, str]]:
    """Where a prefix of the JSON text `text` may end, with what closes its open
    containers: after each string, container and complete scalar, and after each opening
    bracket; whether the prefix then parses (a key without its value does not) is left to
    `json.loads`. A complete text's last point is its end."""
    stack: list[str] = []
    index = 0
    while index < len(text):
        character = text[index]
        if character in _CLOSERS:
            stack.append(character)
            index += 1
        elif character in "}]":
            if stack:
                stack.pop()
            index += 1
        elif character == '"':
            end = _string_end(text, index + 1)
            if end is None:
                return  # cut inside a string: nothing after it is complete
            index = end + 1
        elif character in ",: \t\r\n":
            index += 1
            continue  # no value ended here
        else:  # a number or literal: complete once a delimiter follows it
            while index < len(text) and text[index] not in ",:}] \t\r\n":
                index += 1
            if index == len(text):
                return
        yield index, "".join(_CLOSERS[opener] for opener in reversed(stack))
