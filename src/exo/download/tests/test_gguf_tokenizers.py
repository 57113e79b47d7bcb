"""GGUF tokenizers of DeepSeek-V3, Kimi-K2 and GLM-4.5+ split as their patterns say
(`exo.download.gguf_tokenizers`), not as GPT-2's fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import regex

from exo.download.gguf_tokenizers import PRE_TOKENIZER_SPLITS, load_gguf_tokenizer

# Digits past three, CJK beside punctuation, kana, contractions, a camel-case word, accents,
# newlines and runs of spaces.
TEXT = (
    "I'm fine, they've 12345 apples—你好世界 and カタカナ! getUserName ÉCOLE's 3.14159\n\n  end;)"
)


def _write_vocabulary_gguf(path: Path, pre: str) -> None:
    """A GGUF with a byte-level BPE vocabulary (the 256 byte symbols, one merge) and no
    tensors: all a tokenizer needs, under the `deepseek2` architecture."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "ab", "<bos>", "<eos>"]
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _regex_pieces(text: str, splits: tuple[str, ...]) -> list[str]:
    """`text` split by each pattern in turn with the `regex` package: every match and every
    stretch between matches is a piece ("isolated"). Version 1 syntax reads Kimi's `&&`."""
    pieces = [text]
    for pattern in splits:
        compiled = regex.compile(pattern, flags=regex.V1 if "&&" in pattern else regex.V0)
        split: list[str] = []
        for piece in pieces:
            start = 0
            for match in compiled.finditer(piece):
                if match.start() > start:
                    split.append(piece[start : match.start()])
                if match.end() > match.start():
                    split.append(match.group())
                start = match.end()
            if start < len(piece):
                split.append(piece[start:])
        pieces = split
    return pieces


def _tokenizer_pieces(tokenizer: Any, text: str) -> list[str]:
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    return [text[start:end] for _, (start, end) in pre_tokenizer.pre_tokenize_str(text)]


# What each pattern makes of a few parts of TEXT (GPT-2's split keeps "12345" whole).
EXPECTED_PARTS = {
    "deepseek-v3": ["123", "45", "—", "你好世界", "カタカナ", " getUserName", "'s", "141", "59"],
    "kimi-k2": ["I'm", " they've", "123", "45", " get", "User", "Name", " ÉCOLE's", "59"],
    "glm4": ["I", "'m", "123", "45", "—你好世界", " カタカナ", " getUserName", "'s", "59"],
}


@pytest.mark.parametrize("pre", ["deepseek-v3", "kimi-k2", "glm4"])
def test_gguf_tokenizer_splits_as_its_pre_tokenizer_pattern(tmp_path: Path, pre: str) -> None:
    path = tmp_path / f"{pre}.gguf"
    _write_vocabulary_gguf(path, pre)
    tokenizer = load_gguf_tokenizer(path, pre, read_config=False)
    pieces = _tokenizer_pieces(tokenizer, TEXT)
    assert pieces == _regex_pieces(TEXT, PRE_TOKENIZER_SPLITS[pre])
    assert set(EXPECTED_PARTS[pre]) <= set(pieces)
    # The byte-level mapping still follows: the text round-trips through the ids.
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT


def test_gguf_tokenizer_keeps_transformers_split_for_other_names(tmp_path: Path) -> None:
    """A `pre` transformers knows ("qwen2": single digits) keeps transformers' split."""
    path = tmp_path / "qwen2.gguf"
    _write_vocabulary_gguf(path, "qwen2")
    tokenizer = load_gguf_tokenizer(path, "qwen2", read_config=False)
    assert {"1", "2", "3", "4", "5"} <= set(_tokenizer_pieces(tokenizer, "12345"))
