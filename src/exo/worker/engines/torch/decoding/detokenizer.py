"""Streaming detokenization: one text piece per generated token where possible.

Decoding tokens one at a time is wrong in two ways: a multi-byte UTF-8 character split over
byte-level tokens decodes to U+FFFD halves, and SentencePiece/BPE decoders drop or add spaces
at the start of a sequence. The prefix-offset technique (as in Hugging Face TGI and vLLM)
fixes both: decode a short window of already-emitted tokens with and without the new ones,
and emit the difference only once it no longer ends in an incomplete character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"
# Prompt tokens kept as left context so the first generated token gets its leading space
# right (TGI and vLLM use the same small window).
CONTEXT_TOKENS = 5
# The most tokens one character can take: a byte-fallback token per byte, 4 bytes in UTF-8.
MAX_CHARACTER_TOKENS = 4

DecodeFunction = Callable[[Sequence[int]], str]


def without_incomplete_end(text: str) -> str:
    """`text` without the replacement characters a decoder wrote at its end for the bytes of
    a character the generation did not finish (byte-level BPE writes one, SentencePiece byte
    fallback one per byte). Used where the generation ends: such bytes are dropped, never
    shown as U+FFFD. A U+FFFD the model itself wrote last cannot be told apart and goes too.
    """
    return text.rstrip(REPLACEMENT_CHARACTER)


def _context_window(decode: DecodeFunction, context_token_ids: Sequence[int]) -> list[int]:
    """The last `CONTEXT_TOKENS` of the prompt, reaching back (at most
    `MAX_CHARACTER_TOKENS - 1` tokens more) to a character's first token where the cut falls
    inside a character: a window that starts with a character's later bytes decodes to
    U+FFFD there, and a byte-fallback decoder (SentencePiece's, Gemma's) turns the whole run
    of byte tokens after it, the generated ones included, into U+FFFD too."""
    tail = list(context_token_ids[-(CONTEXT_TOKENS + MAX_CHARACTER_TOKENS - 1) :])
    start = max(0, len(tail) - CONTEXT_TOKENS)
    while start > 0 and decode(tail[start:]).startswith(REPLACEMENT_CHARACTER):
        start -= 1
    return tail[start:]


class StreamingDetokenizer:
    """Turns generated token ids into text pieces, UTF-8 safe.

    Args:
        decode: decodes a list of token ids to text (special tokens skipped).
        context_token_ids: the prompt's token ids; the last few give the decoder the left
            context it needs for spacing. They are never emitted.
    """

    __slots__ = ("_decode", "_prefix_offset", "_read_offset", "_token_ids")

    def __init__(self, decode: DecodeFunction, context_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._token_ids: list[int] = _context_window(decode, context_token_ids)
        # [prefix_offset, read_offset) was decoded already; tokens from read_offset are new.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)

    def add_token(self, token_id: int) -> str:
        """Add one generated token.

        Returns:
            The new text it completes; "" while it ends in an incomplete character.
        """
        self._token_ids.append(token_id)
        window = self._token_ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHARACTER):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            # Drop the window's leading tokens so decoding stays O(window), not O(sequence).
            if self._prefix_offset > 0:
                del self._token_ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Text of tokens still held back; call once when generation ends (whatever ended
        it: length, EOS, the context's end).

        Held-back tokens end in an incomplete character (that is why they were held): its
        bytes are dropped (`without_incomplete_end`), so the text never ends with U+FFFD.
        """
        window = self._token_ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        new_text = self._decode(window)
        self._prefix_offset = self._read_offset = len(self._token_ids)
        if len(new_text) > len(prefix_text):
            return without_incomplete_end(new_text[len(prefix_text) :])
        return ""
