"""Legacy Completions output: one generation's chunks as `text_completion` SSE chunks or one
`Completion` (see `request` for the request side).

Failure after the HTTP status has been sent is reported in-band as on Chat Completions
(`exo.api.wire.openai_sse`). The chunks are read through `generation_events`, up to the
first chunk whose `finish_reason` is set. The caller owns the chunk iterator.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Iterator, Sequence
from functools import partial

from exo.api.openai_chat.response import completion_usage
from exo.api.openai_completions.wire_types import (
    Completion,
    CompletionChoice,
    CompletionFinishReason,
    CompletionLogprobs,
)
from exo.api.wire import stream
from exo.api.wire.logprobs import logprob_token
from exo.api.wire.openai_sse import OpenAIChunkStream
from exo.api.wire.stream import CompletedReason
from exo.shared.types.chunks import Chunk, TokenLogprob
from exo.shared.types.text_generation import TextGenerationTaskParams


def completion_finish_reason(reason: CompletedReason) -> CompletionFinishReason:
    """Map an internal finish reason onto the legacy API's ("tool_calls" cannot happen: a
    raw prompt has no tools)."""
    return "stop" if reason == "tool_calls" else reason


# The legacy API's spelling of a token that is not whole UTF-8 characters.
BYTES_TOKEN_PREFIX = "bytes:"


def utf8_offset_decoder() -> codecs.IncrementalDecoder:
    """What `legacy_logprobs` counts characters with: fed every generated token's bytes in
    order, so a character split over tokens (of one chunk or several) is counted once, by
    the token that completes it."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def legacy_logprobs(
    entries: Sequence[TokenLogprob],
    text_offset: int,
    text_length: int | None = None,
    decoder: codecs.IncrementalDecoder | None = None,
) -> CompletionLogprobs:
    """Token logprobs in the legacy shape: parallel lists, one entry per token.

    A token's string is its text, or for a token that is not whole UTF-8 characters (a
    byte-level BPE token inside a character, "\ufffd" alone) its bytes as OpenAI writes
    them, `"bytes:\\xe2\\x9c"` (`logprob_token`). `top_logprobs[i]` maps the string of
    each reported alternative to its log probability, plus the sampled token (OpenAI: "up
    to logprobs+1 elements"); alternatives with the same string keep the likelier one (a
    dict keyed by it). `text_offset[i]` is where token i starts in the choice's text:
    `text_offset` plus the characters the tokens before it completed (counted by
    `decoder`, which has seen the earlier chunks' tokens; a token inside a character starts
    where the character does), never past the `text_length` characters these tokens added
    to the text (a stop string's tokens add none).
    """
    decoder = utf8_offset_decoder() if decoder is None else decoder
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = text_offset
    end = text_offset + text_length if text_length is not None else None
    for entry in entries:
        token = logprob_token(entry.token, entry.bytes, BYTES_TOKEN_PREFIX)
        tokens.append(token)
        token_logprobs.append(entry.logprob)
        alternatives: dict[str, float] = {}
        for candidate in entry.top_logprobs:
            alternatives.setdefault(
                logprob_token(candidate.token, candidate.bytes, BYTES_TOKEN_PREFIX),
                candidate.logprob,
            )
        alternatives.setdefault(token, entry.logprob)
        top_logprobs.append(alternatives)
        offsets.append(offset if end is None else min(offset, end))
        offset += len(decoder.decode(bytes(entry.bytes))) if entry.bytes else len(entry.token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
        text_offset=offsets,
    )  # fmt: skip


# The legacy API's usage reports no details of the completion.
_usage = partial(completion_usage, reasoning_tokens=False)


async def stream_completion(
    chunks: AsyncIterator[Chunk],
    *,
    completion_id: str,
    model: str,
    created: int,
    include_usage: bool,
    params: TextGenerationTaskParams,
    echo: str = "",
) -> AsyncIterator[str]:
    """Render one generation as legacy Completions SSE events.

    Yields, each as `data: <json>\\n\\n`: with `echo`, a chunk whose text is the prompt;
    one chunk per `TokenChunk` with text or logprobs (`choices[0].text` the new piece,
    `logprobs` its tokens' when asked for); a chunk with empty text and the finish reason;
    with `include_usage`, a chunk with `choices: []` and the usage; finally `data: [DONE]`.
    On failure the finish and usage chunks are replaced by one error event in OpenAI's
    error shape, still followed by `[DONE]`.

    Args:
        chunks: The generation's internal chunks, read up to the first with a finish.
        completion_id: Every chunk's `id` (`cmpl-…`).
        model: The model name to report.
        created: Unix time in seconds, the same in every chunk.
        include_usage: The request's `stream_options.include_usage`.
        params: The request; logprobs are reported only when it asked for them.
        echo: The prompt to send back before the completion (the request's `echo`), or "".
    """
    events: OpenAIChunkStream[CompletionChoice] = OpenAIChunkStream(
        Completion, _usage, completion_id, created, model, include_usage
    )
    text_offset = len(echo)
    decoder = utf8_offset_decoder()

    def render(piece: stream.Text | stream.ToolCalls) -> Iterator[str]:
        nonlocal text_offset
        if isinstance(piece, stream.ToolCalls):  # cannot happen for a raw prompt
            return
        text = piece.text + piece.reasoning
        logprobs = (
            legacy_logprobs(piece.logprobs, text_offset, len(text), decoder)
            if params.logprobs and piece.logprobs
            else None
        )
        if text or logprobs is not None:
            yield events.event([CompletionChoice(text=text, logprobs=logprobs)])
        text_offset += len(text)

    def finish_choice(end: stream.Finished) -> CompletionChoice:
        reason = completion_finish_reason(end.completed_reason)
        return CompletionChoice(text="", finish_reason=reason)

    opening = [events.event([CompletionChoice(text=echo)])] if echo else []
    async for line in events.events(chunks, "prompt", opening, render, finish_choice):
        yield line


async def collect_completion(
    chunks: AsyncIterator[Chunk],
    *,
    completion_id: str,
    model: str,
    created: int,
    params: TextGenerationTaskParams,
    echo: str = "",
) -> Completion:
    """Gather one generation into a non-streaming legacy `Completion`: `text` is `echo`
    followed by everything generated, `logprobs` (when asked for) has one entry per
    generated token, `usage` counts prompt and generated tokens.

    Raises:
        InvalidRequestError: the engine refused the request (an ErrorChunk with status 400).
        GenerationError: an `ErrorChunk` arrived, the generation was cancelled, or the
            stream ended without a finish.
    """
    generation = await stream.collect_generation(chunks, conversation_param="prompt")
    texts: list[str] = [echo]
    logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    text_offset = len(echo)
    decoder = utf8_offset_decoder()
    for piece in generation.texts:
        text = piece.text + piece.reasoning
        texts.append(text)
        if piece.logprobs:  # offsets per chunk: its tokens' texts are within its text
            part = legacy_logprobs(piece.logprobs, text_offset, len(text), decoder)
            logprobs.tokens.extend(part.tokens)
            logprobs.token_logprobs.extend(part.token_logprobs)
            logprobs.top_logprobs.extend(part.top_logprobs)
            logprobs.text_offset.extend(part.text_offset)
        text_offset += len(text)
    choice = CompletionChoice(
        text="".join(texts),
        logprobs=logprobs if params.logprobs else None,
        finish_reason=completion_finish_reason(generation.finished.completed_reason),
    )
    return Completion(
        id=completion_id, created=created, model=model, choices=[choice],
        usage=_usage(generation.finished.final_usage),
    )  # fmt: skip
