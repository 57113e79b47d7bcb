"""The chunks one parsed piece of a generation becomes on the wire: its text (with its
tokens and logprobs), then its tool calls; the finish always rides on a final `TokenChunk`,
and the prompt's size (first piece only) on a `TokenChunk` sent first."""

from __future__ import annotations

from dataclasses import dataclass

from exo.shared.types.chunks import Chunk, TokenChunk, ToolCallChunk
from exo.shared.types.tasks import TextGeneration
from exo.worker.engines.parsed_generation import OutputPiece


@dataclass(frozen=True, slots=True)
class PieceChunks:
    """Attributes:
    text: the piece's text chunk (None when it has no text, no finish of its own and no
        prompt size to carry); the runner groups these per stream.
    after: what follows it at once: the tool calls, then the finish after them.
    """

    text: TokenChunk | None
    after: tuple[Chunk, ...]


def piece_chunks(
    task: TextGeneration,
    piece: OutputPiece,
    prompt_tokens: int | None,
    cached_tokens: int | None = None,
) -> PieceChunks:
    """The chunks of `piece` of `task`'s stream (`prompt_tokens` and, when known, the
    prefix-cached part of them, `cached_tokens`: on its first piece)."""
    command_id, model = task.command_id, task.params.model
    has_text = bool(piece.text or piece.reasoning_text or piece.token_ids)
    finishes_here = piece.finish_reason is not None and not piece.tool_calls
    text = None
    if has_text or finishes_here or prompt_tokens is not None:
        text = TokenChunk(
            command_id=command_id,
            model=model,
            text=piece.text,
            reasoning_text=piece.reasoning_text,
            token_ids=piece.token_ids,
            logprobs=piece.logprobs,
            finish_reason=None if piece.tool_calls else piece.finish_reason,
            usage=None if piece.tool_calls else piece.usage,
            stop_sequence=None if piece.tool_calls else piece.stop_sequence,
            prompt_tokens=prompt_tokens,
            cached_tokens=None if prompt_tokens is None else cached_tokens,
        )
    if not piece.tool_calls:
        return PieceChunks(text, ())
    after: list[Chunk] = [
        ToolCallChunk(command_id=command_id, model=model, tool_calls=tuple(piece.tool_calls))
    ]
    if piece.finish_reason is not None:
        after.append(
            TokenChunk(
                command_id=command_id,
                model=model,
                text="",
                finish_reason=piece.finish_reason,
                usage=piece.usage,
            )
        )
    return PieceChunks(text, tuple(after))
