"""Streaming parse of generated text into answer text, reasoning text and tool calls.

Engine-agnostic: it sees decoded text only. Markers the parsers need (`<think>`,
`<tool_call>`, `[TOOL_CALLS]`, ...) must survive decoding; see
`exo.chat_protocol.prompt.decode_keeping_markers`.

gpt-oss's harmony channels are read by `exo.chat_protocol.harmony.HarmonyParser`, to which
this parser hands the text. Otherwise reasoning is `<think>...</think>` at the start of the
output (DeepSeek-R1, QwQ, Qwen3), or everything before `</think>` when the prompt already
opened the section. Tool calls are
found in the formats of `exo.chat_protocol.tool_call_parsing` (whose `ToolCallParser`
parses what this parser holds back).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum, auto

from exo.chat_protocol.harmony import HarmonyParser
from exo.chat_protocol.parsed_output import ParsedOutput, find_first, partial_marker_length
from exo.chat_protocol.tool_call_markup import CALL_BLOCKS, TEXT_MARKERS, CallBlock
from exo.chat_protocol.tool_call_parsing import ToolCallFormat, ToolCallParser
from exo.shared.types.text_generation import ToolDefinition

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# An answer that may be a whole-output JSON tool call: `{`, `[`, or a ```json fence.
_FENCE_START = re.compile(r"```[ \t]*(?:json)?[ \t]*\r?\n?\s*")
_FENCE_OPENING_PREFIX = re.compile(r"[ \t]*(?:j(?:s(?:o(?:n)?)?)?)?[ \t]*\r?\n?\s*")


class _State(Enum):
    REASONING_START = auto()  # may still open with <think>
    REASONING = auto()  # inside <think> ... </think>
    ANSWER_START = auto()  # deciding whether the answer is a whole-output tool call
    TEXT = auto()  # streaming answer text, watching for tool-call markers
    CALL_BLOCK = auto()  # inside a call block: <tool_call> ... </tool_call> and the like
    HOLD = auto()  # keeping everything until finish (whole-output tool calls)


class OutputParser:
    """Incremental parser of one generation's text.

    Feed decoded text as it arrives; each call returns what can be released without
    waiting (only a possible partial marker at the end is held back, like a stop-string
    matcher). Answers that may be a whole-output JSON tool call (they start with `{`, `[`,
    a ```json fence or `<|python_tag|>`) are held until `finish` when tools were given.
    Anything that fails to parse as a tool call (unknown tool, malformed JSON, an unclosed
    `<tool_call>`) is released as text, raw, markers included, except a forced call cut
    short by `max_tokens`, which stays a call (`finish`); the parser never raises.

    Args:
        tools: The tools offered to the model; calls naming others stay text. No tools: no
            tool-call parsing at all.
        tool_call_format: The format the model was prompted or trained to use.
        thinking_open: The prompt already ends inside `<think>`: output starts as reasoning.
        forced_tool_call: Decoding was constrained to one bare `{"name", "arguments"}`
            object: the whole output is held and parsed as that call.
        parse_reasoning: Split `<think>` sections into reasoning text; False leaves them in
            the answer text as generated.
    """

    def __init__(
        self,
        tools: Sequence[ToolDefinition],
        tool_call_format: ToolCallFormat,
        thinking_open: bool,
        forced_tool_call: bool,
        parse_reasoning: bool = True,
    ) -> None:
        self._has_tools = len(tools) > 0
        self._tool_calls = ToolCallParser(tools, tool_call_format, forced_tool_call)
        self._forced = forced_tool_call
        self._markers = TEXT_MARKERS[tool_call_format] if self._has_tools else ()
        self._blocks = {block.open: block for block in CALL_BLOCKS.get(tool_call_format, ())}
        self._block: CallBlock | None = None
        self._buffer = ""
        self._search_from = 0
        self._strip_answer_start = False
        self._after_tool_call = False
        self._finished = False
        # gpt-oss's channels replace `<think>` and call blocks (a forced call is bare JSON).
        self._harmony = (
            HarmonyParser(self._tool_calls, parse_reasoning)
            if tool_call_format == "harmony" and not forced_tool_call
            else None
        )
        # With the section already open, a re-emitted `<think>` is still dropped.
        self._thinking_open = thinking_open
        self._state = _State.REASONING_START if parse_reasoning else _State.ANSWER_START

    def feed(self, text: str) -> ParsedOutput:
        """Add newly decoded text.

        Args:
            text: The next piece of generated text (any split, even mid-marker).

        Returns:
            The text, reasoning text and complete tool calls releasable now.

        Raises:
            RuntimeError: called after `finish`.
        """
        if self._finished:
            raise RuntimeError("OutputParser.feed called after finish")
        if self._harmony is not None:
            return self._harmony.feed(text)
        self._buffer += text
        output = ParsedOutput()
        self._advance(output)
        return output

    def finish(self, out_of_tokens: bool = False) -> ParsedOutput:
        """End of generation: release everything held, parsing held tool calls.

        Args:
            out_of_tokens: the generation stopped at `max_tokens` (finish "length"): a
                forced call it was writing is returned cut short, as OpenAI returns one
                (`exo.chat_protocol.cut_tool_call`), not as text.

        Returns:
            The remaining text, reasoning text and tool calls.

        Raises:
            RuntimeError: called twice.
        """
        if self._finished:
            raise RuntimeError("OutputParser.finish called twice")
        self._finished = True
        if self._harmony is not None:
            return self._harmony.finish()
        output = ParsedOutput()
        self._advance(output)
        buffer, self._buffer = self._buffer, ""
        match self._state:
            case _State.REASONING_START:
                output.text += buffer
            case _State.REASONING:
                output.reasoning_text += buffer
            case _State.TEXT:
                if not (self._after_tool_call and not buffer.strip()):
                    output.text += buffer
            case _State.CALL_BLOCK:
                self._finish_block(buffer, output)
            case _State.ANSWER_START | _State.HOLD:
                self._finish_held(buffer, output, out_of_tokens)
        return output

    # -- state machine -------------------------------------------------------------------

    def _advance(self, output: ParsedOutput) -> None:
        """Process the buffer until no state can make progress without more text."""
        while True:
            match self._state:
                case _State.REASONING_START:
                    progressed = self._step_reasoning_start()
                case _State.REASONING:
                    progressed = self._step_reasoning(output)
                case _State.ANSWER_START:
                    progressed = self._step_answer_start()
                case _State.TEXT:
                    progressed = self._step_text(output)
                case _State.CALL_BLOCK:
                    progressed = self._step_call_block(output)
                case _State.HOLD:
                    progressed = False
            if not progressed:
                return

    def _step_reasoning_start(self) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN) :]
            self._state = _State.REASONING
            return True
        if THINK_OPEN.startswith(stripped) and not self._finished:
            return False  # only whitespace or a partial `<think>` so far
        self._state = _State.REASONING if self._thinking_open else _State.ANSWER_START
        return True

    def _step_reasoning(self, output: ParsedOutput) -> bool:
        index = self._buffer.find(THINK_CLOSE)
        if index != -1:
            output.reasoning_text += self._buffer[:index]
            self._buffer = self._buffer[index + len(THINK_CLOSE) :]
            self._strip_answer_start = True
            self._state = _State.ANSWER_START
            return True
        keep = 0 if self._finished else partial_marker_length(self._buffer, (THINK_CLOSE,))
        release = len(self._buffer) - keep
        output.reasoning_text += self._buffer[:release]
        self._buffer = self._buffer[release:]
        return False

    def _step_answer_start(self) -> bool:
        if self._strip_answer_start:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._strip_answer_start = False
        if self._forced:
            self._state = _State.HOLD
            return True
        if not self._has_tools:
            self._state = _State.TEXT
            return True
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        markers = self._markers
        if any(stripped.startswith(marker) for marker in markers):
            self._state = _State.TEXT  # the text state handles its own markers
            return True
        if any(marker.startswith(stripped) for marker in markers):
            return False
        if stripped[0] in "{[":
            self._state = _State.HOLD
            return True
        if stripped.startswith("```"):
            match = _FENCE_START.match(stripped)
            assert match is not None  # the pattern accepts a bare ```
            rest = stripped[match.end() :]
            if rest and rest[0] in "{[":
                self._state = _State.HOLD
                return True
            if _FENCE_OPENING_PREFIX.fullmatch(stripped[3:]):
                return False  # "```", "```js", "```json\n": the fence may still hold JSON
        elif "```".startswith(stripped):
            return False
        self._state = _State.TEXT
        return True

    def _step_text(self, output: ParsedOutput) -> bool:
        index, marker = find_first(self._buffer, self._markers)
        if index != -1:
            self._release_text(self._buffer[:index], output)
            block = self._blocks.get(marker)
            if block is not None:
                self._buffer = self._buffer[index:]
                self._search_from = len(block.open)
                self._block = block
                self._state = _State.CALL_BLOCK
            else:  # `[TOOL_CALLS]` / `<|python_tag|>`: the calls run to the end
                self._buffer = self._buffer[index:]
                self._state = _State.HOLD
            return True
        keep = partial_marker_length(self._buffer, self._markers)
        release = len(self._buffer) - keep
        if self._after_tool_call and not self._buffer[:release].strip():
            return False  # whitespace between or after tool calls is not answer text
        self._release_text(self._buffer[:release], output)
        self._buffer = self._buffer[release:]
        return False

    def _release_text(self, text: str, output: ParsedOutput) -> None:
        if self._after_tool_call and not text.strip():
            return
        output.text += text

    def _step_call_block(self, output: ParsedOutput) -> bool:
        block = self._block
        assert block is not None
        if block.call_end is not None:
            return self._step_call_section(block, output)
        index = self._buffer.find(block.close, self._search_from)
        if index == -1:
            self._search_from = max(len(block.open), len(self._buffer) - len(block.close) + 1)
            return False
        end = index + len(block.close)
        raw = self._buffer[:end]
        self._take_calls(block, raw, raw[len(block.open) : index], output)
        self._buffer = self._buffer[end:]
        self._state = _State.TEXT
        return True

    def _step_call_section(self, block: CallBlock, output: ParsedOutput) -> bool:
        """A section of calls: each call is released when its end marker arrives (a bad one
        as raw text); the section ends at its close marker. `_search_from` is where the
        next call starts (after the open marker, or after the last call released)."""
        assert block.call_end is not None
        start = self._search_from
        call_end = self._buffer.find(block.call_end, start)
        close = self._buffer.find(block.close, start)
        if call_end != -1 and (close == -1 or call_end < close):
            end = call_end + len(block.call_end)
            self._take_calls(block, self._buffer[:end], self._buffer[start:end], output)
            self._buffer = self._buffer[end:]
            self._search_from = 0
            return True
        if close == -1:
            return False
        end = close + len(block.close)
        if self._buffer[start:close].strip():  # an unfinished call before the close
            output.text += self._buffer[:end]
        self._buffer = self._buffer[end:]
        self._state = _State.TEXT
        return True

    def _finish_block(self, buffer: str, output: ParsedOutput) -> None:
        """A block still open at the end is raw text, markers included; a section left open
        (its close cut by EOS) has released its complete calls, and only what follows them
        is text."""
        block = self._block
        assert block is not None
        if block.call_end is not None and not buffer[self._search_from :].strip():
            return
        output.text += buffer

    def _take_calls(self, block: CallBlock, raw: str, body: str, output: ParsedOutput) -> None:
        calls = self._tool_calls.parse_block(block, body)
        if calls is None:
            output.text += raw
        else:
            output.tool_calls.extend(calls)
            self._after_tool_call = True

    # -- held output ---------------------------------------------------------------------

    def _finish_held(self, buffer: str, output: ParsedOutput, out_of_tokens: bool) -> None:
        calls = self._tool_calls.parse_whole(buffer)
        if calls is None and self._forced and out_of_tokens:
            cut = self._tool_calls.parse_cut_forced_call(buffer)
            calls = None if cut is None else [cut]
        if calls is None:
            output.text += buffer
        else:
            output.tool_calls.extend(calls)
