"""`answer_embeddings`: the tasks that reach a runner together share one `embed` call;
each request's inputs are checked against the context (truncated only when asked), cut to
its `dimensions` and normalized; a request at fault fails alone with a 400 naming the field;
a rerank's usage counts the tokens its pairs were cut to."""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing import Pipe
from typing import Any, cast

import pytest
import torch

from exo.shared.types.chunks import EmbeddingChunk, ErrorChunk
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.embeddings import EmbeddingInput, EmbeddingTaskParams
from exo.shared.types.runners import RunnerReady
from exo.shared.types.tasks import Embedding, TaskComplete
from exo.testing.builders import make_shard
from exo.worker.runner.embedding_batch import answer_embeddings
from exo.worker.runner.messages import ChunkReport, TaskStatusReport, decode_outbound
from exo.worker.runner.runner import Runner

MODEL = ModelId("some/embedder")


class FakeBackend:
    """Each text is one token per character; a vector is `[len, 1, 2, ..., width-1]`."""

    max_input_tokens = 5
    dimensions = 4
    matryoshka_dimensions: tuple[int, ...] | None = (2, 4)

    def __init__(self, scratch_bytes_per_token: int = 0) -> None:
        self.calls: list[list[list[int]]] = []
        self.scratch_bytes_per_token = scratch_bytes_per_token

    def scratch_bytes(self, tokens: int) -> int:
        return tokens * self.scratch_bytes_per_token

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[ord(character) for character in text] for text in texts]

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        self.calls.append([list(row) for row in token_ids])
        return torch.tensor([[float(len(row)), 1.0, 2.0, 3.0] for row in token_ids])

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor | None:
        return None

    def start_embedding(self, token_ids: Sequence[Sequence[int]]) -> FakeWork:
        return FakeWork(self, token_ids)

    def start_scoring(self, pairs: Sequence[tuple[str, str]]) -> None:
        return None


class FakeWork:
    """All rows in one `embed` call, at the first piece."""

    def __init__(self, backend: FakeBackend, token_ids: Sequence[Sequence[int]]) -> None:
        self._backend = backend
        self._inputs = [list(row) for row in token_ids]
        self.rows = len(self._inputs)
        self.tokens = sum(len(row) for row in self._inputs)
        self._result: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._result is not None

    def run_piece(self, budget: int | None) -> int:
        self._result = self._backend.embed(self._inputs)
        return self.tokens

    def drop(self, rows: object) -> None:
        pass

    def result(self) -> torch.Tensor:
        assert self._result is not None
        return self._result


def _task(*inputs: EmbeddingInput, **fields: object) -> Embedding:
    return Embedding(
        task_id=TaskId(f"t{len(inputs)}{sorted(fields)}"),
        command_id=CommandId.new(),
        instance_id=InstanceId("i"),
        origin_node_id=NodeId("n"),
        params=EmbeddingTaskParams(model=MODEL, inputs=inputs, **fields),  # type: ignore[arg-type]
    )


def test_requests_share_one_forward_and_each_gets_its_own_rows() -> None:
    backend = FakeBackend()
    first, second = _task("ab", (7, 8, 9)), _task("xyz", dimensions=2)
    answers = answer_embeddings(backend, [first, second])
    assert backend.calls == [[[97, 98], [7, 8, 9], [120, 121, 122]]]  # one call, in order
    assert all(isinstance(answer, EmbeddingChunk) for answer in answers)
    one, two = answers
    assert isinstance(one, EmbeddingChunk) and isinstance(two, EmbeddingChunk)
    expected = torch.nn.functional.normalize(torch.tensor([2.0, 1.0, 2.0, 3.0]), dim=0)
    assert torch.allclose(torch.tensor(one.vectors[0]), expected)
    assert one.prompt_tokens == 5 and one.command_id == first.command_id
    # Matryoshka: cut to 2, then normalized.
    assert torch.allclose(torch.tensor(two.vectors[0]), torch.tensor([3.0, 1.0]) / 10**0.5)


def test_over_context_fails_alone_unless_truncation_is_asked() -> None:
    backend = FakeBackend()
    too_long, cut, fine = _task("abcdefg"), _task("abcdefg", truncate=True), _task("ok")
    answers = answer_embeddings(backend, [too_long, cut, fine])
    refused = answers[0]
    assert isinstance(refused, ErrorChunk) and refused.status_code == 400
    assert refused.error_code == "context_length_exceeded"
    assert "input[0]: the prompt is 7 tokens; the model's context is 5 tokens" in (
        refused.error_message
    )
    assert backend.calls == [[[97, 98, 99, 100, 101], [111, 107]]]
    assert isinstance(answers[1], EmbeddingChunk) and answers[1].prompt_tokens == 5
    assert isinstance(answers[2], EmbeddingChunk)


def test_dimensions_and_rerank_refusals_name_their_field() -> None:
    backend = FakeBackend()
    odd = _task("a", dimensions=1)
    rerank = Embedding(
        task_id=TaskId("r"), command_id=CommandId.new(), instance_id=InstanceId("i"),
        origin_node_id=NodeId("n"),
        params=EmbeddingTaskParams(kind="rerank", model=MODEL, inputs=("d",), query="q"),
    )  # fmt: skip
    answers = answer_embeddings(backend, [odd, rerank])
    assert [answer.error_code for answer in answers if isinstance(answer, ErrorChunk)] == [
        "invalid_dimensions",
        "invalid_model",
    ]
    assert backend.calls == []


def test_an_input_whose_scratch_memory_is_not_free_is_refused_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With 1 GiB per token of scratch and 3.6 GiB free (0.5 GiB kept back): a 4-token
    input makes its request a 400 naming `input[1]` and both sizes, before any forward;
    another request's 3-token input is embedded."""
    import exo.worker.engines.torch.embedding.backend as backend_module

    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda: int(3.6 * 2**30))
    backend = FakeBackend(scratch_bytes_per_token=2**30)
    too_big, fine = _task("abc", "wxyz"), _task("def")
    answers = answer_embeddings(backend, [too_big, fine])
    refused = answers[0]
    assert isinstance(refused, ErrorChunk) and refused.status_code == 400
    assert refused.error_code == "invalid_input"
    assert refused.error_message.startswith("input[1]: an input of 4 tokens needs 4.00 GiB")
    assert "3.60 GiB of memory is free on this node" in refused.error_message
    assert backend.calls == [[[100, 101, 102]]]
    assert isinstance(answers[1], EmbeddingChunk)


def test_scratch_memory_gone_when_the_chunks_start_is_a_503(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admitted (memory was free), but the work's first piece finds too little memory for
    its chunked input's scratch cache: its request gets a 503 `overloaded`, not a 500."""
    from exo.worker.engines.torch.embedding.backend import ScratchMemoryError

    def short_of_memory(self: FakeWork, budget: int | None) -> int:
        raise ScratchMemoryError("an input of 4 tokens needs 4.00 GiB of scratch KV cache")

    monkeypatch.setattr(FakeWork, "run_piece", short_of_memory)
    [answer] = answer_embeddings(FakeBackend(), [_task("wxyz")])
    assert isinstance(answer, ErrorChunk) and answer.status_code == 503
    assert answer.error_code == "overloaded"
    assert answer.error_message == (
        "embedding refused: an input of 4 tokens needs 4.00 GiB of scratch KV cache"
    )


class BackendEngine:
    """The engine side a runner needs for embeddings."""

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def embedding_backend(self) -> FakeBackend:
        return self.backend


def test_a_runner_answers_the_tasks_waiting_in_its_pipe_in_one_batch() -> None:
    backend = FakeBackend()
    inbound_reader, inbound_writer = Pipe(duplex=False)
    outbound_reader, outbound_writer = Pipe(duplex=False)
    runner = Runner(RunnerId("runner-1"), make_shard(), inbound_reader, outbound_writer)
    runner._engine = cast(Any, BackendEngine(backend))
    runner._status = runner._ready = RunnerReady()
    first, second = _task("ab"), _task("xyz", (1, 2))
    runner._handle(first)
    inbound_writer.send_bytes(second.model_dump_json().encode())  # still in the pipe
    runner._take_embeddings()
    while runner._embeddings.job is not None:
        runner._run_embedding_piece()
    assert backend.calls == [[[97, 98], [120, 121, 122], [1, 2]]]  # one forward for both
    sent = []
    while outbound_reader.poll(0):
        sent.extend(decode_outbound(outbound_reader.recv_bytes()))
    chunks = [message.chunk for message in sent if isinstance(message, ChunkReport)]
    assert [chunk.command_id for chunk in chunks] == [first.command_id, second.command_id]
    assert all(isinstance(chunk, EmbeddingChunk) for chunk in chunks)
    finals = [
        message.status
        for message in sent
        if isinstance(message, TaskStatusReport) and message.status.kind != "TaskRunning"
    ]
    assert finals == [TaskComplete(), TaskComplete()]


class ScoreWork(FakeWork):
    """One score per pair (the fake vector's first value)."""

    def result(self) -> torch.Tensor:
        return super().result()[:, 0]


class CuttingReranker(FakeBackend):
    """A reranker that cuts each (query, document) pair to `max_input_tokens` tokens, as
    the encoder and decoder backends do (longest first)."""

    def start_scoring(self, pairs: Sequence[tuple[str, str]]) -> ScoreWork:  # type: ignore[override]
        rows = [
            self.tokenize([query + document])[0][: self.max_input_tokens]
            for query, document in pairs
        ]
        return ScoreWork(self, rows)


def test_rerank_usage_counts_the_tokens_read_after_the_cut() -> None:
    """Trial 42: a 9,000-token query and document on an 8,192-token reranker answered
    `usage.total_tokens` 18004; the pair was cut, the usage was not."""
    backend = CuttingReranker()
    task = Embedding(
        task_id=TaskId("r"), command_id=CommandId.new(), instance_id=InstanceId("i"),
        origin_node_id=NodeId("n"),
        params=EmbeddingTaskParams(
            kind="rerank", model=MODEL, inputs=("d" * 40, "e" * 40), query="q" * 40
        ),
    )  # fmt: skip
    (answer,) = answer_embeddings(backend, [task])
    assert isinstance(answer, EmbeddingChunk), answer
    read = sum(len(row) for call in backend.calls for row in call)
    assert read == 2 * backend.max_input_tokens
    assert answer.prompt_tokens == read, (answer.prompt_tokens, read)
