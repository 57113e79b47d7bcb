"""The stream skeleton every dialect renders (`exo.api.wire.stream`): one event per chunk,
then exactly one `Finished` or `Failed`, and nothing read after the finish."""

from __future__ import annotations

from typing import Any, Literal

import anyio
import pytest

from exo.api.wire import stream
from exo.api.wire.errors import GenerationError, InvalidRequestError, NoCapacityError
from exo.shared.types.chunks import Chunk, ErrorChunk, TokenChunk, ToolCallChunk, Usage
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ToolCall
from exo.testing.chunks import ChunkSource

COMMAND = CommandId("command-1")
MODEL = ModelId("m")


def token(text: str, **fields: Any) -> TokenChunk:
    return TokenChunk(command_id=COMMAND, model=MODEL, text=text, token_ids=(1,), **fields)


def events_of(chunks: list[Chunk], fail_unfinished: bool = True) -> list[stream.GenerationEvent]:
    source = ChunkSource(chunks)

    async def fold() -> list[stream.GenerationEvent]:
        pieces = stream.generation_events(
            source, conversation_param="messages", fail_unfinished=fail_unfinished
        )
        return [piece async for piece in pieces]

    events = anyio.run(fold)
    assert source.taken == min(len(chunks), _read_up_to_the_finish(chunks))
    return events


def _read_up_to_the_finish(chunks: list[Chunk]) -> int:
    finishes = [index for index, chunk in enumerate(chunks) if chunk.finish_reason is not None]
    return finishes[0] + 1 if finishes else len(chunks)


def test_text_tool_calls_then_the_finish_with_the_last_chunks_usage() -> None:
    call = ToolCall(id="call_1", name="f", arguments="{}")
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    events = events_of(
        [
            token("Hi", reasoning_text="hm"),
            ToolCallChunk(
                command_id=COMMAND,
                model=MODEL,
                tool_calls=(call,),
                token_ids=(2,),
                finish_reason="tool_calls",
                usage=usage,
            ),
            token("never read"),
        ]
    )
    assert events == [
        stream.Text("Hi", "hm", ()),
        stream.ToolCalls((call,)),
        stream.Finished("tool_calls", usage, 2, None),
    ]
    finished = events[-1]
    assert isinstance(finished, stream.Finished)
    assert finished.final_usage == usage
    assert finished.completed_reason == "tool_calls"


def test_a_finish_without_usage_reports_the_tokens_the_stream_showed() -> None:
    events = events_of([token("a"), token("b", finish_reason="stop", stop_sequence="\n")])
    finished = events[-1]
    assert finished == stream.Finished("stop", None, 2, "\n")
    assert isinstance(finished, stream.Finished)
    assert finished.final_usage == Usage(prompt_tokens=0, completion_tokens=2)


@pytest.mark.parametrize(
    ("status_code", "error_type"),
    [(400, InvalidRequestError), (503, NoCapacityError), (500, GenerationError)],
)
def test_an_error_chunk_is_the_failure_it_stands_for(
    status_code: int, error_type: type[Exception]
) -> None:
    chunk = ErrorChunk(command_id=COMMAND, model=MODEL, error_message="no", status_code=status_code)
    events = events_of([token("a"), chunk])
    assert events[0] == stream.Text("a", "", ())
    failed = events[1]
    assert isinstance(failed, stream.Failed) and type(failed.error) is error_type
    assert len(events) == 2
    if status_code == 400:
        assert failed.error.param == "messages"


@pytest.mark.parametrize("reason", ["error", "cancelled"])
def test_an_unfinished_generation_fails_unless_the_dialect_renders_it(
    reason: Literal["error", "cancelled"],
) -> None:
    chunks: list[Chunk] = [token("a", finish_reason=reason)]
    failed = events_of(chunks)[-1]
    assert isinstance(failed, stream.Failed)
    assert failed.error.code == f"generation_{'failed' if reason == 'error' else 'cancelled'}"
    assert events_of(chunks, fail_unfinished=False)[-1] == stream.Finished(reason, None, 1, None)


def test_a_stream_that_ends_without_a_finish_fails() -> None:
    failed = events_of([token("a")])[-1]
    assert isinstance(failed, stream.Failed)
    assert failed.error.message == "generation stream ended without a finish"


def test_collect_generation_gathers_texts_calls_and_logprobs() -> None:
    call = ToolCall(id="call_1", name="f", arguments="{}")
    chunks: list[Chunk] = [
        token("Hel", reasoning_text="r"),
        ToolCallChunk(command_id=COMMAND, model=MODEL, tool_calls=(call,)),
        token("lo", finish_reason="stop"),
    ]

    async def collect() -> stream.CollectedGeneration:
        return await stream.collect_generation(ChunkSource(chunks), conversation_param=None)

    collected = anyio.run(collect)
    assert (collected.text, collected.reasoning, collected.tool_calls) == ("Hello", "r", (call,))
    assert collected.logprobs == ()
    assert collected.finished.completed_reason == "stop"


def test_collect_generation_raises_the_failure() -> None:
    async def collect() -> stream.CollectedGeneration:
        return await stream.collect_generation(ChunkSource([token("a")]), conversation_param=None)

    with pytest.raises(GenerationError, match="ended without a finish"):
        anyio.run(collect)
