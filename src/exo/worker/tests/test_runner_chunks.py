"""The chunks a runner sends for one generation: the first carries the prompt's token count
(Claude's `message_start` reports it), whatever the first piece holds; the others do not."""

from __future__ import annotations

from multiprocessing import Pipe
from typing import Any, cast

from exo.shared.types.chunks import Chunk, TokenChunk, ToolCallChunk, Usage
from exo.shared.types.common import RunnerId
from exo.shared.types.text_generation import ToolDefinition
from exo.testing.builders import make_params, make_shard, make_text_generation_task
from exo.worker.engines.prompt import RenderedPrompt
from exo.worker.engines.torch.engine import GeneratedPiece, RequestHandle
from exo.worker.runner.messages import ChunkReport, decode_outbound
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

    def step(self) -> list[tuple[str, GeneratedPiece]]:
        return [(self._request_id, self._pieces.pop(0))] if self._pieces else []

    def cancel(self, request_id: str) -> bool:
        return False


def chunks_of_one_generation(pieces: list[GeneratedPiece], **params: Any) -> list[Chunk]:
    inbound_reader, _inbound_writer = Pipe(duplex=False)
    outbound_reader, outbound_writer = Pipe(duplex=False)
    runner = Runner(RunnerId("runner-1"), make_shard(), inbound_reader, outbound_writer)
    runner._engine = cast(Any, ScriptedEngine(pieces))
    task = make_text_generation_task(params=make_params().model_copy(update=params))
    runner._start_generation(task)
    for _step in range(len(pieces)):
        runner._step()
    assert not runner._generations, "the generation finished with its last piece"
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
