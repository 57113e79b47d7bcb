"""`save_tiny_checkout`'s tokenizer and special ids: what the tests that add, place and ask
such a checkout read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from exo.testing.tiny_models import save_tiny_checkout


@pytest.fixture(scope="module")
def minimax(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # MiniMax-M2's own config keeps bos / eos near id 200,000, far past 64 ids.
    return save_tiny_checkout(tmp_path_factory.mktemp("minimax") / "m", "minimax_m2")


def test_each_word_is_one_id_and_decoded_words_are_spaced(minimax: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(minimax)
    ids = tokenizer("w0 w1, w60 colour")["input_ids"]
    # Words split at whitespace and punctuation; unknown ones (",", "colour") are <unk>.
    assert ids == [3, 4, 0, 63, 0]
    assert tokenizer.decode([3, 4, 63]) == "w0 w1 w60"
    assert tokenizer.decode([3, 2, 4], skip_special_tokens=True) == "w0 w1"


def test_the_special_ids_are_the_vocabularys(minimax: Path) -> None:
    config = json.loads((minimax / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(minimax)
    assert config["vocab_size"] == len(tokenizer) == 64
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<s>", "</s>"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
