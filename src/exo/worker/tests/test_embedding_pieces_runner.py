"""A runner answers embeddings a piece at a time (`embedding_batch.EmbeddingJob`) inside its
real loop (`Runner.run` in a thread, fed through its pipes): a running stream gets one step
between two pieces of a long embedding; a cancel arriving while a piece runs stops the work
before the next piece, no answer is sent for it, and the runner answers the next request;
a short request arriving during a long one is answered first (the works take turns); a
request over `MAX_REQUEST_TOKENS` is a 400 naming its field before any forward pass.
Steps and pieces are counted in the order they ran, never timed."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from multiprocessing import Pipe
from typing import Any, Literal, cast

import pytest
import torch

from exo.shared.types.chunks import EmbeddingChunk, ErrorChunk, TokenChunk
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.tasks import (
    CancelTask,
    Embedding,
    Shutdown,
    StartWarmup,
    TaskCancelled,
    TaskComplete,
)
from exo.testing.builders import make_shard, make_text_generation_task
from exo.worker.engines.torch.batching.chunk_sizer import FixedChunkSizer
from exo.worker.runner import embedding_batch, engine_lifecycle
from exo.worker.runner.embedding_batch import (
    MAX_TOKENS_PER_REQUEST,
    EmbeddingJob,
    EmbeddingPacer,
)
from exo.worker.runner.messages import (
    ChunkReport,
    RunnerOutbound,
    TaskStatusReport,
    decode_outbound,
)
from exo.worker.runner.runner import Runner
from exo.worker.tests.test_runner_batching import BatchEngine

MODEL = ModelId("some/embedder")
PIECE_TOKENS = 10


class PieceWork:
    """`EmbeddingWork` of `tokens` per row, `budget` tokens per piece; logs each piece."""

    def __init__(self, log: list[str], lengths: Sequence[int], on_piece: Callable[[int], None]):
        self._log = log
        self._left = list(lengths)
        self.rows = len(lengths)
        self.tokens = sum(lengths)
        self._on_piece = on_piece
        self.pieces = 0
        self.dropped: list[int] = []

    @property
    def done(self) -> bool:
        return not any(self._left)

    def run_piece(self, budget: int | None) -> int:
        row = next(index for index, left in enumerate(self._left) if left)
        computed = min(self._left[row], budget or self._left[row])
        self._left[row] -= computed
        self.pieces += 1
        self._log.append(f"piece {computed}")
        self._on_piece(self.pieces)
        return computed

    def drop(self, rows: Iterable[int]) -> None:
        for row in rows:
            self.dropped.append(row)
            self._left[row] = 0

    def result(self) -> torch.Tensor:
        return torch.ones(self.rows, 4)


class PieceBackend:
    """Each text is one token per character."""

    max_input_tokens = 1000
    dimensions = 4
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.works: list[PieceWork] = []
        self.on_piece: Callable[[int], None] = lambda piece: None

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [[ord(character) for character in text] for text in texts]

    def scratch_bytes(self, tokens: int) -> int:
        return 0

    def start_embedding(self, token_ids: Sequence[Sequence[int]]) -> PieceWork:
        self.works.append(PieceWork(self.log, [len(ids) for ids in token_ids], self.on_piece))
        return self.works[-1]

    def start_scoring(self, pairs: Sequence[tuple[str, str]]) -> PieceWork:
        return self.start_embedding(self.tokenize([query + doc for query, doc in pairs]))


class ServingEngine(BatchEngine):
    """`BatchEngine`'s streams (each step logged) and `PieceBackend`'s embeddings."""

    kv_cache_tokens = 100

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.log: list[str] = []
        self.backend = PieceBackend(self.log)

    def step(self) -> list[Any]:
        self.log.append("step")
        return super().step()

    def embedding_backend(self) -> PieceBackend:
        return self.backend

    def warmup(self) -> None:
        pass

    def weight_bytes(self) -> int:
        return 1


def _embedding(task_id: str, *inputs: str, kind: Literal["embed", "rerank"] = "embed") -> Embedding:
    return Embedding(
        task_id=TaskId(task_id), command_id=CommandId(f"command-{task_id}"),
        instance_id=InstanceId("i"), origin_node_id=NodeId("n"),
        params=EmbeddingTaskParams(
            kind=kind, model=MODEL, inputs=inputs, query="q" if kind == "rerank" else None
        ),
    )  # fmt: skip


class RunningRunner:
    """`Runner.run` on a thread over `engine`, warmed up through its pipe; what it sends is
    gathered by `until`."""

    def __init__(self, engine: ServingEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(engine_lifecycle, "freeze_long_lived_objects", lambda: None)
        inbound_reader, self.inbound = Pipe(duplex=False)
        self.outbound, outbound_writer = Pipe(duplex=False)
        self.runner = Runner(RunnerId("r"), make_shard(), inbound_reader, outbound_writer)
        self.runner._engine = engine  # type: ignore[assignment]
        self.runner._embeddings.pacer = EmbeddingPacer(FixedChunkSizer(PIECE_TOKENS))
        self.sent: list[RunnerOutbound] = []
        self.send(StartWarmup(instance_id=InstanceId("i"), runner_id=RunnerId("r")))
        self.thread = threading.Thread(target=self.runner.run, daemon=True)

    def send(self, message: Any) -> None:
        self.inbound.send_bytes(message.model_dump_json().encode())

    def until(self, condition: Callable[[list[RunnerOutbound]], bool]) -> list[RunnerOutbound]:
        deadline = time.monotonic() + 20.0
        while not condition(self.sent):
            assert time.monotonic() < deadline, "the runner did not answer in time"
            if self.outbound.poll(0.05):
                self.sent.extend(decode_outbound(self.outbound.recv_bytes()))
        return self.sent

    def stop(self) -> None:
        self.send(Shutdown(runner_id=RunnerId("r")))
        self.thread.join(timeout=20.0)
        assert not self.thread.is_alive()


def _ended(task_ids: set[str]) -> Callable[[list[RunnerOutbound]], bool]:
    def check(sent: list[RunnerOutbound]) -> bool:
        ended = {
            message.task_id
            for message in sent
            if isinstance(message, TaskStatusReport) and message.status.kind != "TaskRunning"
        }
        return task_ids <= ended

    return check


def _chunks(sent: list[RunnerOutbound], command_id: str) -> list[Any]:
    return [
        m.chunk for m in sent if isinstance(m, ChunkReport) and m.chunk.command_id == command_id
    ]


def test_a_stream_gets_a_step_between_every_two_pieces_of_a_long_embedding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = ServingEngine(length=40)
    running = RunningRunner(engine, monkeypatch)
    running.send(make_text_generation_task(task_id="task-a"))
    running.send(_embedding("embed-1", "x" * 95, "short"))
    running.thread.start()
    sent = running.until(_ended({"task-a", "embed-1"}))
    running.stop()
    log = engine.log
    pieces = [index for index, event in enumerate(log) if event.startswith("piece")]
    # 95 + 5 tokens in pieces of at most 10: the long input in ten, the short one whole.
    assert [log[index] for index in pieces] == ["piece 10"] * 9 + ["piece 5", "piece 5"]
    # One step of the stream between every two pieces: its tokens kept coming.
    assert all(log[a + 1 : b] == ["step"] for a, b in itertools.pairwise(pieces))
    (answer,) = _chunks(sent, "command-embed-1")
    assert isinstance(answer, EmbeddingChunk) and answer.prompt_tokens == 100
    streamed = [chunk for chunk in _chunks(sent, "command-task-a") if isinstance(chunk, TokenChunk)]
    assert streamed[-1].finish_reason == "length" and len(streamed) == 40


def test_a_cancel_stops_the_embedding_before_its_next_piece_and_the_runner_serves_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = ServingEngine(length=40)
    running = RunningRunner(engine, monkeypatch)
    backend = engine.backend
    cancel = CancelTask(runner_id=RunnerId("r"), task_id=TaskId("embed-1"))
    # The client leaves while the second piece runs (the cancel is in the pipe after it).
    backend.on_piece = lambda piece: running.send(cancel) if piece == 2 else None
    running.send(make_text_generation_task(task_id="task-a"))
    running.send(_embedding("embed-1", "x" * 95))
    running.thread.start()
    running.until(_ended({"embed-1"}))
    backend.on_piece = lambda piece: None
    running.send(_embedding("embed-2", "y" * 12))
    sent = running.until(_ended({"embed-2", "task-a"}))
    running.stop()
    first, second = backend.works
    assert first.pieces == 2 and first.dropped == [0]  # no third piece
    assert running.runner._embeddings.job is None  # the job and its work are gone
    answers = _chunks(sent, "command-embed-1")
    assert [type(chunk) for chunk in answers] == [TokenChunk]  # no vectors, only the end
    assert answers[0].finish_reason == "cancelled"
    statuses = [m.status for m in sent if isinstance(m, TaskStatusReport)]
    assert TaskCancelled() in statuses
    # The next request is answered; the stream ran to its end throughout.
    assert second.done and second.dropped == []
    (answer,) = _chunks(sent, "command-embed-2")
    assert isinstance(answer, EmbeddingChunk) and answer.prompt_tokens == 12
    assert any(
        isinstance(m, TaskStatusReport) and m.task_id == "embed-2" and m.status == TaskComplete()
        for m in sent
    )


def test_a_short_request_arriving_during_a_long_one_is_answered_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The works take pieces in turn: the short request, arriving while the long one's
    first piece runs, is answered after its own one piece, long before the long one."""
    engine = ServingEngine(length=60)
    running = RunningRunner(engine, monkeypatch)
    backend = engine.backend
    short = _embedding("short", "z" * 7)
    pending = [short]  # sent once, while the long input's first piece runs
    backend.on_piece = lambda piece: running.send(pending.pop()) if pending else None
    running.send(make_text_generation_task(task_id="task-a"))
    running.send(_embedding("long", "x" * 95))
    running.thread.start()
    sent = running.until(_ended({"long", "short", "task-a"}))
    running.stop()
    answered = [
        m.chunk.command_id
        for m in sent
        if isinstance(m, ChunkReport) and isinstance(m.chunk, EmbeddingChunk)
    ]
    assert answered == ["command-short", "command-long"]
    # The long input's first piece, the short one whole, then the long one's other nine.
    pieces = [event for event in engine.log if event.startswith("piece")]
    assert pieces == ["piece 10", "piece 7"] + ["piece 10"] * 8 + ["piece 5"]


@pytest.mark.parametrize(("kind", "field"), [("embed", "input"), ("rerank", "documents")])
def test_a_request_over_the_token_cap_is_a_400_naming_its_field_before_any_work(
    monkeypatch: pytest.MonkeyPatch, kind: Literal["embed", "rerank"], field: str
) -> None:
    monkeypatch.setattr(embedding_batch, "MAX_REQUEST_TOKENS", 20)
    backend = PieceBackend([])
    fits = _embedding("fits", "a" * 10, "b" * 10, kind=kind) if kind == "embed" else None
    over = _embedding("over", "a" * 10, "b" * 10, "c", kind=kind)
    job = EmbeddingJob(cast(Any, backend), [over] if fits is None else [over, fits])
    ((task, refused), *_) = job.take_answers()
    assert task is over and isinstance(refused, ErrorChunk)
    assert refused.status_code == 400 and refused.error_code == MAX_TOKENS_PER_REQUEST
    assert f"'$.{field}' is too long" in refused.error_message
    assert "max 20 tokens per request" in refused.error_message
    if kind == "embed":
        assert "requested 21 tokens" in refused.error_message
        assert [work.rows for work in backend.works] == [2]  # only the request that fits
    else:
        assert job.done  # scored nothing
