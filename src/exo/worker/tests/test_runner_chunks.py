"""The chunks a runner sends for one generation: the first carries the prompt's token count
(Claude's `message_start` reports it), whatever the first piece holds; the others do not.
A prompt whose prefill spans steps is announced when the engine admits it, then its progress
at most every `PREFILL_PROGRESS_SECONDS` (`PrefillProgressChunk`)."""

from __future__ import annotations

from multiprocessing import Pipe
from types import SimpleNamespace
from typing import Any, cast

import pytest

from exo.chat_protocol.prompt import RenderedPrompt
from exo.node_options import parse_args
from exo.shared.types.chunks import (
    Chunk,
    PrefillProgressChunk,
    TokenChunk,
    ToolCallChunk,
    Usage,
    merged_token_chunks,
)
from exo.shared.types.common import CommandId, ModelId, RunnerId
from exo.shared.types.text_generation import ToolDefinition
from exo.testing.builders import make_params, make_shard, make_text_generation_task
from exo.worker.engines.torch.engine import GeneratedPiece
from exo.worker.engines.torch.engine_requests import RequestHandle
from exo.worker.runner import generation_feed
from exo.worker.runner.messages import ChunkReport, decode_outbound
from exo.worker.runner.options import RunnerOptions
from exo.worker.runner.runner import Runner

PROMPT_TOKEN_IDS = list(range(100, 117))


class ScriptedEngine:
    """Renders a 17-token prompt and returns the given pieces, one per step."""

    max_concurrent_requests = 1

    def __init__(self, pieces: list[GeneratedPiece]) -> None:
        self._pieces = pieces
        self._request_id = ""

    def render_prompt(self, params: Any) -> RenderedPrompt:
        return RenderedPrompt(
            token_ids=PROMPT_TOKEN_IDS, text="", tool_call_format="hermes",
            thinking_open=False, tools_in_template=False,
        )  # fmt: skip

    def submit(self, params: Any, prompt: RenderedPrompt, request_id: str) -> RequestHandle:
        self._request_id = request_id
        return RequestHandle(request_id, len(prompt.token_ids))

    def kv_cache_usage(self) -> None:
        return None  # no scheduler yet: nothing to report

    def store_finished(self) -> int:
        return 0  # no prefix cache

    def step(self) -> list[tuple[str, GeneratedPiece]]:
        return [(self._request_id, self._pieces.pop(0))] if self._pieces else []

    def cancel(self, request_id: str) -> bool:
        return False


class PrefillingEngine(ScriptedEngine):
    """A `ScriptedEngine` whose request is admitted at the first step and prefills its
    17-token prompt (3 of them from the prefix cache) over `prefill_steps` empty steps, then
    returns the pieces."""

    def __init__(self, pieces: list[GeneratedPiece], prefill_steps: int) -> None:
        super().__init__([*([None] * prefill_steps), *pieces])  # type: ignore[list-item]
        self.prefill_steps = prefill_steps
        self.state = SimpleNamespace(
            prompt_ids=PROMPT_TOKEN_IDS, prefilled_tokens=None, cached_tokens=3
        )
        self.steps = 0

    def submit(self, params: Any, prompt: RenderedPrompt, request_id: str) -> RequestHandle:
        self._request_id = request_id
        return RequestHandle(request_id, len(prompt.token_ids), cast(Any, self.state))

    def step(self) -> list[tuple[str, GeneratedPiece]]:
        self.steps += 1
        prompt = len(PROMPT_TOKEN_IDS)
        self.state.prefilled_tokens = min(prompt, 3 + self.steps * 5)
        piece = self._pieces.pop(0) if self._pieces else None
        return [] if piece is None else [(self._request_id, piece)]


def chunks_of_one_generation(
    pieces: list[GeneratedPiece],
    stream_interval: float = 0.0,
    cancel_after: int | None = None,
    engine: ScriptedEngine | None = None,
    **params: Any,
) -> list[Chunk]:
    """The chunks the runner sends for `pieces` (one per step, after the engine's own empty
    steps); with `cancel_after`, the task is cancelled after that many steps."""
    inbound_reader, _inbound_writer = Pipe(duplex=False)
    outbound_reader, outbound_writer = Pipe(duplex=False)
    runner = Runner(
        RunnerId("runner-1"), make_shard(), inbound_reader, outbound_writer,
        RunnerOptions(stream_interval_seconds=stream_interval),
    )  # fmt: skip
    engine = engine or ScriptedEngine(pieces)
    runner._engine = cast(Any, engine)
    task = make_text_generation_task(params=make_params().model_copy(update=params))
    runner._start_generation(task)
    for step in range(len(engine._pieces)):
        if step == cancel_after:
            runner._cancel(task.task_id)
            break
        runner._step()
    assert not runner._generations, "the generation finished with its last piece"
    assert runner._grouper.idle, "an ended stream keeps nothing"
    chunks: list[Chunk] = []
    while outbound_reader.poll(0):
        for message in decode_outbound(outbound_reader.recv_bytes()):
            if isinstance(message, ChunkReport):
                chunks.append(message.chunk)
    return chunks


def usage(completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=len(PROMPT_TOKEN_IDS), completion_tokens=completion_tokens)


def test_first_chunk_carries_the_prompt_token_count() -> None:
    chunks = chunks_of_one_generation(
        [
            GeneratedPiece("Hel", (1,), None, None),
            GeneratedPiece("lo", (2,), None, None),
            GeneratedPiece("", (), "stop", usage(3)),
        ]
    )
    assert [chunk.kind for chunk in chunks] == ["TokenChunk"] * 3
    first, *rest = [cast(TokenChunk, chunk) for chunk in chunks]
    assert first.prompt_tokens == 17 and first.text == "Hel"
    assert all(chunk.prompt_tokens is None for chunk in rest)
    assert rest[-1].usage is not None and rest[-1].usage.prompt_tokens == 17


def test_prompt_token_count_comes_first_even_before_a_tool_call() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    chunks = chunks_of_one_generation(
        [GeneratedPiece(call, (1, 2, 3), "stop", usage(3))],
        tools=(ToolDefinition(name="get_weather"),),
    )
    assert isinstance(chunks[0], TokenChunk) and chunks[0].prompt_tokens == 17
    assert any(isinstance(chunk, ToolCallChunk) for chunk in chunks)
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_generation_that_ends_at_once_still_reports_its_prompt() -> None:
    chunks = chunks_of_one_generation([GeneratedPiece("", (), "stop", usage(1))])
    assert len(chunks) == 1
    only = chunks[0]
    assert isinstance(only, TokenChunk) and only.prompt_tokens == 17
    assert only.finish_reason == "stop"


PIECES = [GeneratedPiece("Hi", (1,), None, None), GeneratedPiece("", (), "stop", usage(2))]


def test_a_prefill_over_several_steps_is_announced_then_reported_as_it_advances(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(generation_feed, "PREFILL_PROGRESS_SECONDS", 0.0)
    chunks = chunks_of_one_generation(PIECES, engine=PrefillingEngine(PIECES, prefill_steps=3))
    progress = [chunk for chunk in chunks if isinstance(chunk, PrefillProgressChunk)]
    # One per step before the first token: 8, 13 and 17 of 17 prompt tokens (3 cached).
    assert [chunk.prefilled_tokens for chunk in progress] == [8, 13, 17]
    assert {(chunk.prompt_tokens, chunk.cached_tokens) for chunk in progress} == {(17, 3)}
    assert chunks[: len(progress)] == progress  # all before the first token
    first_token = chunks[len(progress)]
    assert isinstance(first_token, TokenChunk) and first_token.text == "Hi"
    assert first_token.prompt_tokens == 17 and first_token.cached_tokens == 3


def test_prefill_progress_is_reported_at_most_every_interval() -> None:
    # Steps take microseconds here: within one interval only the admission is reported.
    chunks = chunks_of_one_generation(PIECES, engine=PrefillingEngine(PIECES, prefill_steps=3))
    progress = [chunk for chunk in chunks if isinstance(chunk, PrefillProgressChunk)]
    assert [chunk.prefilled_tokens for chunk in progress] == [8]
    # A prompt whose first token comes in its first step is never announced.
    chunks = chunks_of_one_generation(PIECES, engine=PrefillingEngine(PIECES, prefill_steps=0))
    assert [chunk.kind for chunk in chunks] == ["TokenChunk", "TokenChunk"]


def test_a_stream_interval_groups_tokens_and_loses_none() -> None:
    """With an interval longer than the steps, tokens after the first leave together: texts,
    token ids and logprobs in order, the first chunk (prompt size) and the last (finish,
    usage) at once; nothing is lost or reordered."""
    words = ["Once", " upon", " a", " time", ",", " there"]
    pieces = [GeneratedPiece(word, (index,), None, None) for index, word in enumerate(words)]
    pieces.append(GeneratedPiece("!", (6,), "length", usage(7)))
    grouped = chunks_of_one_generation(list(pieces), stream_interval=60.0)
    assert all(isinstance(chunk, TokenChunk) for chunk in grouped)
    tokens = cast(list[TokenChunk], grouped)
    # The first alone (TTFT), the middle five held and sent with the last.
    assert [chunk.text for chunk in tokens] == ["Once", " upon a time, there!"]
    assert [chunk.token_ids for chunk in tokens] == [(0,), (1, 2, 3, 4, 5, 6)]
    assert tokens[0].prompt_tokens == len(PROMPT_TOKEN_IDS) and tokens[1].prompt_tokens is None
    assert tokens[-1].finish_reason == "length" and tokens[-1].usage == usage(7)
    every = cast(list[TokenChunk], chunks_of_one_generation(list(pieces), stream_interval=0.0))
    assert len(every) == len(pieces)
    assert "".join(chunk.text for chunk in every) == "".join(chunk.text for chunk in tokens)


def test_held_tokens_leave_before_a_tool_call_and_a_cancel() -> None:
    """A held token is sent before the tool call that follows it, and before the final
    chunk of a cancelled generation."""
    call = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    pieces = [
        GeneratedPiece("Let", (1,), None, None),
        GeneratedPiece(" me", (2,), None, None),
        GeneratedPiece(" check", (3,), None, None),
        GeneratedPiece(call, (4, 5, 6), "stop", usage(6)),
    ]
    chunks = chunks_of_one_generation(
        list(pieces), stream_interval=60.0, tools=(ToolDefinition(name="get_weather"),)
    )
    kinds = [chunk.kind for chunk in chunks]
    texts = [chunk.text for chunk in chunks if isinstance(chunk, TokenChunk)]
    calls = kinds.index("ToolCallChunk")
    assert texts[0] == "Let"
    assert "".join(texts[: kinds[:calls].count("TokenChunk")]).startswith("Let me check")
    assert chunks[-1].finish_reason == "tool_calls"
    cancelled = chunks_of_one_generation(pieces[:3] * 2, stream_interval=60.0, cancel_after=3)
    tokens = [chunk for chunk in cancelled if isinstance(chunk, TokenChunk)]
    assert [chunk.text for chunk in tokens] == ["Let", " me check", ""]
    assert tokens[-1].finish_reason == "cancelled"


def test_only_a_commands_unfinished_chunk_merges() -> None:
    first = TokenChunk(command_id=CommandId("a"), model=ModelId("m"), text="x", prompt_tokens=3)
    second = TokenChunk(
        command_id=CommandId("a"), model=ModelId("m"), text="y", finish_reason="stop"
    )
    merged = merged_token_chunks(first, second)
    assert (merged.text, merged.prompt_tokens, merged.finish_reason) == ("xy", 3, "stop")
    with pytest.raises(ValueError, match="merges"):
        merged_token_chunks(second, first)
    other = TokenChunk(command_id=CommandId("b"), model=ModelId("m"), text="z")
    with pytest.raises(ValueError, match="merges"):
        merged_token_chunks(first, other)


def test_many_chunks_merge_in_order_in_one_copy() -> None:
    def chunk(text: str, token: int, **fields: Any) -> TokenChunk:
        return TokenChunk(
            command_id=CommandId("a"), model=ModelId("m"), text=text, token_ids=(token,),
            reasoning_text=text.upper(), **fields,
        )  # fmt: skip

    first, middle = chunk("a", 1, prompt_tokens=5, cached_tokens=2), chunk("b", 2)
    last = chunk("c", 3, finish_reason="length", stop_sequence=None)
    merged = merged_token_chunks(first, middle, last)
    assert (merged.text, merged.reasoning_text, merged.token_ids) == ("abc", "ABC", (1, 2, 3))
    assert (merged.prompt_tokens, merged.cached_tokens, merged.finish_reason) == (5, 2, "length")
    assert merged_token_chunks(middle) is middle
    with pytest.raises(ValueError, match="merges"):
        merged_token_chunks(first, last, middle)  # a finished chunk before the last


@pytest.mark.parametrize("value", ["-1", "1001", "nan"])
def test_a_stream_interval_out_of_range_is_refused(value: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--stream-interval-ms", value])
    assert parse_args(["--stream-interval-ms", "0"]).stream_interval_seconds == 0.0
