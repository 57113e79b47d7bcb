"""The MoE families' output formats, table-driven over model-output strings: gpt-oss's
harmony channels, Qwen3-Coder's XML parameters, DeepSeek-V3.x's and Kimi K2's tool markup,
GLM-4.5's `<arg_key>` pairs and MiniMax-M2's `<invoke>` calls. Every case is parsed whole,
character by character and in random splits (`run_every_split`), and no partial marker
may leak into the text."""

from __future__ import annotations

import pytest

from exo.chat_protocol.harmony import HARMONY_TOKENS, without_markers
from exo.chat_protocol.output_parsing import OutputParser
from exo.chat_protocol.tests.test_output_parsing import WEATHER, run, run_every_split
from exo.chat_protocol.tool_call_markup import FORMAT_TOKENS
from exo.chat_protocol.tool_call_parsing import ToolCallFormat
from exo.shared.types.text_generation import ToolDefinition

EDIT = ToolDefinition(
    name="edit_file",
    parameters={
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "line": {"type": "integer"},
            "ratio": {"type": "number"},
            "dry_run": {"type": "boolean"},
            "options": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
    },
)
TOOLS = (WEATHER, EDIT)

# The arguments every typed case below spells: numbers and booleans as JSON, a string that
# looks like a number stays a string, an object and an array parsed.
TYPED = {
    "path": "42",
    "line": 7,
    "ratio": 0.5,
    "dry_run": True,
    "options": {"mode": "fast"},
    "tags": ["a", "b"],
}

Case = tuple[ToolCallFormat, str, str, str, list[tuple[str, dict[str, object]]]]
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
CASES: list[Case] = [
    # gpt-oss: analysis → reasoning, final → text.
    (
        "harmony",
        HARMONY_ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.",
        "Need the weather.",
        "It is sunny.",
        [],
    ),
    # gpt-oss: the final message closed by `<|return|>` (when it is decoded, not EOS).
    (
        "harmony",
        HARMONY_ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
        "Need the weather.",
        "Done.",
        [],
    ),
    # gpt-oss: the recipient after the channel, `<|constrain|>json`; `<|call|>` is EOS.
    (
        "harmony",
        HARMONY_ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris", "days": "2"}',
        "Need the weather.",
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    # gpt-oss: the recipient before the channel (how its template renders history), and
    # arguments typed by the schema.
    (
        "harmony",
        "<|channel|>analysis<|message|>Edit.<|end|>"
        "<|start|>assistant to=functions.edit_file<|channel|>commentary json<|message|>"
        '{"path": 42, "line": "7", "ratio": "0.5", "dry_run": "true", '
        '"options": "{\\"mode\\": \\"fast\\"}", "tags": ["a", "b"]}',
        "Edit.",
        "",
        [("edit_file", TYPED)],
    ),
    # gpt-oss: `<|call|>` decoded (not an EOS here) ends the turn: what follows, an
    # imagined tool result, is dropped.
    (
        "harmony",
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant'
        '<|channel|>commentary<|message|>"Sunny"<|end|>',
        "",
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    # gpt-oss: a commentary preamble without recipient is answer text.
    (
        "harmony",
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather json<|message|>{"city":"Rome"}',
        "",
        "Checking.",
        [("get_weather", {"city": "Rome"})],
    ),
    # gpt-oss: no header at all (a continued final message) is answer text.
    ("harmony", "Plain answer.", "", "Plain answer.", []),
    # Qwen3-Coder: XML parameters typed by the schema.
    (
        "qwen3_coder",
        "Let me edit.\n<tool_call>\n<function=edit_file>\n<parameter=path>\n42\n</parameter>\n"
        "<parameter=line>\n7\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        "<parameter=dry_run>\ntrue\n</parameter>\n"
        '<parameter=options>\n{"mode": "fast"}\n</parameter>\n'
        '<parameter=tags>\n["a", "b"]\n</parameter>\n</function>\n</tool_call>',
        "",
        "Let me edit.\n",
        [("edit_file", TYPED)],
    ),
    # Qwen3-Coder: two calls; a multi-line string value keeps its inner newlines.
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        "",
        [("get_weather", {"city": "New\nYork"}), ("get_weather", {"city": "Rome", "days": 3})],
    ),
    # DeepSeek-V3.1: NAME<｜tool▁sep｜>{json}, several calls in one section.
    (
        "deepseek_v3",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Tokyo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
        '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "",
        "Sure.",
        [("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "Paris", "days": 2})],
    ),
    # DeepSeek-V3 / R1: function<｜tool▁sep｜>NAME and a ```json fence; section end at EOS.
    (
        "deepseek_v3",
        "<think>Weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>',
        "Weather.",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    # Kimi K2: functions.NAME:IDX, arguments after <|tool_call_argument_begin|>.
    (
        "kimi_k2",
        "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Lima"}<|tool_call_end|>'
        "<|tool_call_begin|>functions.edit_file:1<|tool_call_argument_begin|>"
        '{"path": "42", "line": 7, "ratio": 0.5, "dry_run": true, "options": {"mode": '
        '"fast"}, "tags": ["a", "b"]}<|tool_call_end|><|tool_calls_section_end|>',
        "",
        "Checking.",
        [("get_weather", {"city": "Lima"}), ("edit_file", TYPED)],
    ),
    # GLM-4.5: name, then <arg_key>/<arg_value> pairs typed by the schema; <think> first.
    (
        "glm45",
        "<think>Edit it.</think>\n<tool_call>edit_file\n<arg_key>path</arg_key>\n"
        "<arg_value>42</arg_value>\n<arg_key>line</arg_key>\n<arg_value>7</arg_value>\n"
        "<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n<arg_key>dry_run</arg_key>\n"
        '<arg_value>true</arg_value>\n<arg_key>options</arg_key>\n<arg_value>{"mode": "fast"}'
        '</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["a", "b"]</arg_value>\n'
        "</tool_call>",
        "Edit it.",
        "",
        [("edit_file", TYPED)],
    ),
    # GLM-4.5: a call without arguments.
    ("glm45", "<tool_call>get_weather</tool_call>", "", "", [("get_weather", {})]),
    # MiniMax-M2: <invoke> calls in one block, typed by the schema.
    (
        "minimax_m2",
        "<think>Two calls.</think>\nOn it.\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">Cairo</parameter>\n</invoke>\n'
        '<invoke name="edit_file">\n<parameter name="path">42</parameter>\n'
        '<parameter name="line">7</parameter>\n<parameter name="ratio">0.5</parameter>\n'
        '<parameter name="dry_run">true</parameter>\n'
        '<parameter name="options">{"mode": "fast"}</parameter>\n'
        '<parameter name="tags">["a", "b"]</parameter>\n</invoke>\n</minimax:tool_call>',
        "Two calls.",
        "On it.\n",
        [("get_weather", {"city": "Cairo"}), ("edit_file", TYPED)],
    ),
    # MiniMax-M2: names without quotes are still read.
    (
        "minimax_m2",
        "<minimax:tool_call><invoke name=get_weather><parameter name=city>Oslo</parameter>"
        "</invoke></minimax:tool_call>",
        "",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
]


def _markers(tool_call_format: ToolCallFormat) -> tuple[str, ...]:
    return (
        *HARMONY_TOKENS,
        *FORMAT_TOKENS.get(tool_call_format, ()),
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "<function=",
        "<parameter",
        "<invoke",
    )


@pytest.mark.parametrize(("tool_call_format", "output", "reasoning", "text", "calls"), CASES)
def test_format_is_parsed_under_every_split(
    tool_call_format: ToolCallFormat,
    output: str,
    reasoning: str,
    text: str,
    calls: list[tuple[str, dict[str, object]]],
) -> None:
    result = run_every_split(output, tools=TOOLS, tool_call_format=tool_call_format)
    assert (result.reasoning, result.text, result.calls) == (reasoning, text, calls)
    for marker in _markers(tool_call_format):
        assert marker not in result.text and marker not in result.reasoning


BAD_CALLS: list[tuple[ToolCallFormat, str]] = [
    ("harmony", '<|channel|>commentary to=functions.unknown json<|message|>{"a": 1}'),
    ("harmony", "<|channel|>commentary to=functions.get_weather json<|message|>{not json"),
    ("qwen3_coder", "<tool_call>\n<function=unknown>\n</function>\n</tool_call>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{bad"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.nope:0"),
    ("glm45", "<tool_call>nope\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>"),
    ("minimax_m2", '<minimax:tool_call><invoke name="get_weather"><parameter name="city">'),
]


@pytest.mark.parametrize(("tool_call_format", "output"), BAD_CALLS)
def test_a_bad_or_unfinished_call_comes_back_as_raw_text(
    tool_call_format: ToolCallFormat, output: str
) -> None:
    result = run_every_split(output, tools=TOOLS, tool_call_format=tool_call_format)
    # Harmony's markers are structure, never text: its failed call is the text between them.
    text = without_markers(output) if tool_call_format == "harmony" else output
    assert (result.reasoning, result.text, result.calls) == ("", text, [])


def test_harmony_streams_reasoning_and_text_as_they_come() -> None:
    parser = OutputParser(TOOLS, "harmony", thinking_open=False, forced_tool_call=False)
    assert parser.feed("<|channel|>").is_empty()
    assert parser.feed("analysis<|message|>").is_empty()
    assert parser.feed("Think").reasoning_text == "Think"
    assert parser.feed("ing<|").reasoning_text == "ing"  # `<|` may open `<|end|>`: held
    assert parser.feed("end|><|start|>assistant<|channel|>final<|message|>Hi").text == "Hi"
    assert parser.finish().is_empty()


def test_harmony_call_is_released_when_its_message_ends() -> None:
    parser = OutputParser(TOOLS, "harmony", thinking_open=False, forced_tool_call=False)
    head = "<|channel|>commentary to=functions.get_weather json<|message|>"
    assert parser.feed(head + '{"city": "Paris"}').is_empty()
    released = parser.feed("<|call|>")
    assert [call.name for call in released.tool_calls] == ["get_weather"]


# Marker tokens out of place (a model forced to write them by logit_bias, or one that
# wanders): (output, reasoning, text). None reaches the reasoning or the answer.
STRAY_HARMONY: list[tuple[str, str, str]] = [
    ("<|channel|>" * 80, "", ""),  # a header that never gets its `<|message|>`
    ("<|message|><|message|>Hi<|message|>", "", "Hi"),
    ("<|start|><|start|><|start|>", "", ""),
    ("<|constrain|><|constrain|>", "", ""),
    ("<|end|>Hi<|end|>", "", "Hi"),
    ("<|channel|>final<|message|>A<|channel|>B<|message|>C<|constrain|>D", "", "ABCD"),
    ("<|channel|>analysis<|message|>x<|message|>y<|end|>Done", "xy", "Done"),
]


@pytest.mark.parametrize(("output", "reasoning", "text"), STRAY_HARMONY)
def test_harmony_markers_never_reach_the_text(output: str, reasoning: str, text: str) -> None:
    for tools in ((), TOOLS):
        result = run_every_split(output, tools=tools, tool_call_format="harmony")
        assert (result.reasoning, result.text, result.calls) == (reasoning, text, [])


@pytest.mark.parametrize("end", ["<|call|>", "<|return|>"])
@pytest.mark.parametrize(
    "before", ["", "Hi", "<|message|>", "<|channel|>final", "<|start|>assistant"]
)
def test_harmony_turn_ends_at_call_or_return_outside_a_message(end: str, before: str) -> None:
    """`<|call|>` and `<|return|>` end the turn wherever they stand: what follows is dropped."""
    output = before + end + end + "<|channel|>final<|message|>after"
    result = run_every_split(output, tools=TOOLS, tool_call_format="harmony")
    assert (result.reasoning, result.calls) == ("", [])
    assert result.text == without_markers(before)


def test_harmony_without_tools_reads_channels_and_keeps_calls_as_text() -> None:
    output = (
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Four."
    )
    result = run(list(output), tools=(), tool_call_format="harmony")
    assert (result.reasoning, result.text) == ("Hmm.", "Four.")


def test_harmony_analysis_is_text_when_reasoning_is_not_parsed() -> None:
    result = run(
        ["<|channel|>analysis<|message|>Hmm.<|end|>"],
        tool_call_format="harmony",
        parse_reasoning=False,
    )
    assert (result.reasoning, result.text) == ("", "Hmm.")


def test_harmony_forced_call_is_bare_json() -> None:
    result = run(
        ['{"name": "get_weather", "arguments": {"city": "Paris"}}'],
        tools=TOOLS,
        tool_call_format="harmony",
        forced_tool_call=True,
        parse_reasoning=False,
    )
    assert result.calls == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("tool_call_format", ["deepseek_v3", "kimi_k2", "minimax_m2"])
def test_a_section_left_open_at_the_end_holds_complete_calls(
    tool_call_format: ToolCallFormat,
) -> None:
    """The section's end marker may be cut by EOS; its complete calls still count."""
    output = {
        "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜>',
        "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
        '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>',
        "minimax_m2": '<minimax:tool_call><invoke name="get_weather"><parameter name="city">'
        "Oslo</parameter></invoke>",
    }[tool_call_format]
    result = run_every_split(output, tools=TOOLS, tool_call_format=tool_call_format)
    assert (result.text, result.calls) == ("", [("get_weather", {"city": "Oslo"})])


def test_an_unclosed_qwen3_coder_call_is_text() -> None:
    output = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>"
    result = run_every_split(output, tools=TOOLS, tool_call_format="qwen3_coder")
    assert (result.text, result.calls) == (output, [])


@pytest.mark.parametrize(
    ("tool_call_format", "first", "second"),
    [
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Oslo"}<｜tool▁call▁end｜>',
            '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}'
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>',
            '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": '
            '"Rome"}<|tool_call_end|><|tool_calls_section_end|>',
        ),
        (
            "minimax_m2",
            '<minimax:tool_call>\n<invoke name="get_weather"><parameter name="city">Oslo'
            "</parameter></invoke>",
            '\n<invoke name="get_weather"><parameter name="city">Rome</parameter></invoke>\n'
            "</minimax:tool_call>",
        ),
    ],
)
def test_each_call_of_a_section_is_released_when_it_ends(
    tool_call_format: ToolCallFormat, first: str, second: str
) -> None:
    parser = OutputParser(TOOLS, tool_call_format, thinking_open=False, forced_tool_call=False)
    assert parser.feed("Two.").text == "Two."
    released = parser.feed(first)
    assert [call.arguments for call in released.tool_calls] == ['{"city":"Oslo"}']
    assert released.text == ""
    released = parser.feed(second + " Done.")
    assert [call.arguments for call in released.tool_calls] == ['{"city":"Rome"}']
    assert released.text == " Done."
    assert parser.finish().is_empty()


def test_a_bad_call_in_a_section_is_text_beside_the_good_one() -> None:
    good = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "A"}'
    bad = "<|tool_call_begin|>functions.nope:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
    output = f"<|tool_calls_section_begin|>{good}<|tool_call_end|>{bad}<|tool_calls_section_end|>"
    result = run_every_split(output, tools=TOOLS, tool_call_format="kimi_k2")
    assert result.calls == [("get_weather", {"city": "A"})]
    assert result.text == bad
