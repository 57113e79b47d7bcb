"""A continued generation's output parser, rebuilt by replaying the forced pieces
(`replay_forced_pieces`), goes on exactly as the unbroken run's: wherever the cut falls —
inside the thinking section, inside a tool call being written, between calls — the pieces
after it parse to the same answer text, reasoning text, tool calls and usage."""

from __future__ import annotations

import pytest

from exo.chat_protocol.output_parsing import OutputParser
from exo.shared.types.chunks import Usage
from exo.shared.types.text_generation import ToolDefinition
from exo.testing.builders import make_params
from exo.worker.engines.parsed_generation import OutputPiece, parse_generation
from exo.worker.engines.torch.batching.request_state import GeneratedPiece
from exo.worker.runner.generation_feed import PieceFeed, replay_forced_pieces

WEATHER = ToolDefinition(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
TEXTS = (
    "<think>", "The user", " wants", " weather", ".</think>", "Let me", " check", ".",
    "<tool_call>", '{"name": "get', '_weather", "arguments"', ': {"city": "Par', 'is"}}',
    "</tool_call>", "<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}',
    "</tool_call>",
)  # fmt: skip


def pieces() -> list[GeneratedPiece]:
    """One token per piece; the last piece finishes with usage (7 prompt tokens)."""
    result = [GeneratedPiece(text, (index,), None, None) for index, text in enumerate(TEXTS)]
    usage = Usage(prompt_tokens=7, completion_tokens=len(TEXTS) + 1)
    result.append(GeneratedPiece("", (len(TEXTS),), "stop", usage))
    return result


def parse(replayed: list[GeneratedPiece], rest: list[GeneratedPiece]) -> list[OutputPiece]:
    """The parsed pieces of `rest` after `replayed` went through the parser unseen."""
    params = make_params().model_copy(update={"tools": (WEATHER,)})
    parser = OutputParser((WEATHER,), "hermes", thinking_open=False, forced_tool_call=False)
    feed = PieceFeed()
    parsed = parse_generation(feed, parser, params)
    replay_forced_pieces(feed, parsed, replayed)
    outputs = []
    for piece in rest:
        feed.piece = piece
        outputs.append(next(parsed))
    return outputs


def summary(outputs: list[OutputPiece]) -> tuple[str, str, list[tuple[str, str]], object]:
    """What the client sees (tool call ids are drawn per call, so left out)."""
    return (
        "".join(output.text for output in outputs),
        "".join(output.reasoning_text for output in outputs),
        [(call.name, call.arguments) for output in outputs for call in output.tool_calls],
        (outputs[-1].finish_reason, outputs[-1].usage),
    )


@pytest.mark.parametrize("cut", range(1, len(TEXTS)))
def test_the_parser_rebuilt_from_the_forced_pieces_goes_on_as_the_unbroken_one(cut: int) -> None:
    whole = pieces()
    unbroken = parse([], whole)
    continued = parse(whole[:cut], whole[cut:])
    assert summary(continued) == summary(unbroken[cut:])
    assert summary(unbroken)[2] == [
        ("get_weather", '{"city":"Paris"}'),
        ("get_weather", '{"city":"Oslo"}'),
    ]
    assert unbroken[-1].usage is not None and unbroken[-1].usage.reasoning_tokens == 4


def test_a_forced_piece_that_finishes_is_refused() -> None:
    whole = pieces()
    with pytest.raises(ValueError, match="finished"):
        parse(whole, [])
