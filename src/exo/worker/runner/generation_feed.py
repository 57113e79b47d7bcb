"""A generation as the runner tracks it: the output parser fed one engine piece at a time
(`PieceFeed`) and whether its first chunk left (`Generation`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from exo.shared.types.tasks import (
    TextGeneration,
)
from exo.worker.engines.parsed_generation import OutputPiece
from exo.worker.engines.torch.batching.request_state import GeneratedPiece


class PieceFeed:
    """The pieces of one generation, handed to `parse_generation` one at a time (it reads
    exactly one piece per output piece)."""

    def __init__(self) -> None:
        self.piece: GeneratedPiece | None = None

    def __iter__(self) -> Iterator[GeneratedPiece]:
        return self

    def __next__(self) -> GeneratedPiece:
        piece, self.piece = self.piece, None
        if piece is None:
            raise StopIteration
        return piece


def replay_forced_pieces(
    feed: PieceFeed, parsed: Iterator[OutputPiece], pieces: Iterable[GeneratedPiece]
) -> None:
    """Feed a continued generation's forced pieces (`RequestHandle.forced_pieces`) through
    its output parser and drop what comes out: the run it continues streamed that already.
    The parser (thinking section, tool call being written, reasoning-token count, calls so
    far) then stands where that run's stood after those tokens.

    Raises:
        ValueError: a forced piece finishes the generation.
    """
    for piece in pieces:
        feed.piece = piece
        if next(parsed).finish_reason is not None:
            raise ValueError("a forced piece finished the generation")


@dataclass(eq=False)
class Generation:
    """A task the engine is running: its output parser, whether its first chunk (which
    carries the prompt's size and its prefix-cached part) was sent, and how to read that
    cached part once the engine admitted the request (`RequestHandle.cached_tokens`)."""

    task: TextGeneration
    prompt_tokens: int
    feed: PieceFeed
    parsed: Iterator[OutputPiece]
    first_sent: bool = field(default=False)
    cached_tokens: Callable[[], int | None] = field(default=lambda: None)
    prefill_progress: Callable[[], tuple[int, int] | None] = field(default=lambda: None)
    """`(prefilled, prompt)` tokens once admitted (`RequestHandle.prefill_progress`)."""
    progress_sent: tuple[int, float] | None = field(default=None)
    """The prefilled tokens last reported in a `PrefillProgressChunk`, and when (monotonic
    seconds); None before the first report."""
