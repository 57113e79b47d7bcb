"""A generation as the runner tracks it: the output parser fed one engine piece at a time
(`PieceFeed`, built for a request by `parsed_output`), whether its first chunk left, and its
prompt's prefill progress until then (`Generation`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from exo.chat_protocol.output_parsing import OutputParser
from exo.chat_protocol.prompt import RenderedPrompt
from exo.shared.types.chunks import PrefillProgressChunk
from exo.shared.types.tasks import (
    TextGeneration,
)
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.parsed_generation import OutputPiece, parse_generation
from exo.worker.engines.torch.batching.request_state import GeneratedPiece

# A request's prefill progress is reported when the engine admits it, then at most this
# often until its first token (`PrefillProgressChunk`).
PREFILL_PROGRESS_SECONDS = 1.0


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


def parsed_output(
    params: TextGenerationTaskParams, prompt: RenderedPrompt
) -> tuple[PieceFeed, Iterator[OutputPiece]]:
    """The feed a request's engine pieces go into, and the parsed pieces that come out
    (thinking, tool calls, the finish) for the prompt as rendered.

    A constrained request's output (a forced tool call, a response format) is the JSON
    document alone: no thinking section. A raw prompt's output is returned as generated.
    """
    constrained = params.forces_tool_call or params.response_format != "text"
    parser = OutputParser(
        tools=params.offered_tools,
        tool_call_format=prompt.tool_call_format,
        thinking_open=prompt.thinking_open and not constrained,
        forced_tool_call=params.forces_tool_call,
        parse_reasoning=not constrained and not params.is_raw,
    )
    feed = PieceFeed()
    return feed, parse_generation(feed, parser, params)


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

    def progress_chunk(self, now: float) -> PrefillProgressChunk | None:
        """The prefill progress to report now (`now`: monotonic seconds), for a generation
        still without its first token: once the engine admitted it, then when its prefill
        advanced and `PREFILL_PROGRESS_SECONDS` passed since the last report; else None."""
        if self.first_sent:
            return None
        progress = self.prefill_progress()
        if progress is None:
            return None
        prefilled, prompt = progress
        last = self.progress_sent
        if last is not None and (prefilled == last[0] or now - last[1] < PREFILL_PROGRESS_SECONDS):
            return None
        self.progress_sent = (prefilled, now)
        return PrefillProgressChunk(
            command_id=self.task.command_id,
            model=self.task.params.model,
            prompt_tokens=prompt,
            cached_tokens=min(self.cached_tokens() or 0, prompt),
            prefilled_tokens=prefilled,
        )
