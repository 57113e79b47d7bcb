"""Prompts and decoding for the MoE families' formats: gpt-oss's history through a template
shaped like its own (`exo.testing.chat_formats.GPT_OSS_LIKE`), its reasoning effort, Kimi
K2's call ids, DeepSeek-V3.1's `thinking` switch, MiniMax-M2's interleaved thinking, format
detection, and the markers a decode keeps. Byte-level tokenizers: no model files."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exo.chat_protocol.harmony import HARMONY_TOKENS
from exo.chat_protocol.output_parsing import OutputParser
from exo.chat_protocol.prompt import decode_keeping_markers, detect_tool_call_format, render_prompt
from exo.chat_protocol.tool_call_markup import FORMAT_TOKENS
from exo.chat_protocol.tool_call_parsing import ToolCallFormat
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    TextGenerationTaskParams,
    ToolCall,
    ToolDefinition,
)
from exo.testing.chat_formats import GPT_OSS_LIKE, byte_tokenizer

WEATHER = ToolDefinition(
    name="get_weather",
    description="Current weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
CLOCK = ToolDefinition(name="get_time", description="Current time")
USER = ChatMessage(role="user", content="Weather in Paris, and the time?")


@pytest.fixture(scope="module")
def gpt_oss() -> Any:
    return byte_tokenizer([*HARMONY_TOKENS, "<|endoftext|>"], GPT_OSS_LIKE)


def make_params(*messages: ChatMessage, **options: Any) -> TextGenerationTaskParams:
    options.setdefault("tools", (WEATHER, CLOCK))
    return TextGenerationTaskParams(model=ModelId("test-model"), messages=messages, **options)


def two_calls(content: str = "") -> ChatMessage:
    return ChatMessage(
        role="assistant",
        content=content,
        reasoning_content="Two tools.",
        tool_calls=(
            ToolCall(id="call_weather", name="get_weather", arguments='{"city": "Paris"}'),
            ToolCall(id="call_time", name="get_time", arguments="{}"),
        ),
    )


def test_gpt_oss_calls_render_one_per_message_each_followed_by_its_result(gpt_oss: Any) -> None:
    # The results arrive in the other order: each must still follow its own call.
    params = make_params(
        USER,
        two_calls(),
        ChatMessage(role="tool", tool_call_id="call_time", content="12:00"),
        ChatMessage(role="tool", tool_call_id="call_weather", content="Sunny"),
    )
    rendered = render_prompt(gpt_oss, params)
    assert rendered.tool_call_format == "harmony"
    assert rendered.text.endswith(
        "<|start|>user<|message|>Weather in Paris, and the time?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Two tools.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
        '"Sunny"<|end|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        "{}<|call|>"
        "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"
        '"12:00"<|end|>'
        "<|start|>assistant"
    )
    assert "type get_weather = " in rendered.text


def test_gpt_oss_call_with_text_and_reasoning_renders_both_as_analysis(gpt_oss: Any) -> None:
    """Its template refuses content beside thinking on a call message."""
    params = make_params(
        USER,
        two_calls(content="Checking both."),
        ChatMessage(role="tool", tool_call_id="call_weather", content="Sunny"),
        ChatMessage(role="tool", tool_call_id="call_time", content="12:00"),
    )
    text = render_prompt(gpt_oss, params).text
    assert "<|channel|>analysis<|message|>Two tools.\n\nChecking both.<|end|>" in text


def test_gpt_oss_output_parsed_and_sent_back_renders_as_the_model_wrote_it(gpt_oss: Any) -> None:
    written = (
        "<|channel|>analysis<|message|>Need Paris.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Paris"}'
    )
    parser = OutputParser((WEATHER,), "harmony", thinking_open=False, forced_tool_call=False)
    parsed = [parser.feed(written), parser.finish()]
    calls = tuple(call for piece in parsed for call in piece.tool_calls)
    reasoning = "".join(piece.reasoning_text for piece in parsed)
    history = ChatMessage(
        role="assistant", content="", reasoning_content=reasoning, tool_calls=calls
    )
    result = ChatMessage(role="tool", tool_call_id=calls[0].id, content="Sunny")
    rendered = render_prompt(gpt_oss, make_params(USER, history, result)).text
    assert "<|start|>assistant" + written + "<|call|>" in rendered
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({}, "Reasoning: medium"),  # the template's default
        ({"reasoning_effort": "high"}, "Reasoning: high"),
        ({"reasoning_effort": "minimal"}, "Reasoning: low"),  # gpt-oss knows no "minimal"
        ({"enable_thinking": False}, "Reasoning: low"),  # it always reasons
    ],
)
def test_gpt_oss_reasoning_effort(gpt_oss: Any, options: dict[str, Any], shown: str) -> None:
    assert shown in render_prompt(gpt_oss, make_params(USER, **options)).text


def test_gpt_oss_decode_keeps_its_markers_and_drops_other_special_tokens(gpt_oss: Any) -> None:
    text = "<|channel|>final<|message|>Hi<|end|><|start|>assistant<|return|><|endoftext|>"
    ids = gpt_oss(text, add_special_tokens=False)["input_ids"]
    assert gpt_oss.decode(ids, skip_special_tokens=True) == "finalHiassistant"
    assert decode_keeping_markers(gpt_oss)(ids) == text.removesuffix("<|endoftext|>")


def test_harmony_markers_are_dropped_for_other_formats() -> None:
    """Phi-3 spells a special `<|end|>` too: only harmony's parser reads it."""
    tokenizer = byte_tokenizer(["<|end|>"], "{{ tools }}<tool_call>")
    ids = tokenizer("Hi<|end|>", add_special_tokens=False)["input_ids"]
    assert decode_keeping_markers(tokenizer)(ids) == "Hi"


@pytest.mark.parametrize(
    ("tool_call_format", "sign"),
    [
        ("harmony", "<|channel|>"),
        ("qwen3_coder", "<tool_call>\n<function="),
        ("glm45", "<tool_call>{{ name }}<arg_key>"),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>"),
        ("kimi_k2", "<|tool_calls_section_begin|>"),
        ("minimax_m2", "<minimax:tool_call>"),
    ],
)
def test_format_detected_from_template_and_its_markers_survive_decoding(
    tool_call_format: ToolCallFormat, sign: str
) -> None:
    markers = {
        **FORMAT_TOKENS,
        "harmony": HARMONY_TOKENS,
        "qwen3_coder": ("<tool_call>", "</tool_call>"),
    }[tool_call_format]
    tokenizer = byte_tokenizer([*markers, "<|endoftext|>"], "{{ tools }}" + sign)
    assert detect_tool_call_format(tokenizer) == tool_call_format
    text = "a" + "b".join(markers) + "c"
    ids = tokenizer(text + "<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert decode_keeping_markers(tokenizer)(ids) == text


def test_deepseek_markup_in_a_template_without_tools_is_the_hermes_fallback() -> None:
    """DeepSeek-R1's template (its distills') writes calls in history but takes no tools:
    exo asks such a model for Hermes calls."""
    tokenizer = byte_tokenizer([], "{% for m in messages %}<｜tool▁calls▁begin｜>{% endfor %}")
    assert detect_tool_call_format(tokenizer) == "hermes"


KIMI_LIKE = """{{ tools | length }}<|tool_calls_section_begin|>
{%- for m in messages %}[{{ m.role }}]{{ m.content }}
{%- for call in m.tool_calls | default([]) %}<|tool_call_begin|>{{ call.id }}
<|tool_call_argument_begin|>{{ call.function.arguments | tojson }}<|tool_call_end|>{% endfor %}
{%- if m.role == "tool" %}## Return of {{ m.tool_call_id }}{% endif %}
{%- endfor %}"""


def test_kimi_history_calls_get_its_own_ids() -> None:
    tokenizer = byte_tokenizer(FORMAT_TOKENS["kimi_k2"], KIMI_LIKE)
    params = make_params(
        USER,
        two_calls(),
        ChatMessage(role="tool", tool_call_id="call_weather", content="Sunny"),
        ChatMessage(role="tool", tool_call_id="call_time", content="12:00"),
    )
    text = render_prompt(tokenizer, params).text
    assert "<|tool_call_begin|>functions.get_weather:0\n" in text
    assert "<|tool_call_begin|>functions.get_time:1\n" in text
    assert "## Return of functions.get_weather:0" in text
    assert "## Return of functions.get_time:1" in text
    assert "call_weather" not in text


DEEPSEEK_LIKE = """{{ tools | length }}<｜tool▁calls▁begin｜>
{%- for m in messages %}<｜User｜>{{ m.content }}{% endfor %}<｜Assistant｜>
{%- if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}"""


@pytest.mark.parametrize(("enable_thinking", "thinking_open"), [(True, True), (False, False)])
def test_deepseek_thinking_switch_reaches_its_template(
    enable_thinking: bool, thinking_open: bool
) -> None:
    tokenizer = byte_tokenizer(FORMAT_TOKENS["deepseek_v3"], DEEPSEEK_LIKE)
    rendered = render_prompt(tokenizer, make_params(USER, enable_thinking=enable_thinking))
    assert rendered.tool_call_format == "deepseek_v3"
    assert rendered.thinking_open == thinking_open


MINIMAX_LIKE = """{{ tools | length }}<minimax:tool_call>
{%- for m in messages %}]~b]{{ m.role }}
{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}
{{- m.content }}[e~[{% endfor %}]~b]ai
<think>
"""


def test_minimax_keeps_the_thinking_of_earlier_turns_in_the_history() -> None:
    """MiniMax-M2 is an interleaved-thinking model: its template renders each assistant
    turn's `<think>` from `reasoning_content`, which every dialect fills from the
    history's reasoning."""
    tokenizer = byte_tokenizer(FORMAT_TOKENS["minimax_m2"], MINIMAX_LIKE)
    history = ChatMessage(role="assistant", content="Sunny.", reasoning_content="Look it up.")
    rendered = render_prompt(tokenizer, make_params(USER, history, USER))
    assert "<think>Look it up.</think>Sunny." in rendered.text
    assert rendered.thinking_open and rendered.tool_call_format == "minimax_m2"


@pytest.mark.parametrize(
    ("token", "tool_call_format"),
    [
        ("<|tool_calls_section_begin|>", "kimi_k2"),
        ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
        ("<minimax:tool_call>", "minimax_m2"),
        ("<|channel|>", "harmony"),
    ],
)
def test_format_detected_from_vocabulary_when_the_template_shows_none(
    token: str, tool_call_format: ToolCallFormat
) -> None:
    tokenizer = byte_tokenizer(
        [token], "{{ tools }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert detect_tool_call_format(tokenizer) == tool_call_format
