"""What each tool-call format looks like: its markers, the blocks that enclose calls in
answer text, the special tokens its parser reads, and how its XML-style argument values are
typed. The formats themselves are described in `exo.chat_protocol.tool_call_parsing`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from exo.shared.types.models import ToolCallFormat

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
MISTRAL_CALL_ID = "[CALL_ID]"

DEEPSEEK_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DEEPSEEK_CALLS_END = "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DEEPSEEK_CALL_END = "<｜tool▁call▁end｜>"
DEEPSEEK_SEP = "<｜tool▁sep｜>"
KIMI_SECTION_BEGIN = "<|tool_calls_section_begin|>"
KIMI_SECTION_END = "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN = "<|tool_call_begin|>"
KIMI_ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"
KIMI_CALL_END = "<|tool_call_end|>"
MINIMAX_OPEN = "<minimax:tool_call>"
MINIMAX_CLOSE = "</minimax:tool_call>"
QWEN3_CODER_FUNCTION = "<function="
GLM_ARG_KEY = "<arg_key>"
GLM_ARG_VALUE = "<arg_value>"


@dataclass(frozen=True, slots=True)
class CallBlock:
    """Markup that encloses tool calls inside answer text: `open`, the format's body, `close`.
    `call_end`: the block is a section of calls each ended by this marker, so each call is
    released as soon as it ends, and a section the model ended at EOS without `close`
    still holds its complete calls."""

    open: str
    close: str
    call_end: str | None = None


_TOOL_CALL_BLOCK = CallBlock(HERMES_OPEN, HERMES_CLOSE)
_DEEPSEEK_BLOCK = CallBlock(DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END, DEEPSEEK_CALL_END)
_KIMI_BLOCK = CallBlock(KIMI_SECTION_BEGIN, KIMI_SECTION_END, KIMI_CALL_END)
_MINIMAX_BLOCK = CallBlock(MINIMAX_OPEN, MINIMAX_CLOSE, "</invoke>")

# Blocks that, once opened in answer text, hold tool calls (per format).
CALL_BLOCKS: dict[ToolCallFormat, tuple[CallBlock, ...]] = {
    "hermes": (_TOOL_CALL_BLOCK,),
    "qwen3_coder": (_TOOL_CALL_BLOCK,),
    "glm45": (_TOOL_CALL_BLOCK,),
    "deepseek_v3": (_DEEPSEEK_BLOCK,),
    "kimi_k2": (_KIMI_BLOCK,),
    "minimax_m2": (_MINIMAX_BLOCK,),
}
ALL_BLOCKS = (_TOOL_CALL_BLOCK, _DEEPSEEK_BLOCK, _KIMI_BLOCK, _MINIMAX_BLOCK)

# Markers after which the rest of the output is tool calls (per format).
TRAILING_CALL_MARKERS: dict[ToolCallFormat, tuple[str, ...]] = {
    "llama3_json": (PYTHON_TAG,),
    "mistral": (MISTRAL_TOOL_CALLS,),
}

# Markers that, once seen in answer text, start a tool call (per format).
TEXT_MARKERS: dict[ToolCallFormat, tuple[str, ...]] = {
    name: tuple(block.open for block in CALL_BLOCKS.get(name, ()))
    + TRAILING_CALL_MARKERS.get(name, ())
    for name in get_args(ToolCallFormat)
}

# Special tokens each format's parser reads, kept when decoding (`decode_keeping_markers`).
FORMAT_TOKENS: dict[ToolCallFormat, tuple[str, ...]] = {
    "deepseek_v3": (
        DEEPSEEK_CALLS_BEGIN,
        DEEPSEEK_CALLS_END,
        DEEPSEEK_CALL_BEGIN,
        DEEPSEEK_CALL_END,
        DEEPSEEK_SEP,
    ),
    "kimi_k2": (
        KIMI_SECTION_BEGIN,
        KIMI_SECTION_END,
        KIMI_CALL_BEGIN,
        KIMI_ARGUMENT_BEGIN,
        KIMI_CALL_END,
    ),
    "glm45": ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    "minimax_m2": (MINIMAX_OPEN, MINIMAX_CLOSE),
}

# Whole calls and arguments of the XML-style formats.
QWEN3_CODER_CALL = re.compile(r"<function=(?P<name>[^>\n]+)>(?P<body>.*?)(?:</function>)?\s*", re.S)
QWEN3_CODER_PARAMETER = re.compile(
    r"<parameter=(?P<key>[^>\n]+)>(?P<value>.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S
)
GLM_PAIR = re.compile(
    r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.S
)
MINIMAX_INVOKE = re.compile(
    r"<invoke name=[\"']?(?P<name>[^\"'>]*)[\"']?>(?P<body>.*?)</invoke>", re.S
)
MINIMAX_PARAMETER = re.compile(
    r"<parameter name=[\"']?(?P<key>[^\"'>]*)[\"']?>(?P<value>.*?)</parameter>", re.S
)


def property_schema(parameters: Any, key: str) -> Any:
    """The JSON Schema of argument `key` in a tool's parameters schema (None: unknown)."""
    if not isinstance(parameters, Mapping):
        return None
    properties = parameters.get("properties")
    return properties.get(key) if isinstance(properties, Mapping) else None


def typed_value(text: str, schema: Any) -> Any:
    """An XML-style argument value as its schema's type: the text itself for a string (or
    an argument the schema does not describe), else the JSON it spells when it is JSON
    (numbers, booleans, objects, arrays, null), else the text (coercion follows)."""
    if not isinstance(schema, Mapping) or _declares_string(schema):
        return text
    try:
        return json.loads(text.strip())
    except ValueError:
        return text


def _declares_string(schema: Mapping[str, Any]) -> bool:
    declared = schema.get("type")
    if declared == "string":
        return True
    if isinstance(declared, list):
        return "string" in declared and not {"object", "array", "integer", "number"} & {
            str(kind) for kind in declared
        }
    return False


def strip_one_newline(value: str) -> str:
    """`value` without the one newline the templates put after the opening and before the
    closing tag."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value
