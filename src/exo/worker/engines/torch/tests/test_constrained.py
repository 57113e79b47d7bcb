"""The JSON and tool-call recognisers, the token table and the token-level constraint."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from exo.shared.types.text_generation import ToolDefinition
from exo.worker.engines.torch.decoding.constraints import (
    JsonRecognizer,
    TokenConstraint,
    ToolCallRecognizer,
    json_object_constraint,
    parse_forced_tool_call,
    tool_call_constraint,
)
from exo.worker.engines.torch.decoding.json_lexing import MAX_NUMBER_LENGTH
from exo.worker.engines.torch.decoding.sampling import Sampler
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.vocabulary import TokenVocabulary


def feed(text: str, top_level_object: bool = False, max_whitespace_run: int = 2) -> JsonRecognizer:
    """The recogniser after `text`; fails the test at a rejected character."""
    recognizer = JsonRecognizer(top_level_object, max_whitespace_run)
    for position, character in enumerate(text):
        assert recognizer.feed(character), f"rejected {character!r} at {position} of {text!r}"
    return recognizer


def rejects(text: str, top_level_object: bool = False) -> bool:
    recognizer = JsonRecognizer(top_level_object)
    return not all(recognizer.feed(character) for character in text)


COMPLETE_DOCUMENTS = [
    "{}",
    "[]",
    '""',
    "0",
    "-0.5e+3",
    "12.25E-2",
    "true",
    "null",
    '{"a": [1, -0.5e+3, true, false, null, "x"], "b": {"c": []}}',
    '"tab\\tquote\\"slash\\/\\\\ \\u00e9\\uD83D\\uDE00"',
    '"unicode: é ü 漢字 🎉"',
    "[[[]], {}, [{}]]",
    ' {"a" :1 } ',
]
INCOMPLETE_PREFIXES = [
    "{",
    '{"a',
    '{"a"',
    '{"a":',
    '{"a": [1',
    "-",
    "1.",
    "1e",
    "1e+",
    "tru",
    '"\\u00',
]
INVALID = [
    "01",
    "-01",
    "00",
    "1.e3",
    ".5",
    "+1",
    "[1,]",
    '{"a":1,}',
    "[1 2]",
    '{"a" 1}',
    "{1: 2}",
    '"\\x"',
    '"\\u12G4"',
    '"a\tb"',  # raw control character in a string
    '"a\nb"',
    "tRue",
    "nul1",
    "{}}",
    "[]]",
    "{]",
    "[}",
    "{} {}",
    "'a'",
    "[1e]",
]


@pytest.mark.parametrize("text", COMPLETE_DOCUMENTS)
def test_complete_documents_are_accepted_and_complete(text: str) -> None:
    json.loads(text)  # the table itself is valid JSON
    assert feed(text).is_complete


@pytest.mark.parametrize("text", INCOMPLETE_PREFIXES)
def test_prefixes_are_accepted_but_not_complete(text: str) -> None:
    assert not feed(text).is_complete


@pytest.mark.parametrize("text", INVALID)
def test_invalid_continuations_are_rejected(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert rejects(text)


def test_python_extensions_are_rejected() -> None:
    for text in ("NaN", "Infinity", "-Infinity"):  # json.loads accepts these; JSON does not
        assert rejects(text)


def test_top_level_object_rejects_other_values() -> None:
    for text in ("[]", '"a"', "1", "true", "null"):
        assert rejects(text, top_level_object=True)
    assert feed('{"a": [1]}', top_level_object=True).is_complete


def test_whitespace_runs_are_bounded_outside_strings() -> None:
    assert feed('{ \n"a":  1}').is_complete
    assert rejects('{   "a": 1}')
    assert rejects("{}   ")
    assert feed('"     "').is_complete  # inside strings any amount
    assert feed('{\n    "a": 1}', max_whitespace_run=5).is_complete


def test_copy_is_independent() -> None:
    original = feed('{"a": [1')
    branch = original.copy()
    assert branch.feed_text("]}") and branch.is_complete
    assert not original.is_complete and original.depth == 2
    assert original.feed_text(", 2]}") and original.is_complete


def test_number_ends_at_the_next_structural_character() -> None:
    assert feed("[1,2.5,-3e2]").is_complete
    assert feed('{"a":0}').is_complete
    assert feed("[0 ]").is_complete


def test_tool_call_recognizer_accepts_only_offered_names_in_the_fixed_shape() -> None:
    def accepts(text: str) -> ToolCallRecognizer | None:
        recognizer = ToolCallRecognizer(["get_weather", "search", "get"])
        return recognizer if all(recognizer.feed(character) for character in text) else None

    good = accepts('{"name": "get", "arguments": {"city": "Paris", "days": [1, 2]}}')
    assert good is not None and good.is_complete
    assert accepts('{"name": "get_weather", "arguments": {}}') is not None
    assert accepts('{"name": "get_w') is not None
    for text in (
        '{"name": "other", "arguments": {}}',
        '{"name": "gets", "arguments": {}}',
        '{"arguments": {}, "name": "get"}',
        '{"name": "get", "arguments": []}',
        '{"name": "get", "arguments": {}, "x": 1}',
        '{"name":"get"',
    ):
        assert accepts(text) is None, text
    with pytest.raises(ValueError):
        ToolCallRecognizer([])


def test_parse_forced_tool_call() -> None:
    assert parse_forced_tool_call('{"name": "f", "arguments": {"a": 1}}') == ("f", '{"a": 1}')
    with pytest.raises(ValueError):
        parse_forced_tool_call('{"name": "f", "arguments": {')
    with pytest.raises(ValueError):
        parse_forced_tool_call('{"name": "f", "arguments": 3}')


# --- the token table and the token-level constraint (the real tokenizer) ----------------


@pytest.fixture(scope="module")
def vocabulary(real_tokenizer: Any) -> TokenVocabulary:
    return TokenVocabulary(real_tokenizer, len(real_tokenizer) + 3)  # a padded output layer


def test_token_bytes_agree_with_decoding(vocabulary: TokenVocabulary, real_tokenizer: Any) -> None:
    for token_id in range(0, len(real_tokenizer), 7):
        raw = vocabulary.token_bytes[token_id]
        text = real_tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
        if "\ufffd" not in text:
            assert raw.decode("utf-8") == text, token_id
    assert vocabulary.token_bytes[-1] == b"" and vocabulary.text(vocabulary.size - 1) == ""
    # A multi-byte character split over two byte-level tokens: the bytes join up exactly.
    ids = real_tokenizer.encode("漢", add_special_tokens=False)
    assert len(ids) > 1
    assert b"".join(vocabulary.token_bytes[token_id] for token_id in ids) == "漢".encode()
    assert "\ufffd" in vocabulary.text(ids[0])  # decoded alone it is not a character


def test_special_tokens_are_never_allowed(vocabulary: TokenVocabulary, real_tokenizer: Any) -> None:
    eos = frozenset({real_tokenizer.eos_token_id})
    constraint = json_object_constraint(vocabulary, eos)
    for token_id in real_tokenizer.all_special_ids:
        assert not constraint.allowed(token_id)
    assert not constraint.allowed(vocabulary.size - 1)  # past the tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_constraint_follows_a_tokenized_document(
    vocabulary: TokenVocabulary, real_tokenizer: Any
) -> None:
    eos = frozenset({real_tokenizer.eos_token_id})
    document = '{"name": "漢字 🎉", "values": [1, -0.5e+3, true, null], "nested": {"k": "\\u00e9"}}'
    constraint = json_object_constraint(vocabulary, eos)
    for token_id in encode(real_tokenizer, document):
        assert not constraint.is_complete
        assert not constraint.allowed(real_tokenizer.eos_token_id)
        assert constraint.allowed(token_id), real_tokenizer.decode([token_id])
        constraint.advance(token_id)
    assert constraint.is_complete
    assert constraint.allowed(real_tokenizer.eos_token_id)


def test_constraint_rejects_invalid_tokens(
    vocabulary: TokenVocabulary, real_tokenizer: Any
) -> None:
    constraint = json_object_constraint(vocabulary, frozenset({real_tokenizer.eos_token_id}))
    for text in ("[", "hello", "1", " }"):
        (token_id,) = encode(real_tokenizer, text)
        assert not constraint.allowed(token_id), text
    with pytest.raises(ValueError):
        constraint.advance(encode(real_tokenizer, "hello")[0])
    constraint.advance(encode(real_tokenizer, "{")[0])
    (close,) = encode(real_tokenizer, "}")
    assert constraint.allowed(close)


def test_partial_utf8_tokens_only_inside_strings(
    vocabulary: TokenVocabulary, real_tokenizer: Any
) -> None:
    eos = frozenset({real_tokenizer.eos_token_id})
    first_half = encode(real_tokenizer, "漢")[0]
    constraint = json_object_constraint(vocabulary, eos)
    constraint.advance(encode(real_tokenizer, "{")[0])
    assert not constraint.allowed(first_half)  # a key must start with '"'
    constraint.advance(encode(real_tokenizer, '"')[0])
    assert constraint.allowed(first_half)
    constraint.advance(first_half)
    assert not constraint.allowed(encode(real_tokenizer, '"')[0])  # mid-character


def brute_force_allowed(constraint: TokenConstraint, size: int) -> list[int]:
    return [token_id for token_id in range(size) if constraint.allowed(token_id)]


@pytest.mark.parametrize("prefix", ["", "{", '{"a', '{"a": ', '{"a": 1', '{"a": "漢', '{"a": [t'])
def test_allowed_tokens_equals_checking_every_token(
    vocabulary: TokenVocabulary, real_tokenizer: Any, prefix: str
) -> None:
    eos = frozenset({real_tokenizer.eos_token_id})
    constraint = json_object_constraint(vocabulary, eos)
    prefix_ids = encode(real_tokenizer, prefix) if prefix else []
    if prefix == '{"a": "漢':
        prefix_ids = prefix_ids[:-1]  # stop mid-character
    for token_id in prefix_ids:
        constraint.advance(token_id)
    assert sorted(constraint.allowed_tokens()) == brute_force_allowed(constraint, vocabulary.size)


def test_tool_call_allowed_tokens_after_the_name(
    vocabulary: TokenVocabulary, real_tokenizer: Any
) -> None:
    tools = [ToolDefinition(name="get_weather"), ToolDefinition(name="search")]
    constraint = tool_call_constraint(tools, vocabulary, frozenset({real_tokenizer.eos_token_id}))
    for token_id in encode(real_tokenizer, '{"name": "search"'):
        constraint.advance(token_id)
    allowed = constraint.allowed_tokens()
    assert allowed and sorted(allowed) == brute_force_allowed(constraint, vocabulary.size)
    assert all(', "arguments": '.startswith(vocabulary.text(token)) for token in allowed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_logits_give_valid_json(
    vocabulary: TokenVocabulary, real_tokenizer: Any, temperature: float
) -> None:
    """A constrained sampler on random logits (a random model) only writes JSON prefixes;
    logits favouring closing characters make it finish."""
    eos = frozenset({real_tokenizer.eos_token_id})
    generator = torch.Generator().manual_seed(4)
    closers = [encode(real_tokenizer, text)[0] for text in ('"', "}", "]", ":", "1")]
    for _run in range(3):
        constraint = json_object_constraint(vocabulary, eos)
        sampler = Sampler(SamplingParams(temperature=temperature, seed=_run))
        tokens: list[int] = []
        for _step in range(300):
            logits = torch.randn(vocabulary.size, generator=generator) * 3
            logits[closers] += 8.0 if len(tokens) > 20 else 0.0
            token = sampler.sample(logits, constraint)
            constraint.advance(token)
            tokens.append(token)
            if constraint.is_complete:
                break
        assert constraint.is_complete
        assert isinstance(json.loads(real_tokenizer.decode(tokens)), dict)


def sentencepiece_style_tokenizer() -> Any:
    """A tiny Llama-style fast tokenizer: `▁` for spaces, `<0xNN>` byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1}
    vocab.update({f"<0x{byte:02X}>": 2 + byte for byte in range(256)})
    for piece in ("▁", "h", "e", "l", "o", "{", '"', "}"):
        vocab[piece] = len(vocab)
    model = models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_byte_fallback_tokens_have_their_bytes() -> None:
    tokenizer = sentencepiece_style_tokenizer()
    vocabulary = TokenVocabulary(tokenizer, len(tokenizer))
    ids = tokenizer.encode('{"hello": "漢"}', add_special_tokens=False)
    assert "<0xE6>" in tokenizer.convert_ids_to_tokens(ids)  # ':' and 漢 as byte tokens
    joined = b"".join(vocabulary.token_bytes[token_id] for token_id in ids)
    # The decoder strips the one leading space a stream's first token would carry.
    assert joined == b" " + tokenizer.decode(ids).encode()
    constraint = json_object_constraint(vocabulary, frozenset({tokenizer.eos_token_id}))
    for token_id in ids:
        assert constraint.allowed(token_id), tokenizer.convert_ids_to_tokens([token_id])
        constraint.advance(token_id)
    assert constraint.is_complete


def test_numbers_are_bounded_in_length() -> None:
    """A model that keeps writing digits must be stopped by the grammar, not the context."""
    longest = "1" * MAX_NUMBER_LENGTH
    recognizer = JsonRecognizer(top_level_object=True)
    assert recognizer.feed_text('{"a": ' + longest)
    assert not recognizer.copy().feed("1")
    assert recognizer.feed_text(', "b": -0.5e+3}') and recognizer.is_complete
    # The count starts again for every number.
    again = JsonRecognizer(top_level_object=True)
    assert again.feed_text('{"a": [' + ", ".join([longest] * 3) + "]}")
