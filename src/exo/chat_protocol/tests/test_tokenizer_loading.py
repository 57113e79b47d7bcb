"""Kimi's TikToken tokenizer built from its data files (`tokenizer_loading`), checked on a
tiny checkout laid out like Kimi-K2-Instruct's (`exo.testing.tiny_kimi`): encoding equals
a rank-merge BPE computed here over the pattern's pieces (split by the `regex` module, not
by the `tokenizers` engine the loader uses; and tiktoken's own encoder where that package
is installed), special tokens are their ids, decoding round-trips, the chat template
renders through exo's prompt path with Kimi's tool-call format, and files that do not
parse are refused naming the line or field.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import regex

from exo.chat_protocol.format_detection import decode_keeping_markers
from exo.chat_protocol.prompt import render_prompt
from exo.chat_protocol.tokenizer_loading import (
    KIMI_PATTERN,
    KIMI_SPECIAL_TOKEN_COUNT,
    is_kimi_tiktoken,
    load_tokenizer,
)
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    TextGenerationTaskParams,
    ToolCall,
    ToolDefinition,
)
from exo.testing.tiny_kimi import KIMI_SPECIAL_OFFSETS, kimi_token_id, write_tiny_kimi_tokenizer

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'M Kimi; you're here, they'll go. HTTPServer isn't DON'T",
    "中文分词测试，今天天气很好。日本語のテキスト mixed中文text",
    "port 8080 since 2025, 1234567 digits",
    "  leading spaces\n\n\ttabs  and trailing   \r\n",
    "Ünïcödé café naïve 😀 emoji 🇫🇷 flags",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "",
]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[bytes, int], Any]:
    directory = tmp_path_factory.mktemp("kimi-tokenizer")
    ranks = write_tiny_kimi_tokenizer(directory)
    return directory, ranks, load_tokenizer(directory)


def reference_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken's rule over each piece of the pattern: a piece that is a token is that
    token; otherwise start from its bytes and merge, again and again, the adjacent pair
    whose concatenation has the lowest rank."""
    ids: list[int] = []
    for piece in regex.findall(KIMI_PATTERN, text, flags=regex.V1):
        data = piece.encode("utf-8")
        if data in ranks:
            ids.append(ranks[data])
            continue
        parts = [bytes([value]) for value in data]
        while len(parts) > 1:
            candidates = [
                (ranks[parts[i] + parts[i + 1]], i)
                for i in range(len(parts) - 1)
                if parts[i] + parts[i + 1] in ranks
            ]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[part] for part in parts)
    return ids


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_equals_the_rank_merge_bpe(
    kimi: tuple[Path, dict[bytes, int], Any], text: str
) -> None:
    _, ranks, tokenizer = kimi
    expected = reference_encode(ranks, text)
    assert tokenizer.encode(text, add_special_tokens=False) == expected
    assert tokenizer.encode(text) == expected  # no BOS/EOS added, as the Kimi code
    assert tokenizer.decode(expected) == text
    # The merges are used (not only bytes): the trained text has multi-byte tokens.
    if text.startswith("Hello"):
        assert len(expected) < len(text.encode("utf-8")) / 2


def test_encoding_equals_tiktoken_where_installed(kimi: tuple[Path, dict[bytes, int], Any]) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    _, ranks, tokenizer = kimi
    base = len(ranks)
    names = {name: base + offset for name, offset in KIMI_SPECIAL_OFFSETS.items()}
    encoding = tiktoken.Encoding(
        name="tiny-kimi", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=names
    )
    for text in [*TEXTS, "<|im_user|>user<|im_middle|>hi<|im_end|>"]:
        assert tokenizer.encode(text) == encoding.encode(text, allowed_special="all")


def test_special_tokens_are_their_ids(kimi: tuple[Path, dict[bytes, int], Any]) -> None:
    _, ranks, tokenizer = kimi
    base = len(ranks)
    assert len(tokenizer) == base + KIMI_SPECIAL_TOKEN_COUNT
    for name in KIMI_SPECIAL_OFFSETS:
        token_id = kimi_token_id(ranks, name)
        assert tokenizer.convert_tokens_to_ids(name) == token_id
        assert tokenizer.encode(f"a{name}b") == [
            *reference_encode(ranks, "a"), token_id, *reference_encode(ranks, "b"),
        ]  # fmt: skip
        assert tokenizer.decode([token_id]) == name
    # The unnamed ids of the Kimi code's numbering.
    assert tokenizer.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    assert tokenizer.encode(f"<|reserved_token_{base + 253}|>") == [base + 253]
    assert tokenizer.convert_ids_to_tokens(base + 257) == f"<|reserved_token_{base + 257}|>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (base, base + 1)
    assert (tokenizer.unk_token_id, tokenizer.pad_token_id) == (base + 254, base + 255)
    message = "<|im_user|>user<|im_middle|>Hello world!<|im_end|>"
    ids = tokenizer.encode(message)
    assert ids[0] == kimi_token_id(ranks, "<|im_user|>")
    assert ids[-1] == kimi_token_id(ranks, "<|im_end|>")
    assert tokenizer.decode(ids) == message
    assert tokenizer.decode(ids, skip_special_tokens=True) == "userHello world!"


def test_the_chat_template_renders_with_kimi_tool_calls(
    kimi: tuple[Path, dict[bytes, int], Any],
) -> None:
    """Through exo's own prompt path: the history call gets Kimi's `functions.NAME:IDX` id,
    the markers become their single ids, the format is detected as kimi_k2, and a decoder
    keeping markers shows them to the output parser."""
    _, ranks, tokenizer = kimi
    call = ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    params = TextGenerationTaskParams(
        model=ModelId("moonshotai/Kimi-K2-Instruct"),
        messages=(
            ChatMessage(role="user", content="Weather in Paris?"),
            ChatMessage(role="assistant", content="", tool_calls=(call,)),
            ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
        ),
        tools=(ToolDefinition(name="get_weather"),),
    )
    rendered = render_prompt(tokenizer, params)
    assert rendered.tool_call_format == "kimi_k2"
    assert rendered.text.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in rendered.text
    assert "## Return of functions.get_weather:0" in rendered.text
    for name in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|im_system|>"):
        assert kimi_token_id(ranks, name) in rendered.token_ids
    assert rendered.token_ids == tokenizer.encode(rendered.text)
    decode = decode_keeping_markers(tokenizer)
    section = [kimi_token_id(ranks, "<|tool_calls_section_begin|>"), *tokenizer.encode("x")]
    assert decode(section) == "<|tool_calls_section_begin|>x"
    assert decode([kimi_token_id(ranks, "[EOS]"), *tokenizer.encode("x")]) == "x"


def test_the_template_may_sit_in_tokenizer_config(tmp_path: Path) -> None:
    write_tiny_kimi_tokenizer(tmp_path, chat_template_in_config=True)
    assert not (tmp_path / "chat_template.jinja").exists()
    tokenizer = load_tokenizer(tmp_path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"


def test_only_kimi_tiktoken_checkouts_take_this_path(tmp_path: Path) -> None:
    write_tiny_kimi_tokenizer(tmp_path)
    assert is_kimi_tiktoken(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    other = {**config, "auto_map": {"AutoTokenizer": ["tokenization_other.Tokenizer", None]}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(other))
    assert not is_kimi_tiktoken(tmp_path)  # another code's pattern may differ
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert not is_kimi_tiktoken(tmp_path)  # a tokenizer.json wins, as for AutoTokenizer


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("YQ== 0\nnot-base64! 1\n", "tiktoken.model line 2"),
        ("YQ== 0\nYg== x\n", "tiktoken.model line 2"),
        ("YQ== 0\nYQ== 1\n", "tiktoken.model line 2: repeated"),
        ("YQ== 0\nYg== 2\n", r"ranks are not 0\.\.1"),
    ],
)
def test_a_ranks_file_that_does_not_parse_is_refused(
    tmp_path: Path, lines: str, message: str
) -> None:
    write_tiny_kimi_tokenizer(tmp_path, ranks={b"a": 0})
    (tmp_path / "tiktoken.model").write_text(lines)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tmp_path)


def test_special_ids_outside_the_kimi_numbering_are_refused(tmp_path: Path) -> None:
    ranks = {bytes([value]): value for value in range(256)}
    write_tiny_kimi_tokenizer(tmp_path, ranks=ranks)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["600"] = {"content": "<|late|>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"added_tokens_decoder id 600 is outside .*256\.\.513"):
        load_tokenizer(tmp_path)
    del config["added_tokens_decoder"]["600"]
    config["eos_token"] = "<|nope|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape("eos_token '<|nope|>' is not a special token")):
        load_tokenizer(tmp_path)


def test_the_ranks_file_is_read_without_tiktoken(tmp_path: Path) -> None:
    """The file format: base64 of the token's bytes, a space, the rank; any bytes (not
    only UTF-8) are tokens."""
    ranks = {bytes([value]): value for value in range(256)}
    ranks[b"\xe4\xb8"] = 256  # half a character: a real BPE has such tokens
    write_tiny_kimi_tokenizer(tmp_path, ranks=ranks)
    first = (tmp_path / "tiktoken.model").read_text().splitlines()[256]
    assert first == base64.b64encode(b"\xe4\xb8").decode() + " 256"
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("中") == [256, 0xAD]
    assert tokenizer.decode([256, 0xAD]) == "中"


@pytest.mark.parametrize(
    ("text", "pieces"),
    [
        # Han runs stand apart from other letters (kana are not Han).
        ("中文text日本語テキスト", ["中文", "text", "日本語", "テキスト"]),
        # Upper runs then lower runs, contractions attached in any case.
        ("HTTPServer isn't DON'T", ["HTTPServer", " isn't", " DON'T"]),
        ("camelCase XMLHttp", ["camel", "Case", " XMLHttp"]),
        # Digits in runs of at most three; punctuation keeps one leading space.
        ("x 12345 ,,", ["x", " ", "123", "45", " ,,"]),
        ("a  \n\n b", ["a", "  \n\n", " b"]),
    ],
)
def test_pre_tokenization_follows_kimis_pattern(
    kimi: tuple[Path, dict[bytes, int], Any], text: str, pieces: list[str]
) -> None:
    """Hand-written splits of Kimi's pattern, checked on the loaded tokenizer's own
    pre-tokenizer (whose byte-level step shows each byte as GPT-2's printable character)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_level = bytes_to_unicode()
    _, _, tokenizer = kimi
    found = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    expected = ["".join(byte_level[byte] for byte in piece.encode("utf-8")) for piece in pieces]
    assert [piece for piece, _ in found] == expected


def test_no_special_id_is_made_past_the_models_embedding(tmp_path: Path) -> None:
    """Kimi-K2's embedding has 163840 rows = ranks + 256: the Kimi code's last two
    reserved ids have no row, so their text stays text instead of an id the model cannot
    take; a named token past the embedding is refused."""
    ranks = write_tiny_kimi_tokenizer(tmp_path)
    base = len(ranks)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": base + 256}))
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer) == base + 256
    assert tokenizer.encode(f"<|reserved_token_{base + 253}|>") == [base + 253]
    past = f"<|reserved_token_{base + 257}|>"
    assert tokenizer.encode(past) == reference_encode(ranks, past)
    assert tokenizer.convert_tokens_to_ids("[PAD]") == base + 255
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": base + 200}}))
    with pytest.raises(ValueError, match=r"id \d+ is past the model's embedding"):
        load_tokenizer(tmp_path)


def test_a_special_token_spelled_as_a_bpe_token_is_refused(tmp_path: Path) -> None:
    ranks = {bytes([value]): value for value in range(256)}
    ranks[b"[BOS]"] = 256  # "[BOS]" in the byte-level alphabet is itself
    write_tiny_kimi_tokenizer(tmp_path, ranks=ranks)
    with pytest.raises(ValueError, match=r"special token '\[BOS\]' \(257\) is also a token"):
        load_tokenizer(tmp_path)
