"""A forced tool call cut short by `max_tokens`: the call its output began, and the members
of its arguments that were written whole (`exo.chat_protocol.cut_tool_call`)."""

from __future__ import annotations

from typing import Any

import pytest

from exo.chat_protocol.cut_tool_call import complete_members, cut_forced_call, is_cut
from exo.chat_protocol.output_parsing import OutputParser
from exo.shared.types.text_generation import ToolCall, ToolDefinition

NAMES = ("get_weather", "get_time", "edit_file")


@pytest.mark.parametrize(
    ("arguments", "whole"),
    [
        ('{"city": "Par', {}),
        ('{"city": "Paris", "unit": "cel', {"city": "Paris"}),
        ('{"city": "Paris", "days": 12', {"city": "Paris"}),  # more digits may follow
        ('{"city": "Paris", "days": 12,', {"city": "Paris", "days": 12}),
        ('{"city": "Paris", "days"', {"city": "Paris"}),
        ('{"a": 1, "b": {"c": 2, "d": "x', {"a": 1, "b": {"c": 2}}),
        ('{"tags": ["a", "b", "c', {"tags": ["a", "b"]}),
        ('{"ok": true, "more": nu', {"ok": True}),
        ('{"path": "C:\\', {}),  # cut inside an escape
        ('{"city": "Paris"}', {"city": "Paris"}),
        ("{", {}),
        ("", {}),
    ],
)
def test_complete_members_keep_what_was_written_whole(arguments: str, whole: Any) -> None:
    assert complete_members(arguments) == whole


@pytest.mark.parametrize(
    ("output", "name", "arguments"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Pa', "get_weather", '{"city": "Pa'),
        ('{"name": "get_time", "arguments": ', "get_time", ""),
        ('{"name": "get_time", "argu', "get_time", ""),
        ('{"name": "get_time"', "get_time", ""),
        ('{"name": "edit', "edit_file", ""),  # the one offered name it can be
    ],
)
def test_the_cut_call_names_its_tool_and_keeps_its_arguments_as_written(
    output: str, name: str, arguments: str
) -> None:
    call = cut_forced_call(output, NAMES, "call_1")
    assert call == ToolCall(id="call_1", name=name, arguments=arguments)
    assert is_cut(call)


@pytest.mark.parametrize(
    "output", ['{"name": "get_', '{"name": "other", "arguments": {', '{"na', "", "plain text"]
)
def test_no_call_when_no_offered_tool_can_be_told(output: str) -> None:
    assert cut_forced_call(output, NAMES, "call_1") is None


def test_a_parsed_call_is_not_cut() -> None:
    assert not is_cut(ToolCall(id="call_1", name="get_time", arguments="{}"))


WEATHER = ToolDefinition(
    name="get_weather",
    parameters={"type": "object", "properties": {"days": {"type": "integer"}}},
)


def forced_parser() -> OutputParser:
    return OutputParser((WEATHER,), "hermes", False, forced_tool_call=True, parse_reasoning=False)


def test_a_forced_call_out_of_tokens_is_a_cut_call_not_text() -> None:
    parser = forced_parser()
    held = parser.feed('{"name": "get_weather", "arguments": {"days": "3", "x')
    assert (held.text, held.tool_calls) == ("", [])
    finished = parser.finish(out_of_tokens=True)
    assert finished.text == ""
    [call] = finished.tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"days": "3", "x')


def test_arguments_whole_but_the_frame_cut_are_parsed_as_any_call() -> None:
    parser = forced_parser()
    parser.feed('{"name": "get_weather", "arguments": {"days": "3"}')
    [call] = parser.finish(out_of_tokens=True).tool_calls
    assert call.arguments == '{"days":3}'  # coerced to the schema, as a whole call is
    assert not is_cut(call)


def test_a_forced_output_ended_otherwise_stays_text() -> None:
    parser = forced_parser()
    parser.feed('{"name": "get_weather", "arguments": {"da')
    finished = parser.finish()
    assert finished.text == '{"name": "get_weather", "arguments": {"da'
    assert finished.tool_calls == []
