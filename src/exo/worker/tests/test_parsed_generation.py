from __future__ import annotations

from typing import Any

from exo.chat_protocol.output_parsing import OutputParser
from exo.shared.types.chunks import TokenLogprob, Usage
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    TextGenerationTaskParams,
    ToolDefinition,
)
from exo.worker.engines.parsed_generation import OutputPiece, parse_generation
from exo.worker.engines.torch.engine import GeneratedPiece

WEATHER = ToolDefinition(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)


def params(**fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content="hi"),), **fields
    )


def pieces(texts: list[str], finish: str = "stop") -> list[GeneratedPiece]:
    result = [
        GeneratedPiece(
            text,
            (index,),
            None,
            None,
            (TokenLogprob(token=text, token_id=index, logprob=-0.5),),
        )
        for index, text in enumerate(texts)
    ]
    usage = Usage(prompt_tokens=3, completion_tokens=len(texts) + 1)
    result.append(GeneratedPiece("", (len(texts),), finish, usage))  # type: ignore[arg-type]
    return result


def run(
    texts: list[str],
    request: TextGenerationTaskParams,
    thinking_open: bool = False,
    finish: str = "stop",
) -> list[OutputPiece]:
    parser = OutputParser(
        tools=request.offered_tools,
        tool_call_format="hermes",
        thinking_open=thinking_open,
        forced_tool_call=request.forces_tool_call,
    )
    return list(parse_generation(pieces(texts, finish), parser, request))


def test_reasoning_and_answer_are_separated_and_reasoning_tokens_counted() -> None:
    output = run(["<think>", "Let me", " think", "</think>", "Paris", "."], params())
    assert "".join(piece.reasoning_text for piece in output) == "Let me think"
    assert "".join(piece.text for piece in output) == "Paris."
    final = output[-1]
    assert final.finish_reason == "stop"
    assert final.usage is not None
    # "Let me" and " think" produced only reasoning text.
    assert final.usage.reasoning_tokens == 2
    assert final.usage.completion_tokens == 7


def test_every_token_and_logprob_is_accounted_for_while_text_is_held_back() -> None:
    texts = [
        "<tool_call>",
        '{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}',
        "</tool_call>",
    ]
    output = run(texts, params(tools=(WEATHER,)))
    assert [piece.token_ids for piece in output] == [(0,), (1,), (2,), (3,), (4,)]
    assert sum(len(piece.logprobs) for piece in output) == 4
    calls = [call for piece in output for call in piece.tool_calls]
    assert [(call.name, call.arguments) for call in calls] == [("get_weather", '{"city":"Paris"}')]
    assert "".join(piece.text for piece in output) == ""
    assert output[-1].finish_reason == "tool_calls"


def test_matched_stop_string_reaches_the_last_piece() -> None:
    generated = pieces(["Paris"])
    generated[-1].stop_sequence = "."
    parser = OutputParser(
        tools=(), tool_call_format="hermes", thinking_open=False, forced_tool_call=False
    )
    output = list(parse_generation(generated, parser, params(stop=(".",))))
    assert output[-1].stop_sequence == "."
    assert output[0].stop_sequence is None


def test_length_finish_is_kept_even_with_tool_calls() -> None:
    texts = ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']
    output = run(texts, params(tools=(WEATHER,)), finish="length")
    assert output[-1].finish_reason == "length"


def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    texts = [call % "Paris", call % "Rome"]
    both = run(texts, params(tools=(WEATHER,)))
    one = run(texts, params(tools=(WEATHER,), parallel_tool_calls=False))
    assert len([c for piece in both for c in piece.tool_calls]) == 2
    kept = [c for piece in one for c in piece.tool_calls]
    assert len(kept) == 1 and "Paris" in kept[0].arguments


def test_without_tools_tool_markup_stays_text() -> None:
    texts = ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']
    output = run(texts, params())
    assert "".join(piece.text for piece in output) == texts[0]
    assert output[-1].finish_reason == "stop"
