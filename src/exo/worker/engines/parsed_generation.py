"""From generated text pieces to what the API streams: answer text, reasoning text and
complete tool calls, with the finish reason and usage the dialects report.

The engine yields raw text pieces (`GeneratedPiece`); an `OutputParser` separates a thinking
section and tool-call markup from the answer. This module joins the two: one `OutputPiece`
per generated piece, so token ids and logprobs stay in order even while the parser holds
text back (a tool call being written, a possible marker at the end of a piece).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from exo.chat_protocol.output_parsing import OutputParser, ParsedOutput
from exo.shared.types.chunks import FinishReason, TokenLogprob, Usage
from exo.shared.types.text_generation import TextGenerationTaskParams, ToolCall
from exo.worker.engines.torch.engine import GeneratedPiece


@dataclass(slots=True)
class OutputPiece:
    """One piece of a generation as the API sees it.

    `text` is answer text, `reasoning_text` thinking text, `tool_calls` complete calls
    parsed from the output (all may be empty). `token_ids`/`logprobs` are the generated
    tokens this piece accounts for. The last piece has `finish_reason` and `usage`.
    """

    text: str = ""
    reasoning_text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None


def parse_generation(
    pieces: Iterable[GeneratedPiece], parser: OutputParser, params: TextGenerationTaskParams
) -> Iterator[OutputPiece]:
    """Run the engine's pieces through `parser`.

    Reasoning tokens are counted per piece: a piece that produced thinking text and no
    answer text counts all its tokens as reasoning (a piece is usually one token, so the
    boundary error is at most a token or two).

    A generation that produced tool calls and stopped by itself (EOS, end of a forced call)
    finishes with "tool_calls", as OpenAI reports it; one that ran out of tokens keeps
    "length", a forced call it was writing returned cut short (`OutputParser.finish`).
    With `parallel_tool_calls=False` only the first call is kept (OpenAI promises at most
    one call then).

    Args:
        pieces: the engine's generator for the request (closing this iterator does not
            close it; the caller owns it).
        parser: a fresh parser for this request.
        params: the request (for `parallel_tool_calls`).
    """
    reasoning_tokens = 0
    calls_so_far = 0
    for piece in pieces:
        parsed = parser.feed(piece.text)
        final = piece.finish_reason is not None
        if final:
            parsed = _merge(parsed, parser.finish(out_of_tokens=piece.finish_reason == "length"))
        if parsed.reasoning_text and not parsed.text:
            reasoning_tokens += len(piece.token_ids)
        calls = list(parsed.tool_calls)
        if not params.parallel_tool_calls:
            calls = calls[: max(0, 1 - calls_so_far)]
        calls_so_far += len(calls)
        output = OutputPiece(
            text=parsed.text,
            reasoning_text=parsed.reasoning_text,
            tool_calls=calls,
            token_ids=piece.token_ids,
            logprobs=piece.logprobs,
        )
        if final:
            finish_reason = piece.finish_reason
            if calls_so_far and finish_reason == "stop":
                finish_reason = "tool_calls"
            output.finish_reason = finish_reason
            output.stop_sequence = piece.stop_sequence
            if piece.usage is not None:
                output.usage = piece.usage.model_copy(
                    update={
                        "reasoning_tokens": min(reasoning_tokens, piece.usage.completion_tokens)
                    }
                )
            yield output
            return
        yield output


def _merge(first: ParsedOutput, second: ParsedOutput) -> ParsedOutput:
    return ParsedOutput(
        text=first.text + second.text,
        reasoning_text=first.reasoning_text + second.reasoning_text,
        tool_calls=[*first.tool_calls, *second.tool_calls],
    )
