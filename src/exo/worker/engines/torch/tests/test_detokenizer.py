from collections.abc import Sequence
from typing import Any

from exo.worker.engines.torch.detokenizer import DecodeFunction, StreamingDetokenizer


def stream(detokenizer: StreamingDetokenizer, token_ids: Sequence[int]) -> list[str]:
    pieces = [detokenizer.add_token(token_id) for token_id in token_ids]
    pieces.append(detokenizer.flush())
    return pieces


def byte_level_decode(vocabulary: dict[int, bytes]) -> DecodeFunction:
    def decode(token_ids: Sequence[int]) -> str:
        return b"".join(vocabulary[token_id] for token_id in token_ids).decode(
            "utf-8", errors="replace"
        )

    return decode


def test_multibyte_character_split_across_tokens_is_emitted_whole() -> None:
    emoji = "👋".encode()  # 4 bytes
    vocabulary = {1: b"Hi ", 2: emoji[:1], 3: emoji[1:3], 4: emoji[3:], 5: b"!"}
    pieces = stream(StreamingDetokenizer(byte_level_decode(vocabulary)), [1, 2, 3, 4, 5])
    assert pieces == ["Hi ", "", "", "👋", "!", ""]


def test_incomplete_character_at_end_is_dropped_not_replaced() -> None:
    vocabulary = {1: b"a", 2: "é".encode()[:1]}
    pieces = stream(StreamingDetokenizer(byte_level_decode(vocabulary)), [1, 2])
    assert pieces == ["a", "", ""]


def test_flush_keeps_whole_text_before_an_incomplete_character() -> None:
    emoji = "😀".encode()
    # A byte-level token may hold a space and the first bytes of the next character.
    vocabulary = {1: b"a", 2: b" " + emoji[:2], 3: emoji[2:3]}
    pieces = stream(StreamingDetokenizer(byte_level_decode(vocabulary)), [1, 2, 3])
    assert pieces == ["a", "", "", " "]


def byte_fallback_decode(vocabulary: dict[int, bytes]) -> DecodeFunction:
    """Like SentencePiece's byte fallback: bytes that do not form a character become one
    U+FFFD each."""

    def decode(token_ids: Sequence[int]) -> str:
        data = b"".join(vocabulary[token_id] for token_id in token_ids)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            whole = data[: error.start].decode("utf-8")
            return whole + "\ufffd" * (len(data) - error.start)

    return decode


def test_byte_fallback_replacements_are_all_dropped_at_the_end() -> None:
    character = "語".encode()  # 3 bytes, one token each
    vocabulary = {1: b"x", 2: character[:1], 3: character[1:2], 4: character[2:]}
    complete = stream(StreamingDetokenizer(byte_fallback_decode(vocabulary)), [1, 2, 3, 4])
    assert "".join(complete) == "x語"
    cut = stream(StreamingDetokenizer(byte_fallback_decode(vocabulary)), [1, 2, 3])
    assert cut == ["x", "", "", ""]


def sentencepiece_like_decode(vocabulary: dict[int, str]) -> DecodeFunction:
    """Like SentencePiece: '▁' is a space and the sequence's leading space is dropped."""

    def decode(token_ids: Sequence[int]) -> str:
        text = "".join(vocabulary[token_id] for token_id in token_ids).replace("▁", " ")
        return text.removeprefix(" ")

    return decode


def test_spaces_between_words_survive_one_token_at_a_time() -> None:
    vocabulary = {1: "▁Hello", 2: "▁world", 3: ",", 4: "▁again"}
    pieces = stream(StreamingDetokenizer(sentencepiece_like_decode(vocabulary)), [1, 2, 3, 4])
    assert pieces == ["Hello", " world", ",", " again", ""]


def test_prompt_context_gives_first_token_its_space() -> None:
    vocabulary = {1: "▁Question", 2: ":", 3: "▁Answer"}
    detokenizer = StreamingDetokenizer(sentencepiece_like_decode(vocabulary), [1, 2])
    assert stream(detokenizer, [3]) == [" Answer", ""]


def test_long_stream_matches_full_decode() -> None:
    vocabulary = {index: f"▁w{index}" for index in range(50)}
    decode = sentencepiece_like_decode(vocabulary)
    token_ids = [index % 50 for index in range(300)]
    pieces = stream(StreamingDetokenizer(decode), token_ids)
    assert "".join(pieces) == decode(token_ids)


def test_real_tokenizer_emoji_and_accents(real_tokenizer: Any) -> None:
    text = "Bonjour 👋 la France 🇫🇷 — café, naïve, 日本語."
    token_ids = real_tokenizer.encode(text, add_special_tokens=False)

    def decode(ids: Sequence[int]) -> str:
        return str(real_tokenizer.decode(list(ids), skip_special_tokens=True))

    pieces = stream(StreamingDetokenizer(decode), token_ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert sum(1 for piece in pieces if piece) > 10
