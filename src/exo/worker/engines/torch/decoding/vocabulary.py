"""Per-token texts and raw bytes of a tokenizer, for logprobs and constrained decoding.

Decoding a token alone does not give its bytes: a byte-level BPE token may be part of a
UTF-8 character, and SentencePiece writes spaces as `▁` and bytes as `<0xNN>`. This module
recovers each token's exact output bytes from the tokenizer's own alphabet.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any


def _byte_level_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-character map (Radford et al. 2019, the byte-level
    BPE of `tokenizers`' ByteLevel): printable Latin-1 bytes stand for themselves, the other
    bytes for the characters from U+0100 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            mapping[chr(0x100 + shifted)] = byte
            shifted += 1
    return mapping


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kind(tokenizer: Any) -> str:
    """How a fast tokenizer's pieces map to bytes: "byte_level" (GPT-2 style),
    "sentencepiece" (`▁` for spaces, `<0xNN>` byte tokens) or "other"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return "other"
    try:
        description = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return "other"
    kinds = {str(description.get("type"))}
    kinds.update(str(member.get("type")) for member in description.get("decoders") or ())
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"} or "▁" in json.dumps(description, ensure_ascii=False):
        return "sentencepiece"
    return "other"


class TokenVocabulary:
    """Per-token texts and raw bytes of a tokenizer, computed once per engine.

    `token_bytes[id]` is the token's exact bytes in the output: from the byte-level BPE
    alphabet (GPT-2 style tokenizers) or SentencePiece pieces (`▁` as a space, `<0xNN>` byte
    tokens), else the UTF-8 of its text decoded alone. Ids past the tokenizer (a padded
    output layer) have empty bytes and text.

    Args:
        tokenizer: a transformers tokenizer.
        size: number of token ids (the model's logits length; at least the tokenizer's).
    """

    __slots__ = (
        "_index",
        "_pieces",
        "_texts",
        "_tokenizer",
        "size",
        "special_ids",
        "token_bytes",
    )

    def __init__(self, tokenizer: Any, size: int) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._pieces: list[str | bytes | None] | None = None
        self._index: ConstraintIndex | None = None
        self.size = size
        known = min(size, len(tokenizer))
        pieces: list[str | None] = list(tokenizer.convert_ids_to_tokens(list(range(known))))
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.special_ids = frozenset(
            {int(token_id) for token_id in getattr(tokenizer, "all_special_ids", ())}
            | {token_id for token_id, token in added.items() if getattr(token, "special", False)}
        )
        kind = _decoder_kind(tokenizer)
        byte_level = _byte_level_decoder() if kind == "byte_level" else None
        sentencepiece = kind == "sentencepiece"
        token_bytes: list[bytes] = []
        for token_id, piece in enumerate(pieces):
            raw: bytes | None = None
            if piece is not None and token_id not in added:
                if byte_level is not None and all(char in byte_level for char in piece):
                    raw = bytes(byte_level[char] for char in piece)
                elif sentencepiece:
                    match = _BYTE_FALLBACK.fullmatch(piece)
                    raw = (
                        bytes([int(match.group(1), 16)])
                        if match
                        else piece.replace("▁", " ").encode("utf-8")
                    )
            if raw is None:
                raw = self.text(token_id).encode("utf-8")
            token_bytes.append(raw)
        token_bytes.extend(b"" for _ in range(size - known))
        self.token_bytes: tuple[bytes, ...] = tuple(token_bytes)

    def text(self, token_id: int) -> str:
        """The token decoded alone, special tokens kept as their text (logprobs' `token`)."""
        text = self._texts.get(token_id)
        if text is None:
            if not 0 <= token_id < len(self._tokenizer):
                return ""
            text = str(
                self._tokenizer.decode(
                    [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            )
            self._texts[token_id] = text
        return text

    def constraint_pieces(self) -> list[str | bytes | None]:
        """Per id, what a constraint feeds: the text when the bytes are whole UTF-8
        characters, the bytes when they are not, None for a token never allowed (special,
        empty)."""
        if self._pieces is None:
            pieces: list[str | bytes | None] = []
            for token_id, raw in enumerate(self.token_bytes):
                if token_id in self.special_ids or not raw:
                    pieces.append(None)
                    continue
                try:
                    pieces.append(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    pieces.append(raw)
            self._pieces = pieces
        return self._pieces

    def constraint_index(self) -> ConstraintIndex:
        """The pieces sorted for `TokenConstraint.allowed_tokens` (built on first use)."""
        if self._index is None:
            self._index = ConstraintIndex(self.constraint_pieces())
        return self._index


class ConstraintIndex:
    """The constraint pieces arranged for computing a whole allowed set quickly: whole-text
    pieces sorted by text (tokens sharing a rejected prefix are skipped together) and the
    ids of the partial-UTF-8 pieces (checked one by one)."""

    __slots__ = ("byte_piece_ids", "ids", "texts")

    def __init__(self, pieces: Sequence[str | bytes | None]) -> None:
        entries = sorted(
            (piece, token_id) for token_id, piece in enumerate(pieces) if isinstance(piece, str)
        )
        self.texts: list[str] = [text for text, _token_id in entries]
        self.ids: list[int] = [token_id for _text, token_id in entries]
        self.byte_piece_ids: list[int] = [
            token_id for token_id, piece in enumerate(pieces) if isinstance(piece, bytes)
        ]


def split_incomplete_utf8(data: bytes) -> tuple[bytes, bytes]:
    """(whole part, trailing bytes of a character still incomplete)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: a lead or ASCII byte
            if byte & 0xE0 == 0xC0:
                needed = 2
            elif byte & 0xF0 == 0xE0:
                needed = 3
            else:
                needed = 4 if byte & 0xF8 == 0xF0 else 1
            if needed > back:
                return data[:-back], data[-back:]
            break
    return data, b""
