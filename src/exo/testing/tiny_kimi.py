"""A tiny Kimi-K2-shaped checkout for tests: a `tiktoken.model` of a few hundred BPE ranks
trained here, a `tokenizer_config.json` laid out like Kimi-K2-Instruct's (its special
tokens at the same offsets past the ranks, `TikTokenTokenizer` from `tokenization_kimi` in
`auto_map`, no `tokenizer.json`), a chat template in Kimi's shape and, for
`save_tiny_kimi_checkout`, random deepseek_v3 weights under model type `kimi_k2`.

The real tokenizer (163,584 ranks, about 2.8 MB) is not shipped; these files exercise the
same loader (`exo.chat_protocol.tokenizer_loading`).
"""

from __future__ import annotations

import base64
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

from exo.chat_protocol.tokenizer_loading import (
    KIMI_PATTERN,
    KIMI_SPECIAL_TOKEN_COUNT,
    TIKTOKEN_FILE,
)
from exo.testing.tiny_models import save_tiny_model

# Kimi-K2-Instruct's named special tokens by their offset past the ranks (its
# tokenizer_config.json's added_tokens_decoder: [BOS] is id 163584 = 163584 ranks + 0).
KIMI_SPECIAL_OFFSETS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "[UNK]": 254,
    "[PAD]": 255,
}

# Kimi's turn layout (`<|im_ROLE|>ROLE<|im_middle|>...<|im_end|>`), tools declared in a
# system turn, calls in its section markup with `functions.NAME:IDX` ids (exo's
# `render_prompt` gives history calls such ids for this format).
KIMI_LIKE_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- elif message.role == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "## Return of {{ message.tool_call_id }}\n"
    "{%- else -%}<|im_system|>{{ message.role }}<|im_middle|>{%- endif -%}"
    "{{ message.content or '' }}"
    "{%- if message.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for call in message.tool_calls -%}<|tool_call_begin|>{{ call.id }}"
    "<|tool_call_argument_begin|>"
    "{%- if call.function.arguments is string -%}{{ call.function.arguments }}"
    "{%- else -%}{{ call.function.arguments | tojson }}{%- endif -%}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

TRAINING_TEXT = (
    "Hello world! The quick brown fox jumps over the lazy dog. I'm Kimi, you're welcome; "
    "they'll say it's THE answer. HTTPServer runs on port 8080 since 2025. "
    "中文分词测试，今天天气很好。日本語のテキスト. Ünïcödé café naïve.\n\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "functions.get_weather:0 tool call returned sunny weather for the user.\n"
)


def train_ranks(text: str = TRAINING_TEXT, merges: int = 160) -> dict[bytes, int]:
    """Byte-pair ranks learned from `text`: the 256 bytes at ranks 0-255, then `merges`
    times the most frequent adjacent pair within Kimi's pre-tokenized pieces (ties to the
    pair seen first) becomes the next rank. Every merged token is the concatenation of two
    lower-ranked ones, as in a real BPE vocabulary."""
    import regex

    ranks = {bytes([value]): value for value in range(256)}
    words = [
        [bytes([value]) for value in piece.encode("utf-8")]
        for piece in regex.findall(KIMI_PATTERN, text, flags=regex.V1)
    ]
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word in words:
            pairs.update(itertools.pairwise(word))
        if not pairs:
            break
        (left, right), _count = pairs.most_common(1)[0]
        ranks[left + right] = len(ranks)
        for word in words:
            index = 0
            while index < len(word) - 1:
                if word[index] == left and word[index + 1] == right:
                    word[index : index + 2] = [left + right]
                index += 1
    return ranks


def write_tiny_kimi_tokenizer(
    directory: Path,
    ranks: dict[bytes, int] | None = None,
    chat_template_in_config: bool = False,
) -> dict[bytes, int]:
    """Write `tiktoken.model`, `tokenizer_config.json` and the chat template (as
    `chat_template.jinja`, or in the config when `chat_template_in_config`) into
    `directory`; the ranks written (`train_ranks()` unless given)."""
    ranks = train_ranks() if ranks is None else ranks
    directory.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    (directory / TIKTOKEN_FILE).write_text("".join(lines))
    base = len(ranks)
    entry = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config: dict[str, Any] = {
        "added_tokens_decoder": {
            str(base + offset): {"content": name, **entry, "special": True}
            for name, offset in KIMI_SPECIAL_OFFSETS.items()
        },
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    if chat_template_in_config:
        config["chat_template"] = KIMI_LIKE_TEMPLATE
    else:
        (directory / "chat_template.jinja").write_text(KIMI_LIKE_TEMPLATE)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ranks


def kimi_token_id(ranks: dict[bytes, int], name: str) -> int:
    """The id of Kimi special token `name` for a tokenizer of `ranks`."""
    return len(ranks) + KIMI_SPECIAL_OFFSETS[name]


def save_tiny_kimi_checkout(directory: Path, n_layers: int = 2) -> dict[bytes, int]:
    """A tiny Kimi-K2 checkout: random deepseek_v3 weights whose config says model type
    `kimi_k2` with custom code (`auto_map`) and an embedding of the ranks plus 256 rows
    (Kimi-K2's 163,840 = 163,584 + 256: the last two special ids the Kimi code numbers
    lie past it), eos `<|im_end|>`, plus `write_tiny_kimi_tokenizer`'s files. The ranks."""
    ranks = train_ranks()
    vocab_size = len(ranks) + KIMI_SPECIAL_TOKEN_COUNT - 2
    save_tiny_model(
        directory, "deepseek_v3", None, n_layers=n_layers, vocab_size=vocab_size,
        tie_word_embeddings=False, bos_token_id=kimi_token_id(ranks, "[BOS]"),
        eos_token_id=kimi_token_id(ranks, "<|im_end|>"),
        pad_token_id=kimi_token_id(ranks, "[PAD]"),
    )  # fmt: skip
    config = json.loads((directory / "config.json").read_text())
    config.update(
        model_type="kimi_k2",
        auto_map={
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tiny_kimi_tokenizer(directory, ranks)
    return ranks
