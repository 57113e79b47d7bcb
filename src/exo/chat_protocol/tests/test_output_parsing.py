"""The streaming output parser: every format, every split of the text, coercion."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from exo.chat_protocol.output_parsing import OutputParser, ParsedOutput
from exo.chat_protocol.tool_arguments import coerce_to_schema
from exo.chat_protocol.tool_call_parsing import ToolCallFormat
from exo.shared.types.text_generation import ToolDefinition

WEATHER = ToolDefinition(
    name="get_weather",
    description="Current weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)
SEARCH = ToolDefinition(
    name="search",
    parameters={"type": "object", "properties": {"query": {"type": "string"}}},
)
TOOLS = (WEATHER, SEARCH)
MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


@dataclass
class Result:
    reasoning: str
    text: str
    calls: list[tuple[str, dict[str, object]]]
    pieces: list[ParsedOutput]


def splits(text: str) -> Iterator[list[str]]:
    """The whole text, char by char, and several random splits."""
    yield [text]
    yield list(text)
    for seed in range(8):
        generator = random.Random(seed)
        pieces, position = [], 0
        while position < len(text):
            size = generator.randint(1, 6)
            pieces.append(text[position : position + size])
            position += size
        yield pieces


def run(
    pieces: Sequence[str],
    tools: Sequence[ToolDefinition] = TOOLS,
    tool_call_format: ToolCallFormat = "hermes",
    thinking_open: bool = False,
    forced_tool_call: bool = False,
    parse_reasoning: bool = True,
) -> Result:
    parser = OutputParser(tools, tool_call_format, thinking_open, forced_tool_call, parse_reasoning)
    outputs = [parser.feed(piece) for piece in pieces]
    outputs.append(parser.finish())
    calls = [(call.name, json.loads(call.arguments)) for out in outputs for call in out.tool_calls]
    return Result(
        reasoning="".join(out.reasoning_text for out in outputs),
        text="".join(out.text for out in outputs),
        calls=calls,
        pieces=outputs,
    )


def run_every_split(text: str, **options: object) -> Result:
    """Parse `text` under every split and check that all agree; returns one result."""
    results = [run(pieces, **options) for pieces in splits(text)]  # type: ignore[arg-type]
    first = results[0]
    for result in results[1:]:
        assert (result.reasoning, result.text, result.calls) == (
            first.reasoning,
            first.text,
            first.calls,
        )
    return first


def assert_no_markers(result: Result) -> None:
    for marker in MARKERS:
        assert marker not in result.text
        assert marker not in result.reasoning


# -- plain text and reasoning --------------------------------------------------------------


def test_plain_text_streams_each_character_without_tools() -> None:
    parser = OutputParser((), "hermes", thinking_open=False, forced_tool_call=False)
    released = [parser.feed(character).text for character in "Hello, {world}"]
    assert released == list("Hello, {world}")
    assert parser.finish().is_empty()


def test_text_with_tools_streams_once_first_character_is_not_json() -> None:
    parser = OutputParser(TOOLS, "llama3_json", thinking_open=False, forced_tool_call=False)
    assert parser.feed("  ").text == ""  # undecided: could still open a JSON call
    assert parser.feed("Hi").text == "  Hi"
    assert parser.feed(" there {").text == " there {"


def test_partial_marker_is_held_then_released_as_text() -> None:
    parser = OutputParser(TOOLS, "hermes", thinking_open=False, forced_tool_call=False)
    assert parser.feed("a <tool_").text == "a "
    assert parser.feed("box>").text == "<tool_box>"
    assert parser.feed("<tool_c").text == ""
    assert parser.finish().text == "<tool_c"


def test_think_section_becomes_reasoning() -> None:
    result = run_every_split("<think>Let me think.\nOK.</think>\n\nThe answer is 4.")
    assert result.reasoning == "Let me think.\nOK."
    assert result.text == "The answer is 4."
    assert_no_markers(result)


def test_reasoning_streams_incrementally() -> None:
    parser = OutputParser((), "hermes", thinking_open=False, forced_tool_call=False)
    assert parser.feed("<thi").is_empty()
    assert parser.feed("nk>abc").reasoning_text == "abc"
    out = parser.feed("de</th")
    assert (out.reasoning_text, out.text) == ("de", "")
    out = parser.feed("ink>xyz")
    assert (out.reasoning_text, out.text) == ("", "xyz")


def test_thinking_open_reads_reasoning_before_close_marker() -> None:
    result = run_every_split("I should add.</think>4", thinking_open=True)
    assert (result.reasoning, result.text) == ("I should add.", "4")


def test_thinking_open_drops_a_repeated_think_marker() -> None:
    result = run_every_split("<think>\nhmm</think>ok", thinking_open=True)
    assert (result.reasoning, result.text) == ("\nhmm", "ok")
    result = run_every_split("  <thi", thinking_open=True)
    assert (result.reasoning, result.text) == ("  <thi", "")


def test_thinking_open_without_close_is_all_reasoning() -> None:
    result = run_every_split("still thinking </th", thinking_open=True)
    assert (result.reasoning, result.text) == ("still thinking </th", "")


def test_unclosed_think_section_is_reasoning_at_finish() -> None:
    result = run_every_split("<think>never done")
    assert (result.reasoning, result.text) == ("never done", "")


def test_think_marker_only_opens_reasoning_at_start() -> None:
    result = run_every_split("Use <think> tags.", tools=())
    assert (result.reasoning, result.text) == ("", "Use <think> tags.")


def test_parse_reasoning_false_keeps_markers_in_text() -> None:
    text = "<think>x</think>y"
    result = run_every_split(text, parse_reasoning=False)
    assert (result.reasoning, result.text) == ("", text)
    result = run_every_split("x</think>y", thinking_open=True, parse_reasoning=False)
    assert (result.reasoning, result.text) == ("", "x</think>y")


def test_partial_think_open_at_finish_is_text() -> None:
    assert run(["<thi"], tools=()).text == "<thi"


# -- Hermes --------------------------------------------------------------------------------


def test_hermes_call_with_text_around() -> None:
    text = (
        "<think>need weather</think>Checking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": "3"}}\n'
        "</tool_call>\n"
    )
    result = run_every_split(text)
    assert result.reasoning == "need weather"
    assert result.text == "Checking.\n"
    assert result.calls == [("get_weather", {"city": "Paris", "days": 3})]
    assert_no_markers(result)


def test_hermes_several_calls_drop_whitespace_between() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n\n'
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"b\\"}"}</tool_call>\n'
    )
    result = run_every_split(text)
    assert result.text == ""
    assert result.calls == [("get_weather", {"city": "A"}), ("search", {"query": "b"})]


def test_hermes_text_after_call_stays_text() -> None:
    text = '<tool_call>{"name": "search", "arguments": {}}</tool_call>\nDone.'
    result = run_every_split(text)
    assert result.calls == [("search", {})]
    assert result.text == "\nDone."


def test_hermes_call_is_released_when_closed() -> None:
    parser = OutputParser(TOOLS, "hermes", thinking_open=False, forced_tool_call=False)
    assert parser.feed('<tool_call>{"name": "search", "arguments": {}}').is_empty()
    out = parser.feed("</tool_call>")
    assert [call.name for call in out.tool_calls] == ["search"]


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # unknown
        '<tool_call>["get_weather"]</tool_call>',  # not an object
        '<tool_call>{"name": "search", "arguments": "not json"}</tool_call>',
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
    ],
)
def test_hermes_bad_call_comes_back_as_raw_text(block: str) -> None:
    text = f"Before {block} after"
    result = run_every_split(text)
    assert result.calls == []
    assert result.text == text


def test_hermes_bad_call_next_to_good_one() -> None:
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    result = run_every_split(bad + good)
    assert result.text == bad
    assert result.calls == [("search", {"query": "x"})]


def test_hermes_unclosed_call_is_text_at_finish() -> None:
    text = 'Sure <tool_call>{"name": "search", "arguments": {}}'
    result = run_every_split(text)
    assert (result.text, result.calls) == (text, [])


def test_no_tools_means_no_tool_parsing() -> None:
    text = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    result = run_every_split(text, tools=())
    assert (result.text, result.calls) == (text, [])


# -- Llama 3 JSON --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        '  {"name": "get_weather", "arguments": {"city": "Rome"}}  ',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
    ],
)
def test_llama3_single_call(text: str) -> None:
    result = run_every_split(text, tool_call_format="llama3_json")
    assert result.calls == [("get_weather", {"city": "Rome"})]
    assert result.text == ""


def test_llama3_calls_separated_by_semicolon() -> None:
    text = (
        '{"name": "get_weather", "parameters": {"city": "a;b"}}; '
        '{"name": "search", "parameters": {"query": "q"}}'
    )
    result = run_every_split(text, tool_call_format="llama3_json")
    assert result.calls == [("get_weather", {"city": "a;b"}), ("search", {"query": "q"})]


def test_llama3_json_that_is_no_call_is_text() -> None:
    text = '{"answer": 42}'
    result = run_every_split(text, tool_call_format="llama3_json")
    assert (result.text, result.calls) == (text, [])


def test_llama3_unknown_tool_in_sequence_makes_all_text() -> None:
    text = '{"name": "search", "parameters": {"query": "q"}}; {"name": "nope", "parameters": {}}'
    result = run_every_split(text, tool_call_format="llama3_json")
    assert (result.text, result.calls) == (text, [])


def test_llama3_python_tag_after_text() -> None:
    text = 'Let me look.<|python_tag|>{"name": "search", "parameters": {"query": "q"}}'
    result = run_every_split(text, tool_call_format="llama3_json")
    assert result.text == "Let me look."
    assert result.calls == [("search", {"query": "q"})]


# -- Mistral -------------------------------------------------------------------------------


def test_mistral_json_list() -> None:
    text = (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, '
        '{"name": "search", "arguments": {"query": "x"}, "id": "abcdefghi"}]'
    )
    result = run_every_split(text, tool_call_format="mistral")
    assert result.calls == [("get_weather", {"city": "Nice"}), ("search", {"query": "x"})]
    assert result.text == ""


def test_mistral_name_args_form_with_text_before() -> None:
    text = (
        'One moment.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice", "days": 2}'
        '[TOOL_CALLS]search[CALL_ID]abc123xyz[ARGS]{"query": "y"}'
    )
    result = run_every_split(text, tool_call_format="mistral")
    assert result.text == "One moment."
    assert result.calls == [
        ("get_weather", {"city": "Nice", "days": 2}),
        ("search", {"query": "y"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ',
        '[TOOL_CALLS]nope[ARGS]{"city": "Nice"}',
        "[TOOL_CALLS]get_weather",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"} trailing',
    ],
)
def test_mistral_bad_calls_are_raw_text(text: str) -> None:
    result = run_every_split(text, tool_call_format="mistral")
    assert (result.text, result.calls) == (text, [])


def test_mistral_list_start_is_not_mistaken_for_marker() -> None:
    result = run_every_split("[1, 2] are numbers", tool_call_format="mistral")
    assert (result.text, result.calls) == ("[1, 2] are numbers", [])


# -- generic and forced --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "search", "arguments": {"query": "z"}}',
        '[{"name": "search", "parameters": {"query": "z"}}]',
        '```json\n{"name": "search", "arguments": {"query": "z"}}\n```',
        '```\n[{"name": "search", "arguments": {"query": "z"}}]\n```\n',
    ],
)
@pytest.mark.parametrize("tool_call_format", ["generic", "hermes", "mistral"])
def test_generic_whole_output_call(text: str, tool_call_format: ToolCallFormat) -> None:
    result = run_every_split(text, tool_call_format=tool_call_format)
    assert result.calls == [("search", {"query": "z"})]
    assert result.text == ""


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "search"}',  # generic needs arguments: likely ordinary JSON
        '{"name": "unknown", "arguments": {}}',
        '```python\nprint("hi")\n```',
        '```json\n{"name": "search", "arguments": {}}\n``` and more',
        "{not json",
    ],
)
def test_generic_non_calls_are_text(text: str) -> None:
    result = run_every_split(text, tool_call_format="generic")
    assert (result.text, result.calls) == (text, [])


def test_code_fence_in_other_language_streams_early() -> None:
    parser = OutputParser(TOOLS, "generic", thinking_open=False, forced_tool_call=False)
    assert parser.feed("```").text == ""
    assert parser.feed("py").text == "```py"


def test_forced_call_is_one_call_without_text() -> None:
    text = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1.0}}'
    parser = OutputParser(TOOLS, "hermes", thinking_open=False, forced_tool_call=True)
    assert all(parser.feed(character).is_empty() for character in text)
    result = run_every_split(text, forced_tool_call=True)
    assert result.calls == [("get_weather", {"city": "Oslo", "days": 1})]
    assert result.text == ""


def test_forced_call_after_reasoning() -> None:
    text = 'hmm</think>\n{"name": "search", "arguments": {}}'
    result = run_every_split(text, forced_tool_call=True, thinking_open=True)
    assert (result.reasoning, result.calls, result.text) == ("hmm", [("search", {})], "")


def test_forced_garbage_is_text() -> None:
    result = run_every_split('{"name": "search", "arguments": {', forced_tool_call=True)
    assert (result.text, result.calls) == ('{"name": "search", "arguments": {', [])


# -- ids, arguments, lifecycle ---------------------------------------------------------------


def test_tool_call_ids_are_unique_and_shaped_like_openai() -> None:
    text = '<tool_call>{"name": "search", "arguments": {}}</tool_call>' * 3
    calls = [call for out in run([text]).pieces for call in out.tool_calls]
    assert len({call.id for call in calls}) == 3
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id) for call in calls)


def test_arguments_are_compact_json() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    (call,) = [call for out in run([text]).pieces for call in out.tool_calls]
    assert call.arguments == '{"city":"Zürich"}'


def test_feed_after_finish_raises() -> None:
    parser = OutputParser((), "generic", thinking_open=False, forced_tool_call=False)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.finish()


# -- coercion ------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "flag": {"type": "boolean"},
        "label": {"type": "string"},
        "options": {
            "type": "object",
            "properties": {"depth": {"type": "integer"}, "fast": {"type": "boolean"}},
        },
        "tags": {"type": "array", "items": {"type": "integer"}},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "boolean"}, {"type": "number"}]},
    },
}


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"count": "5"}, {"count": 5}),
        ({"count": " 7 "}, {"count": 7}),
        ({"count": "5.0"}, {"count": 5}),
        ({"count": 3.0}, {"count": 3}),
        ({"count": "5.5"}, {"count": "5.5"}),  # not an integer: left alone
        ({"count": "five"}, {"count": "five"}),
        ({"count": True}, {"count": True}),
        ({"ratio": "2.5"}, {"ratio": 2.5}),
        ({"ratio": "nan"}, {"ratio": "nan"}),
        ({"flag": "true"}, {"flag": True}),
        ({"flag": "False"}, {"flag": False}),
        ({"flag": "yes"}, {"flag": "yes"}),
        ({"label": 12}, {"label": "12"}),
        ({"label": 1.5}, {"label": "1.5"}),
        ({"label": True}, {"label": True}),
        ({"options": '{"depth": "2", "fast": "true"}'}, {"options": {"depth": 2, "fast": True}}),
        ({"options": {"depth": "4", "extra": "9"}}, {"options": {"depth": 4, "extra": "9"}}),
        ({"options": "[1]"}, {"options": "[1]"}),
        ({"tags": '[1, "2"]'}, {"tags": [1, 2]}),
        ({"tags": ["3"]}, {"tags": [3]}),
        ({"maybe": "4"}, {"maybe": 4}),
        ({"maybe": None}, {"maybe": None}),
        ({"either": "true"}, {"either": True}),
        ({"either": "3.5"}, {"either": 3.5}),
        ({"either": 2}, {"either": 2}),
        ({"unknown": "5"}, {"unknown": "5"}),
    ],
)
def test_coercion(arguments: dict[str, object], expected: dict[str, object]) -> None:
    assert coerce_to_schema(arguments, SCHEMA) == expected


def test_coercion_does_not_modify_input() -> None:
    arguments = {"options": {"depth": "2"}}
    coerce_to_schema(arguments, SCHEMA)
    assert arguments == {"options": {"depth": "2"}}


def test_coercion_without_schema_is_identity() -> None:
    assert coerce_to_schema({"a": "1"}, {}) == {"a": "1"}


def test_coercion_applies_to_parsed_calls() -> None:
    tool = ToolDefinition(name="configure", parameters=SCHEMA)
    text = (
        '<tool_call>{"name": "configure", "arguments": '
        '{"count": "2", "flag": "false", "options": "{\\"depth\\": \\"1\\"}"}}</tool_call>'
    )
    result = run_every_split(text, tools=(tool,))
    assert result.calls == [("configure", {"count": 2, "flag": False, "options": {"depth": 1}})]
