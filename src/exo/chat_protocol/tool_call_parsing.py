"""Tool calls from generated text, in the format each model family was trained to emit.

Engine-agnostic: it sees decoded text only (the markers must survive decoding; see
`exo.chat_protocol.prompt.decode_keeping_markers`). `ToolCallParser` parses a piece of
text the streaming parser (`exo.chat_protocol.output_parsing.OutputParser`) held back;
`TEXT_MARKERS` are the markers that start a tool call inside answer text.

Formats understood:

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, text allowed
  around them (Hermes function-calling format, NousResearch; also Qwen2.5/Qwen3).
- "llama3_json": the whole message is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several separated by `;` (Llama 3.1 model card: JSON tool calling).
- "mistral": `[TOOL_CALLS]` then a JSON list `[{"name": ..., "arguments": {...}}]`
  (Mistral tokenizer v3) or `name[ARGS]{...}` per call (Mistral tokenizer v11 and later).
- "generic": the whole output is a JSON object (or list of them) naming a known tool, bare
  or in a ```json fence; tried at the end for every format.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any

from exo.chat_protocol.tool_arguments import coerce_to_schema
from exo.shared.types.models import ToolCallFormat
from exo.shared.types.text_generation import ToolCall, ToolDefinition

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"

TOOL_CALL_ID_PREFIX = "call_"
TOOL_CALL_ID_LENGTH = 24
_ID_ALPHABET = string.ascii_letters + string.digits

# Markers that, once seen in answer text, start a tool call (per format).
TEXT_MARKERS: dict[ToolCallFormat, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN,),
    "llama3_json": (PYTHON_TAG,),
    "mistral": (MISTRAL_TOOL_CALLS,),
    "generic": (),
}
_FENCE_WHOLE = re.compile(r"\A```[ \t]*(?:json)?[ \t]*\r?\n(?P<body>.*?)\n?[ \t]*```\s*\Z", re.S)


def new_tool_call_id() -> str:
    """A fresh tool call id: `call_` and 24 random letters/digits (OpenAI's shape)."""
    suffix = "".join(secrets.choice(_ID_ALPHABET) for _ in range(TOOL_CALL_ID_LENGTH))
    return TOOL_CALL_ID_PREFIX + suffix


class ToolCallParser:
    """Tool calls of one generation's text, in its format, naming only the tools offered.
    Every parse answers None when the text is not entirely calls of known tools (unknown
    tool, malformed JSON, arguments that are not an object); it never raises.

    Args:
        tools: The tools offered to the model; calls naming others are not calls.
        tool_call_format: The format the model was prompted or trained to use.
        forced_tool_call: Decoding was constrained to one bare `{"name", "arguments"}`
            object: `parse_whole` tries that shape first.
    """

    def __init__(
        self,
        tools: Sequence[ToolDefinition],
        tool_call_format: ToolCallFormat,
        forced_tool_call: bool,
    ) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._format: ToolCallFormat = tool_call_format
        self._forced = forced_tool_call

    def parse_whole(self, text: str) -> list[ToolCall] | None:
        """Tool calls of a held output, trying the forced, the format's and the generic
        shapes in turn; None when none of them fits."""
        if not self._tools:
            return None
        stripped = text.strip()
        if self._forced:
            call = self.parse_call_object(stripped, require_arguments=False)
            if call is not None:
                return [call]
        if stripped.startswith(HERMES_OPEN):
            return self._parse_hermes_blocks(stripped)
        if stripped.startswith(MISTRAL_TOOL_CALLS):
            return self._parse_mistral(stripped)
        if stripped.startswith(PYTHON_TAG):
            return self._parse_json_sequence(stripped[len(PYTHON_TAG) :], separator=";")
        if self._format == "llama3_json":
            calls = self._parse_json_sequence(stripped, separator=";")
            if calls is not None:
                return calls
        return self._parse_generic(stripped)

    def _parse_hermes_blocks(self, text: str) -> list[ToolCall] | None:
        """Calls from an output made only of `<tool_call>...</tool_call>` blocks."""
        calls: list[ToolCall] = []
        position = 0
        while position < len(text):
            if not text.startswith(HERMES_OPEN, position):
                return None
            end = text.find(HERMES_CLOSE, position)
            if end == -1:
                return None
            call = self.parse_call_object(
                text[position + len(HERMES_OPEN) : end], require_arguments=False
            )
            if call is None:
                return None
            calls.append(call)
            position = _skip_whitespace(text, end + len(HERMES_CLOSE))
        return calls or None

    def _parse_generic(self, text: str) -> list[ToolCall] | None:
        fence = _FENCE_WHOLE.match(text)
        if fence is not None:
            text = fence.group("body").strip()
        try:
            value = json.loads(text)
        except ValueError:
            return None
        objects = value if isinstance(value, list) else [value]
        return self._calls_from_objects(objects, require_arguments=True)

    def _parse_json_sequence(self, text: str, separator: str) -> list[ToolCall] | None:
        """Calls from JSON objects separated by `separator` (Llama 3.1's `;`)."""
        decoder = json.JSONDecoder()
        objects: list[Any] = []
        position = 0
        text = text.strip()
        while position < len(text):
            try:
                value, position = decoder.raw_decode(text, position)
            except ValueError:
                return None
            objects.append(value)
            position = _skip_whitespace(text, position)
            if position < len(text):
                if text[position] != separator:
                    return None
                position = _skip_whitespace(text, position + 1)
        if not objects:
            return None
        return self._calls_from_objects(objects, require_arguments=False)

    def _parse_mistral(self, text: str) -> list[ToolCall] | None:
        """`[TOOL_CALLS]` followed by a JSON list (tokenizer v3) or by `name[ARGS]{json}`
        calls, each optionally after another `[TOOL_CALLS]` (tokenizer v11+)."""
        body = text[len(MISTRAL_TOOL_CALLS) :].strip()
        if body.startswith(("[", "{")):
            try:
                value = json.loads(body)
            except ValueError:
                return None
            objects = value if isinstance(value, list) else [value]
            return self._calls_from_objects(objects, require_arguments=False)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        position = 0
        while position < len(body):
            args_index = body.find(MISTRAL_ARGS, position)
            if args_index == -1:
                return None
            name = body[position:args_index]
            if MISTRAL_CALL_ID in name:
                name = name[: name.index(MISTRAL_CALL_ID)]
            name = name.strip()
            json_start = _skip_whitespace(body, args_index + len(MISTRAL_ARGS))
            try:
                arguments, position = decoder.raw_decode(body, json_start)
            except ValueError:
                return None
            call = self._make_call(name, arguments)
            if call is None:
                return None
            calls.append(call)
            position = _skip_whitespace(body, position)
            if body.startswith(MISTRAL_TOOL_CALLS, position):
                position = _skip_whitespace(body, position + len(MISTRAL_TOOL_CALLS))
        return calls or None

    def _calls_from_objects(
        self, objects: Sequence[Any], require_arguments: bool
    ) -> list[ToolCall] | None:
        """All of `objects` as calls, or None if any one is not a call of a known tool."""
        calls: list[ToolCall] = []
        for value in objects:
            call = self._call_from_value(value, require_arguments)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def parse_call_object(self, text: str, require_arguments: bool) -> ToolCall | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return self._call_from_value(value, require_arguments)

    def _call_from_value(self, value: Any, require_arguments: bool) -> ToolCall | None:
        if not isinstance(value, dict):
            return None
        name = value.get("name")
        if not isinstance(name, str):
            return None
        if "arguments" in value:
            arguments = value["arguments"]
        elif "parameters" in value:
            arguments = value["parameters"]
        elif require_arguments:
            return None
        else:
            arguments = {}
        return self._make_call(name, arguments)

    def _make_call(self, name: str, arguments: Any) -> ToolCall | None:
        tool = self._tools.get(name)
        if tool is None:
            return None
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        coerced = coerce_to_schema(arguments, tool.parameters)
        text = json.dumps(coerced, ensure_ascii=False, separators=(",", ":"))
        return ToolCall(id=new_tool_call_id(), name=name, arguments=text)


def _skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
