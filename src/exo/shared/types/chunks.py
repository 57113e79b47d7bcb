"""Chunks: the streamed output of one generation, sent point-to-point to the API node
that owns the command (never through the event log).

Stream contract: chunks arrive in order; the first chunk whose `finish_reason` is set is
the last one (an `ErrorChunk` always has one). Reasoning text (a thinking model's
`<think>` section) travels in `TokenChunk.reasoning_text`, answer text in `TokenChunk.text`;
complete parsed tool calls travel as `ToolCallChunk`s (in order), and a generation that
ended by calling tools finishes with `finish_reason="tool_calls"`. The runner always puts
the finish on a final `TokenChunk` (or an `ErrorChunk`); consumers may still accept a finish
on any chunk kind. Before the first token a stream may carry `PrefillProgressChunk`s: the
request was admitted (its prompt's size and prefix-cached part are final) and how far its
prompt is prefilled; they never finish a stream.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from exo.shared.types.common import CommandId, FrozenModel, ModelId
from exo.shared.types.text_generation import ToolCall

__all__ = [
    "Chunk",
    "EmbeddingChunk",
    "ErrorChunk",
    "FinishReason",
    "PrefillProgressChunk",
    "TokenChunk",
    "TokenLogprob",
    "ToolCall",
    "ToolCallChunk",
    "TopLogprob",
    "Usage",
]

FinishReason = Literal["stop", "length", "tool_calls", "error", "cancelled"]

# OpenAI reports impossible tokens' log probability as -9999.0 rather than -inf (which JSON
# cannot carry); we do the same.
MIN_LOGPROB = -9999.0


class Usage(FrozenModel):
    """Token counts of one generation. `reasoning_tokens` are the part of
    `completion_tokens` spent inside the thinking section; `cached_tokens` the part of
    `prompt_tokens` whose KV came from the runner's prefix cache instead of being prefilled
    (OpenAI's `prompt_tokens_details.cached_tokens`).

    Raises:
        pydantic.ValidationError: `cached_tokens` exceeds `prompt_tokens`.
    """

    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    reasoning_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _cached_within_prompt(self) -> Usage:
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(
                f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})"
            )
        return self

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TopLogprob(FrozenModel):
    """One candidate token at a position: its text, UTF-8 bytes and natural-log probability
    (>= MIN_LOGPROB)."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] = ()


class TokenLogprob(FrozenModel):
    """The sampled token at one position, with the `top_logprobs` most likely candidates
    (most likely first; empty unless asked for). Log probabilities are of the model's
    distribution before sampling filters and penalties (as OpenAI and vLLM report them)."""

    token: str
    token_id: int
    logprob: float
    bytes: tuple[int, ...] = ()
    top_logprobs: tuple[TopLogprob, ...] = ()


class TokenChunk(FrozenModel):
    """One decoded piece of text (possibly several tokens when a UTF-8 character or a
    possible stop string spanned them). The last chunk of a stream has `finish_reason`
    and `usage` set; its texts may be empty.

    `logprobs` has one entry per token in `token_ids` when the request asked for logprobs,
    except on a last chunk ended by a stop string: tokens whose text lies wholly in the stop
    string or after it have none (their text is not in the answer, as llama-server leaves
    them out).
    """

    kind: Literal["TokenChunk"] = "TokenChunk"
    command_id: CommandId
    model: ModelId
    text: str
    reasoning_text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None
    """On the last chunk: the request's stop string that ended the generation, if one did
    (Claude reports it; the string itself is never part of the text)."""
    prompt_tokens: int | None = Field(default=None, ge=0)
    """On the first chunk: the prompt's token count, known once the prompt is rendered (the
    final `usage.prompt_tokens` repeats it), for dialects that report usage as a stream
    opens (Claude's `message_start`). None on the other chunks."""
    cached_tokens: int | None = Field(default=None, ge=0)
    """On the first chunk, beside `prompt_tokens`: how many of them came from the prefix
    cache (the final `usage.cached_tokens` repeats it). None when not known."""


def merged_token_chunks(first: TokenChunk, *rest: TokenChunk) -> TokenChunk:
    """`first` then each of `rest` (the same command's next chunks, in order) as one chunk:
    texts, token ids and logprobs in order; the end (finish reason, usage, stop sequence)
    is the last chunk's, the start (prompt and cached token counts) the first chunk's that
    has it. One copy however many chunks merge.

    Raises:
        ValueError: the chunks belong to different commands, or one before the last
            already ended.
    """
    if not rest:
        return first
    chunks = (first, *rest)
    last = rest[-1]
    if (
        any(
            chunk.command_id != first.command_id or chunk.finish_reason is not None
            for chunk in chunks[:-1]
        )
        or last.command_id != first.command_id
    ):
        raise ValueError("only a command's unfinished chunk merges with its next one")
    return last.model_copy(
        update={
            "text": "".join(chunk.text for chunk in chunks),
            "reasoning_text": "".join(chunk.reasoning_text for chunk in chunks),
            "token_ids": tuple(token for chunk in chunks for token in chunk.token_ids),
            "logprobs": tuple(entry for chunk in chunks for entry in chunk.logprobs),
            "prompt_tokens": next(
                (chunk.prompt_tokens for chunk in chunks if chunk.prompt_tokens is not None),
                None,
            ),
            "cached_tokens": next(
                (chunk.cached_tokens for chunk in chunks if chunk.cached_tokens is not None),
                None,
            ),
        }
    )


class ToolCallChunk(FrozenModel):
    """One or more complete tool calls, parsed from the model's output."""

    kind: Literal["ToolCallChunk"] = "ToolCallChunk"
    command_id: CommandId
    model: ModelId
    tool_calls: tuple[ToolCall, ...]
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class ErrorChunk(FrozenModel):
    """The generation failed; always the last chunk of its stream."""

    kind: Literal["ErrorChunk"] = "ErrorChunk"
    command_id: CommandId
    model: ModelId
    error_message: str
    finish_reason: FinishReason = "error"
    status_code: int = 500
    """400 when the request itself was at fault (e.g. a prompt longer than the context);
    503 when the instance serving it became unavailable (`INSTANCE_UNAVAILABLE`)."""
    error_code: str | None = None


class PrefillProgressChunk(FrozenModel):
    """The engine admitted the request to its batch (sent then), and later how far its
    prompt's prefill has come (sent at most every `PREFILL_PROGRESS_SECONDS` of the runner),
    until its first token. Node-local progress for the API node that serves the request (its
    `/metrics`, the dialects that report usage as the stream opens), never cluster state.

    Attributes:
        prompt_tokens: the rendered prompt's tokens.
        cached_tokens: how many of them came from the prefix cache.
        prefilled_tokens: how many have their KV computed or being computed, the cached ones
            included (`prompt_tokens` when the last prompt chunk is in the step that will
            sample the first token).
    """

    kind: Literal["PrefillProgressChunk"] = "PrefillProgressChunk"
    command_id: CommandId
    model: ModelId
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0)
    prefilled_tokens: int = Field(ge=0)
    finish_reason: None = None
    usage: None = None


class EmbeddingChunk(FrozenModel):
    """The whole answer of an `Embedding` task (never streamed): `vectors[i]` is input
    `i`'s L2-normalized embedding (kind "embed"), `scores[i]` document `i`'s relevance
    (kind "rerank"); `prompt_tokens` the tokens read, over all inputs, after truncation."""

    kind: Literal["EmbeddingChunk"] = "EmbeddingChunk"
    command_id: CommandId
    model: ModelId
    vectors: tuple[tuple[float, ...], ...] = ()
    scores: tuple[float, ...] = ()
    prompt_tokens: int = Field(ge=0)
    finish_reason: FinishReason = "stop"
    usage: None = None


INSTANCE_UNAVAILABLE = "instance_unavailable"
"""`ErrorChunk.error_code` of a generation whose instance lost a node or rank: the API
sends it again elsewhere when the client has received nothing yet."""

NODE_SHUTTING_DOWN = "node_shutting_down"
"""`ErrorChunk.error_code` (status 503) of a generation whose API node is stopping: its
stream ends in band instead of being cut, and it is not sent again."""


Chunk = Annotated[
    TokenChunk | ToolCallChunk | ErrorChunk | PrefillProgressChunk | EmbeddingChunk,
    Field(discriminator="kind"),
]
