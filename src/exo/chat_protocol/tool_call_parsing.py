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
- "qwen3_coder": `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function>
  </tool_call>` (Qwen3-Coder chat template); values typed by the tool's JSON Schema.
- "glm45": `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>value</arg_value>...</tool_call>`
  (GLM-4.5 / 4.6 chat templates); values typed by the schema.
- "deepseek_v3": `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>
  {json}<｜tool▁call▁end｜>` (DeepSeek-V3.1) or `...function<｜tool▁sep｜>NAME` and a ```json
  fence (DeepSeek-V3 / R1), then `<｜tool▁calls▁end｜>` (fullwidth bars, U+2581 spaces).
- "kimi_k2": `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>`, then `<|tool_calls_section_end|>`.
- "minimax_m2": `<minimax:tool_call><invoke name="NAME"><parameter name="KEY">value
  </parameter>...</invoke>...</minimax:tool_call>` (MiniMax-M2); values typed by the schema.
- "harmony": gpt-oss's channels (`exo.chat_protocol.harmony`); a call's message body is its
  JSON arguments.
- "generic": the whole output is a JSON object (or list of them) naming a known tool, bare
  or in a ```json fence; tried at the end for every format.

In the section formats (DeepSeek, Kimi K2, MiniMax-M2) each call is released as soon as its
own end marker arrives, before the section closes. The `<tool_call>` bodies of "hermes",
"qwen3_coder" and "glm45" are told apart by their shape (JSON object, `<function=`, or a
name), so a model prompted in one of them and answering in another is still understood.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Sequence
from typing import Any

from exo.chat_protocol.cut_tool_call import cut_forced_call, is_cut
from exo.chat_protocol.tool_arguments import coerce_to_schema
from exo.chat_protocol.tool_call_markup import (
    ALL_BLOCKS,
    DEEPSEEK_CALL_BEGIN,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_SEP,
    GLM_ARG_KEY,
    GLM_PAIR,
    HERMES_OPEN,
    KIMI_ARGUMENT_BEGIN,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_SECTION_BEGIN,
    MINIMAX_INVOKE,
    MINIMAX_OPEN,
    MINIMAX_PARAMETER,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    MISTRAL_TOOL_CALLS,
    PYTHON_TAG,
    QWEN3_CODER_CALL,
    QWEN3_CODER_FUNCTION,
    QWEN3_CODER_PARAMETER,
    CallBlock,
    property_schema,
    strip_one_newline,
    typed_value,
)
from exo.shared.types.models import ToolCallFormat
from exo.shared.types.text_generation import ToolCall, ToolDefinition

TOOL_CALL_ID_PREFIX = "call_"
TOOL_CALL_ID_LENGTH = 24
_ID_ALPHABET = string.ascii_letters + string.digits

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
        for block in ALL_BLOCKS:
            if stripped.startswith(block.open):
                return self._parse_blocks(stripped, block)
        if stripped.startswith(MISTRAL_TOOL_CALLS):
            return self._parse_mistral(stripped)
        if stripped.startswith(PYTHON_TAG):
            return self._parse_json_sequence(stripped[len(PYTHON_TAG) :], separator=";")
        if self._format == "llama3_json":
            calls = self._parse_json_sequence(stripped, separator=";")
            if calls is not None:
                return calls
        return self._parse_generic(stripped)

    def parse_cut_forced_call(self, text: str) -> ToolCall | None:
        """The forced call a generation cut short by `max_tokens` was writing: its
        arguments as far as written (`cut_tool_call.cut_forced_call`), or coerced as any
        call's when they were whole (only the frame's closing brace was cut)."""
        call = cut_forced_call(text, self._tools, new_tool_call_id())
        if call is None or is_cut(call):
            return call
        return self._make_call(call.name, call.arguments)

    def _parse_blocks(self, text: str, block: CallBlock) -> list[ToolCall] | None:
        """Calls from an output made only of `block`s (the last one may lack its close
        marker where the block allows it)."""
        calls: list[ToolCall] = []
        position = 0
        while position < len(text):
            if not text.startswith(block.open, position):
                return None
            end = text.find(block.close, position)
            body_start = position + len(block.open)
            if end == -1 and block.call_end is None:
                return None
            found = self.parse_block(block, text[body_start : end if end != -1 else len(text)])
            if found is None:
                return None
            calls.extend(found)
            if end == -1:
                break
            position = _skip_whitespace(text, end + len(block.close))
        return calls or None

    def parse_block(self, block: CallBlock, body: str) -> list[ToolCall] | None:
        """The calls inside one block (the text between its markers); None when it is not
        made only of calls of known tools."""
        if block.open == HERMES_OPEN:
            call = self._parse_tool_call_body(body)
            return None if call is None else [call]
        if block.open == DEEPSEEK_CALLS_BEGIN:
            return self._parse_marked_calls(
                body, DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, self._deepseek_call
            )
        if block.open == KIMI_SECTION_BEGIN:
            return self._parse_marked_calls(body, KIMI_CALL_BEGIN, KIMI_CALL_END, self._kimi_call)
        if block.open == MINIMAX_OPEN:
            return self._parse_minimax(body)
        return None

    def _parse_tool_call_body(self, body: str) -> ToolCall | None:
        """A `<tool_call>` body: Hermes JSON, Qwen3-Coder `<function=...>` or GLM's
        name and `<arg_key>`/`<arg_value>` pairs."""
        stripped = body.strip()
        if stripped.startswith("{"):
            return self.parse_call_object(stripped, require_arguments=False)
        if stripped.startswith(QWEN3_CODER_FUNCTION):
            return self._parse_qwen3_coder(stripped)
        return self._parse_glm(stripped)

    def _parse_qwen3_coder(self, text: str) -> ToolCall | None:
        match = QWEN3_CODER_CALL.fullmatch(text)
        if match is None:
            return None
        name = match.group("name").strip()
        tool = self._tools.get(name)
        if tool is None:
            return None
        arguments: dict[str, Any] = {}
        for parameter in QWEN3_CODER_PARAMETER.finditer(match.group("body")):
            value = strip_one_newline(parameter.group("value"))
            key = parameter.group("key").strip()
            arguments[key] = typed_value(value, property_schema(tool.parameters, key))
        return self._make_call(name, arguments)

    def _parse_glm(self, text: str) -> ToolCall | None:
        key_index = text.find(GLM_ARG_KEY)
        name = (text if key_index == -1 else text[:key_index]).strip()
        tool = self._tools.get(name)
        if tool is None:
            return None
        rest = "" if key_index == -1 else text[key_index:]
        arguments: dict[str, Any] = {}
        position = 0
        for pair in GLM_PAIR.finditer(rest):
            if rest[position : pair.start()].strip():
                return None
            key = pair.group("key").strip()
            schema = property_schema(tool.parameters, key)
            arguments[key] = typed_value(pair.group("value"), schema)
            position = pair.end()
        if rest[position:].strip():
            return None
        return self._make_call(name, arguments)

    def _parse_marked_calls(
        self, body: str, begin: str, end: str, parse_one: Callable[[str], ToolCall | None]
    ) -> list[ToolCall] | None:
        """Calls each between `begin` and `end`, only whitespace around them."""
        calls: list[ToolCall] = []
        position = _skip_whitespace(body, 0)
        while position < len(body):
            if not body.startswith(begin, position):
                return None
            close = body.find(end, position)
            if close == -1:
                return None
            call = parse_one(body[position + len(begin) : close])
            if call is None:
                return None
            calls.append(call)
            position = _skip_whitespace(body, close + len(end))
        return calls or None

    def _deepseek_call(self, text: str) -> ToolCall | None:
        """`NAME<｜tool▁sep｜>{json}` (V3.1) or `function<｜tool▁sep｜>NAME\n```json ...```
        (V3 / R1)."""
        name, separator, rest = text.partition(DEEPSEEK_SEP)
        if not separator:
            return None
        name = name.strip()
        if name == "function" and name not in self._tools:
            name, _, rest = rest.partition("\n")
            fence = _FENCE_WHOLE.match(rest.strip())
            rest = fence.group("body") if fence is not None else rest
        return self.parse_named_call(name.strip(), rest)

    def _kimi_call(self, text: str) -> ToolCall | None:
        """`functions.NAME:IDX<|tool_call_argument_begin|>{json}`."""
        identifier, separator, rest = text.partition(KIMI_ARGUMENT_BEGIN)
        if not separator:
            return None
        name = identifier.strip().removeprefix("functions.")
        head, colon, index = name.rpartition(":")
        if colon and index.isdigit():
            name = head
        return self.parse_named_call(name, rest)

    def _parse_minimax(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        position = 0
        for invoke in MINIMAX_INVOKE.finditer(body):
            if body[position : invoke.start()].strip():
                return None
            name = invoke.group("name")
            tool = self._tools.get(name)
            if tool is None:
                return None
            arguments: dict[str, Any] = {}
            inner = invoke.group("body")
            inner_position = 0
            for parameter in MINIMAX_PARAMETER.finditer(inner):
                if inner[inner_position : parameter.start()].strip():
                    return None
                key = parameter.group("key")
                value = strip_one_newline(parameter.group("value"))
                arguments[key] = typed_value(value, property_schema(tool.parameters, key))
                inner_position = parameter.end()
            if inner[inner_position:].strip():
                return None
            call = self._make_call(name, arguments)
            if call is None:
                return None
            calls.append(call)
            position = invoke.end()
        if body[position:].strip():
            return None
        return calls or None

    def parse_named_call(self, name: str, arguments_text: str) -> ToolCall | None:
        """A call of tool `name` whose arguments are the JSON object `arguments_text`
        (empty: no arguments); None for an unknown tool or arguments that are no object."""
        stripped = arguments_text.strip()
        if not stripped:
            return self._make_call(name, {})
        try:
            arguments = json.loads(stripped)
        except ValueError:
            return None
        return self._make_call(name, arguments)

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
