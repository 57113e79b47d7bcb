"""Tokenizers and chat templates for testing the chat formats of model families whose real
tokenizers are too large to ship (gpt-oss's o200k_harmony, Kimi K2's TikToken, DeepSeek's):
a byte-level tokenizer that spells any text, with the family's markers as special tokens,
and a template in the shape of the family's own.

`GPT_OSS_LIKE` is written from gpt-oss's published chat template and harmony format
(openai/gpt-oss-20b `chat_template.jinja`; OpenAI, "OpenAI Harmony Response Format"): the
same special tokens and message layout — reasoning effort in the system message, tools as
a `functions` namespace in the developer message, one call per assistant message with the
recipient before the channel (`<|start|>assistant to=functions.NAME<|channel|>commentary
json<|message|>ARGS<|call|>`), `thinking` as the analysis channel, tool results named after
the latest call, and its refusals (content beside thinking on a call; a tool result with no
call before it) — without its prose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GPT_OSS_LIKE = """
{%- set effort = reasoning_effort if reasoning_effort is defined else "medium" -%}
<|start|>system<|message|>You are a helpful assistant.
Reasoning: {{ effort }}

# Valid channels: analysis, commentary, final.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- set has_system = messages and messages[0].role in ("system", "developer") %}
{%- if has_system or tools %}<|start|>developer<|message|>
{%- if has_system %}# Instructions

{{ messages[0].content }}
{% endif %}
{%- if tools %}# Tools

namespace functions {
{%- for tool in tools %}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{%- endfor %}
}{% endif %}<|end|>
{%- endif %}
{%- set last_call = namespace(name=none) %}
{%- for message in messages %}
{%- if message.role in ("system", "developer") %}
{%- elif message.role == "user" %}<|start|>user<|message|>{{ message.content }}<|end|>
{%- elif message.role == "assistant" and "tool_calls" in message %}
{%- set future_final = namespace(found=false) %}
{%- for later in messages[loop.index:] %}
{%- if later.role == "assistant" and "tool_calls" not in later %}
{%- set future_final.found = true %}{% endif %}
{%- endfor %}
{%- set call = message.tool_calls[0] %}
{%- if call.function %}{% set call = call.function %}{% endif %}
{%- if message.content and message.thinking %}
{{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") }}
{%- elif message.content and not future_final.found %}<|start|>assistant<|channel|>analysis<|message|>{{ message.content }}<|end|>
{%- elif message.thinking and not future_final.found %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>
{%- endif %}<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments | tojson }}<|call|>
{%- set last_call.name = call.name %}
{%- elif message.role == "assistant" %}
{%- if loop.last and not add_generation_prompt and "thinking" in message %}<|start|>assistant<|channel|>analysis<|message|>{{ message.thinking }}<|end|>{% endif %}
<|start|>assistant<|channel|>final<|message|>{{ message.content }}
{{- "<|return|>" if loop.last and not add_generation_prompt else "<|end|>" }}
{%- set last_call.name = none %}
{%- elif message.role == "tool" %}
{%- if last_call.name is none %}
{{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
{%- endif %}<|start|>functions.{{ last_call.name }} to=assistant<|channel|>commentary<|message|>{{ message.content | tojson }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""  # noqa: E501


def byte_tokenizer(special_tokens: Sequence[str], chat_template: str | None = None) -> Any:
    """A Hugging Face fast tokenizer that spells any text byte by byte (byte-level BPE, no
    merges) and has `special_tokens` as single special tokens, `<|endoftext|>` its EOS.

    Args:
        special_tokens: the markers to add as special tokens (ids after the 256 bytes).
        chat_template: its chat template, if any.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    model = models.BPE(vocab={symbol: index for index, symbol in enumerate(alphabet)}, merges=[])
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
