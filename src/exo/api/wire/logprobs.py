"""Logprob entries as the OpenAI-shaped dialects write them (Chat Completions, Responses,
Ollama): one entry per sampled token with its top alternatives."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from exo.shared.types.chunks import TokenLogprob

EntryT = TypeVar("EntryT")
TopT = TypeVar("TopT")


def logprob_token(token: str, token_bytes: Sequence[int], prefix: str = "") -> str:
    """A logprobs entry's token string as OpenAI writes it: the token's text, unless its
    bytes are not whole UTF-8 characters (a byte-level BPE token inside a character,
    whose text alone is only "\ufffd"): then `prefix` and its bytes escaped as `\\xNN`,
    printable ASCII as itself (Chat Completions and Responses: `"\\xf0\\x9f"`, next to
    the exact `bytes`; legacy Completions, `prefix="bytes:"`: `"bytes:\\xf0\\x9f"`).

    Args:
        token: the token decoded alone.
        token_bytes: its exact output bytes (empty when unknown: `token` is kept).
        prefix: written before the escaped bytes.
    """
    if not token_bytes:
        return token
    raw = bytes(token_bytes)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return prefix + "".join(
            chr(byte) if 0x20 <= byte < 0x7F and byte != 0x5C else f"\\x{byte:02x}" for byte in raw
        )
    return token


def _keep_token(token: str, token_bytes: Sequence[int]) -> str:
    return token


def logprob_entries(
    entries: Sequence[TokenLogprob],
    entry: Callable[..., EntryT],
    top_entry: Callable[..., TopT],
    escape_partial_characters: bool = True,
) -> list[EntryT]:
    """`entry(token=, logprob=, bytes=, top_logprobs=[top_entry(token=, logprob=,
    bytes=), ...])` for each sampled token, in order.

    Args:
        entries: The tokens' logprobs as the engine reported them.
        entry: The dialect's entry model.
        top_entry: The dialect's model of one alternative.
        escape_partial_characters: Write a token that is not whole UTF-8 characters as
            `logprob_token` does (OpenAI); False: its text as decoded (Ollama).
    """
    token_text = logprob_token if escape_partial_characters else _keep_token
    return [
        entry(
            token=token_text(sampled.token, sampled.bytes),
            logprob=sampled.logprob,
            bytes=list(sampled.bytes),
            top_logprobs=[
                top_entry(
                    token=token_text(top.token, top.bytes),
                    logprob=top.logprob,
                    bytes=list(top.bytes),
                )
                for top in sampled.top_logprobs
            ],
        )
        for sampled in entries
    ]
