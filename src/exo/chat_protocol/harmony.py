"""gpt-oss's harmony output: messages on channels, read into reasoning, answer text and
tool calls (OpenAI, "OpenAI Harmony Response Format", gpt-oss model card).

The prompt ends with `<|start|>assistant`, so the output begins with the first message's
header. Each message is `[<|start|>assistant][ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT]
[ json | <|constrain|>json]<|message|>BODY` ended by `<|end|>` (more messages follow),
`<|return|>` (the answer is done) or `<|call|>` (a tool call; the turn ends: anything
written after either is dropped, such as a tool result the model goes on to imagine when
generation does not stop there). Channels:
`analysis` is reasoning, `final` the answer, `commentary` without a recipient a preamble
shown as answer text. A message to `functions.NAME` is a call of tool NAME whose body is
its JSON arguments. `<|return|>` and `<|call|>` are end-of-sequence tokens (the engine
stops on them whatever the generation config names: `format_stop_token_ids`), so they
usually end generation before the parser sees them: a call still open at the end is
complete; seen anywhere else (a message never opened), they end the turn too.

No harmony marker ever reaches the answer or reasoning text: a marker out of place (a
`<|message|>` with no header, a `<|channel|>` inside a body, a header never completed)
is dropped, and a call that fails to parse comes back as its header and body text with the
markers taken out.

Engine-agnostic: the markers are special tokens, kept by
`exo.chat_protocol.prompt.decode_keeping_markers` for this format. Output without any
header (a continued final message, a constrained JSON document) is answer text.
"""

from __future__ import annotations

import re
from enum import Enum, auto
from typing import Any

from exo.chat_protocol.parsed_output import ParsedOutput, find_first, partial_marker_length
from exo.chat_protocol.tool_call_parsing import ToolCallParser

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
HARMONY_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)

_BODY_ENDS = (END, RETURN, CALL, START)
_TURN_ENDS = (RETURN, CALL)
# What ends the stretch between messages: a new message, or the end of the turn.
_BETWEEN_ENDS = (START, CHANNEL, *_TURN_ENDS)
_HEADER_OPENINGS = (CHANNEL, CONSTRAIN, " to=", "to=")
# A header is a role, a channel, a recipient and a content type: a few dozen characters.
# Text this long without `<|message|>` is not a header.
_HEADER_LIMIT = 512
_CHANNEL = re.compile(r"<\|channel\|>\s*(?P<channel>[^\s<]+)")
_RECIPIENT = re.compile(r"\bto=(?P<recipient>[^\s<]+)")
_FUNCTIONS = "functions."


class _State(Enum):
    OPENING = auto()  # deciding whether the output starts with a header
    HEADER = auto()  # inside a header, up to `<|message|>`
    BODY = auto()  # inside a message body
    BETWEEN = auto()  # after a message: whitespace, or stray text
    DONE = auto()  # after `<|return|>` or `<|call|>`: the turn is over


class _Body(Enum):
    REASONING = auto()
    TEXT = auto()
    CALL = auto()


class HarmonyParser:
    """Incremental parser of one gpt-oss generation (same contract as `OutputParser`):
    reasoning and answer text stream as they come, a possible partial marker held back;
    a call is released when its message ends. A call of an unknown tool, or whose body is
    no JSON object, comes back as raw text, header included.

    Args:
        tool_calls: parses a call's name and JSON arguments against the offered tools (no
            tools: every call is text).
        parse_reasoning: False puts the analysis channel in the answer text.
    """

    def __init__(self, tool_calls: ToolCallParser, parse_reasoning: bool) -> None:
        self._tool_calls = tool_calls
        self._parse_reasoning = parse_reasoning
        self._state = _State.OPENING
        self._buffer = ""
        self._header = ""  # the current message's raw header (for a call that fails)
        self._body = _Body.TEXT
        self._call_name = ""

    def feed(self, text: str) -> ParsedOutput:
        self._buffer += text
        output = ParsedOutput()
        while self._step(output, finished=False):
            pass
        return output

    def finish(self) -> ParsedOutput:
        output = ParsedOutput()
        while self._step(output, finished=True):
            pass
        buffer, self._buffer = self._buffer, ""
        match self._state:
            case _State.DONE:
                pass
            case _State.OPENING | _State.BETWEEN:
                buffer = without_markers(buffer)
                if buffer.strip():
                    output.text += buffer
            case _State.HEADER:
                # No `<|message|>`: not a message.
                output.text += without_markers(self._header + buffer)
            case _State.BODY:
                self._end_body(buffer, output)
        return output

    # -- states ----------------------------------------------------------------------------

    def _step(self, output: ParsedOutput, finished: bool) -> bool:
        match self._state:
            case _State.OPENING:
                return self._step_opening(finished)
            case _State.HEADER:
                return self._step_header(output)
            case _State.BODY:
                return self._step_body(output, finished)
            case _State.BETWEEN:
                return self._step_between(output, finished)
            case _State.DONE:
                self._buffer = ""  # what a model writes after its turn ended is no answer
                return False

    def _step_opening(self, finished: bool) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(START):
            self._buffer = stripped
            self._state = _State.BETWEEN
            return True
        if stripped.startswith(_HEADER_OPENINGS):
            self._buffer, self._header = stripped, ""
            self._state = _State.HEADER
            return True
        openings = (START, *_HEADER_OPENINGS)
        if not finished and any(opening.startswith(stripped) for opening in openings):
            return False  # nothing decided yet
        self._state = _State.BETWEEN  # no header: plain answer text
        return True

    def _step_header(self, output: ParsedOutput) -> bool:
        index, marker = find_first(self._buffer, (MESSAGE, *_TURN_ENDS))
        if marker in _TURN_ENDS:  # the turn ended inside a header: not a message
            output.text += without_markers(self._header + self._buffer[:index])
            self._buffer = ""
            self._state = _State.DONE
            return True
        if index == -1:
            if len(self._buffer) > _HEADER_LIMIT:
                release = len(self._buffer) - partial_marker_length(self._buffer, HARMONY_TOKENS)
                output.text += without_markers(self._header + self._buffer[:release])
                self._buffer = self._buffer[release:]
                self._state = _State.BETWEEN
            return False
        header = self._buffer[:index]
        self._header += self._buffer[: index + len(MESSAGE)]
        self._buffer = self._buffer[index + len(MESSAGE) :]
        channel_match = _CHANNEL.search(header)
        recipient_match = _RECIPIENT.search(header)
        channel = channel_match.group("channel") if channel_match else ""
        if recipient_match is not None and recipient_match.group("recipient") != "assistant":
            self._body = _Body.CALL
            self._call_name = recipient_match.group("recipient").removeprefix(_FUNCTIONS)
        elif channel == "analysis" and self._parse_reasoning:
            self._body = _Body.REASONING
        else:
            self._body = _Body.TEXT  # final, or a commentary preamble
        self._state = _State.BODY
        return True

    def _step_body(self, output: ParsedOutput, finished: bool) -> bool:
        index, marker = find_first(self._buffer, _BODY_ENDS)
        if index != -1:
            self._end_body(self._buffer[:index], output)
            self._state = _State.BETWEEN
            if marker == START:
                self._buffer = self._buffer[index:]  # a new message without an end marker
            else:
                self._buffer = self._buffer[index + len(marker) :]
                if marker in (RETURN, CALL):
                    self._state = _State.DONE
            return True
        if self._body is _Body.CALL or finished:
            return False  # a call is held whole; at the end `finish` takes the rest
        keep = partial_marker_length(self._buffer, HARMONY_TOKENS)
        release = len(self._buffer) - keep
        self._release(self._buffer[:release], output)
        self._buffer = self._buffer[release:]
        return False

    def _step_between(self, output: ParsedOutput, finished: bool) -> bool:
        index, marker = find_first(self._buffer, _BETWEEN_ENDS)
        if index != -1:
            stray = without_markers(self._buffer[:index])
            if stray.strip():
                output.text += stray
            if marker in _TURN_ENDS:
                self._buffer = ""
                self._state = _State.DONE
                return True
            if marker == START:
                self._header = START
                self._buffer = self._buffer[index + len(START) :]
            else:
                self._header = ""
                self._buffer = self._buffer[index:]
            self._state = _State.HEADER
            return True
        if finished:
            return False
        # Whitespace alone is held: it is no answer if another message follows.
        self._buffer = without_markers(self._buffer)
        keep = partial_marker_length(self._buffer, HARMONY_TOKENS)
        release = len(self._buffer) - keep
        if self._buffer[:release].strip():
            output.text += self._buffer[:release]
            self._buffer = self._buffer[release:]
        return False

    # -- helpers ---------------------------------------------------------------------------

    def _release(self, text: str, output: ParsedOutput) -> None:
        text = without_markers(text)
        if self._body is _Body.REASONING:
            output.reasoning_text += text
        else:
            output.text += text

    def _end_body(self, text: str, output: ParsedOutput) -> None:
        if self._body is not _Body.CALL:
            self._release(text, output)
            return
        call = self._tool_calls.parse_named_call(self._call_name, text)
        if call is None:
            output.text += without_markers(self._header + text)
        else:
            output.tool_calls.append(call)


def without_markers(text: str) -> str:
    """`text` without any harmony marker: they are the format's structure, never its text."""
    for marker in HARMONY_TOKENS:
        text = text.replace(marker, "")
    return text


def harmony_conversation(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`conversation` as gpt-oss's template takes it: reasoning as `thinking`; an assistant
    message with calls holds one call, its analysis in `thinking` alone (the template refuses
    content beside thinking there, and renders content as analysis anyway); several calls
    become one assistant message per call, each followed by its results, since the template
    names a tool result after the latest call."""
    result: list[dict[str, Any]] = []
    index = 0
    while index < len(conversation):
        entry = conversation[index]
        index += 1
        if entry["role"] != "assistant":
            result.append(entry)
            continue
        entry = dict(entry)
        thinking = entry.pop("reasoning_content", None)
        calls = entry.get("tool_calls") or []
        if calls and entry.get("content"):
            thinking = "\n\n".join(part for part in (thinking, entry["content"]) if part)
            entry["content"] = ""
        if thinking is not None:
            entry["thinking"] = thinking
        if len(calls) <= 1:
            result.append(entry)
            continue
        results: list[dict[str, Any]] = []
        while index < len(conversation) and conversation[index]["role"] == "tool":
            results.append(conversation[index])
            index += 1
        for position, call in enumerate(calls):
            single = {**entry, "tool_calls": [call]}
            if position > 0:
                single.pop("thinking", None)
            result.append(single)
            answers = [item for item in results if item.get("tool_call_id") == call["id"]]
            result.extend(answers)
        result.extend(
            item
            for item in results
            if item.get("tool_call_id") not in {call["id"] for call in calls}
        )
    return result
