"""Answer the embedding and rerank tasks that reached a runner together, a piece at a time.

Every "embed" task's inputs (tokenized through the backend; token-id inputs as they are)
go into one `EmbeddingWork` (`EmbeddingBackend.start_embedding`), so concurrent requests
share forward passes; each vector is then cut to its request's `dimensions` (Matryoshka)
and L2-normalized. Each "rerank" task is a work of its own (`start_scoring`). The runner
runs an `EmbeddingJob` one piece per turn (`run_piece`, at most a token budget), with the
decode steps of the streams running on the instance between pieces, so a long input never
silences them for its whole forward; tasks that arrive meanwhile join the job, and its
works take pieces in turn; a task cancelled between pieces (`cancel`) gets no answer and
its rows are dropped from the work (a chunked input's scratch cache with them).

A task at fault fails alone, at once, with a 400 naming the field: an input over the
context without `truncate`, a request over `MAX_REQUEST_TOKENS` in all, a `dimensions` the
model cannot cut to, rerank on a model that is no reranker. A failed forward fails the
tasks of its work (500).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from loguru import logger

from exo.shared.types.chunks import Chunk, EmbeddingChunk, ErrorChunk
from exo.shared.types.common import TaskId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.tasks import Embedding
from exo.worker.engines.torch.batching.chunk_sizer import FixedChunkSizer, PrefillChunkSizer
from exo.worker.engines.torch.batching.scheduler import (
    PREFILL_TOKENS_PER_IDLE_STEP,
    PREFILL_TOKENS_PER_STEP,
)
from exo.worker.engines.torch.embedding.backend import (
    EmbeddingBackend,
    EmbeddingWork,
    ScratchMemoryError,
    check_scratch_memory,
)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The error code of an input over the context (`exo.api.wire.errors`: each dialect words it
as its reference API does)."""
MAX_TOKENS_PER_REQUEST = "max_tokens_per_request"
"""The error code of a request over `MAX_REQUEST_TOKENS` (OpenAI's, for its embeddings'
per-request cap)."""
MAX_REQUEST_TOKENS = 300_000
"""Most tokens one embedding or rerank request may hold, its inputs summed (after any
truncation; a rerank's documents with the query and the model's prompt around each):
OpenAI's cap for one embeddings request. Each input is also bounded by the model's
context (`EmbeddingBackend.max_input_tokens`). A request over it is a 400 naming `input`
(rerank: `documents`) before any forward pass: at Gemma 3 270M's measured prefill speed
on a 2-core CPU it is minutes of work, and a chunked input's scratch cache grows with its
length (`embedding/lean_states.py`)."""


# An embedding piece's tokens while no stream decodes: no gap to bound, but a cancel waits
# for the piece and its activations grow with it (the idle prefill chunk).
IDLE_PIECE_TOKENS = PREFILL_TOKENS_PER_IDLE_STEP
# A stream's gap while an embedding runs beside it, as a multiple of its decode-only step.
# A prompt chunk rides in the streams' own step (2.5, `chunk_sizer.DEFAULT_GAP_RATIO`); a
# piece is a forward pass of its own whose fixed cost (reading the weights) is about one
# decode step, so at 2.5 a piece is mostly that fixed cost: Gemma 3 270M on 2 cores got
# pieces of ~1 token and a 6,000-token input took 11x its time alone. At 5 a piece's
# tokens cost at least 3x its fixed cost (figures: docs/benchmarks/2026-12-06-embedding-stall.md).
PIECE_GAP_RATIO = 5.0


class EmbeddingPacer:
    """How many tokens the runner's next embedding piece may compute.

    Beside decoding streams a piece delays each stream's next token as a prompt chunk in
    their step would, so it is sized by the same rule (`chunk_sizer.PrefillChunkSizer`:
    the most tokens that keep the streams' step plus the piece within `PIECE_GAP_RATIO`
    times their decode-only step), fed the decode-only steps' times (`observe_step`) and
    each piece's time as the part of the gap beyond that step (`observe_piece`); the
    sizer's fitted fixed cost per piece is then the piece's own forward pass. With no
    stream decoding: `IDLE_PIECE_TOKENS`.

    Args:
        sizer: the rule (tests pass a `FixedChunkSizer`, whose pieces do not depend on the
            machine's speed).
    """

    def __init__(self, sizer: PrefillChunkSizer | FixedChunkSizer | None = None) -> None:
        self.sizer = sizer or PrefillChunkSizer(
            maximum=IDLE_PIECE_TOKENS, gap_ratio=PIECE_GAP_RATIO, initial=PREFILL_TOKENS_PER_STEP
        )

    def piece_tokens(self, decoding: int) -> int:
        """Tokens of the next piece beside `decoding` streams (0 once, before a decode-only
        step of theirs was measured: their step runs alone first)."""
        return IDLE_PIECE_TOKENS if decoding <= 0 else self.sizer.chunk(decoding)

    def observe_step(self, decoding: int, seconds: float) -> None:
        """A decode-only step of `decoding` streams took `seconds`."""
        self.sizer.observe(decoding, 0, seconds)

    def observe_piece(self, decoding: int, tokens: int, seconds: float) -> None:
        """A piece of `tokens` took `seconds` beside `decoding` streams."""
        sizer = self.sizer
        if decoding <= 0 or tokens <= 0 or not isinstance(sizer, PrefillChunkSizer):
            return
        base = sizer.decode_seconds(decoding)
        if base is not None:
            sizer.observe(decoding, tokens, base + seconds)


class EmbeddingRequestError(ValueError):
    """The request itself is at fault (a 400 naming `field`; `code` overrides the chunk's
    `invalid_<field>` error code)."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code or f"invalid_{field}"


@dataclass(slots=True)
class _Pending:
    """A work and the tasks waiting on it: each task's rows of the work (`spans`)."""

    work: EmbeddingWork
    spans: dict[TaskId, tuple[int, int]]
    tasks: dict[TaskId, Embedding]
    rerank: bool
    prompt_tokens: dict[TaskId, int] = field(default_factory=dict)


class EmbeddingJob:
    """The embedding and rerank tasks a runner is answering (see the module docstring).
    Tasks join with `add` (those that reached the runner together share one work); the
    works take pieces in turn (round robin), so a short request arriving while a long one
    runs is answered after a few pieces, not after the long one. Answers leave through
    `take_answers` as they are ready: a refusal at once, a work's tasks when its last
    piece ran.
    """

    def __init__(self, backend: EmbeddingBackend, tasks: Sequence[Embedding] = ()) -> None:
        self._backend = backend
        self._answers: list[tuple[Embedding, Chunk]] = []
        self._works: deque[_Pending] = deque()
        self.add(tasks)

    def add(self, tasks: Sequence[Embedding]) -> None:
        """Take `tasks` in: their embed tasks' inputs as one work, each rerank task a work of
        its own, next in turn (before the works already here, which have had turns); a task
        at fault is answered at once (its 400, or a 500 where its work could not be
        built)."""
        backend = self._backend
        batch: list[list[int]] = []
        spans: dict[TaskId, tuple[int, int]] = {}
        embedded: dict[TaskId, Embedding] = {}
        counted: dict[TaskId, int] = {}
        reranks: list[_Pending] = []
        for task in tasks:
            try:
                if task.params.kind == "rerank":
                    reranks.append(_rerank_work(backend, task))
                    continue
                rows = _embedding_rows(backend, task.params)
            except EmbeddingRequestError as error:
                self._answers.append((task, _error(task, str(error), 400, error.code)))
                continue
            except Exception as error:
                logger.opt(exception=error).warning("rerank failed")
                self._answers.append((task, _error(task, f"rerank failed: {error}", 500)))
                continue
            spans[task.task_id] = (len(batch), len(batch) + len(rows))
            embedded[task.task_id] = task
            counted[task.task_id] = sum(len(row) for row in rows)
            batch.extend(rows)
        works: list[_Pending] = []
        if embedded:
            try:
                work = backend.start_embedding(batch)
            except Exception as error:
                logger.opt(exception=error).warning("embedding failed")
                for task in embedded.values():
                    self._answers.append((task, _error(task, f"embedding failed: {error}", 500)))
            else:
                works.append(_Pending(work, spans, embedded, False, counted))
        # Ahead of the works here: those have had turns (the last to run is at the end).
        self._works.extendleft(reversed([*works, *reranks]))

    @property
    def done(self) -> bool:
        """No work is left (answers may still wait in `take_answers`)."""
        return not self._works

    def take_answers(self) -> list[tuple[Embedding, Chunk]]:
        """The answers ready since the last call, each with its task: an `EmbeddingChunk`
        or an `ErrorChunk` (400 with `error_code` naming the field, 500 when a forward
        failed)."""
        answers, self._answers = self._answers, []
        return answers

    def run_piece(self, budget: int | None) -> int:
        """Run one piece of the next work in turn, at most `budget` tokens (None: no
        bound); answer its tasks when it is done (a 503 where a chunked input's scratch
        cache no longer fits the memory free, a 500 where the forward failed). Returns the
        tokens computed."""
        if not self._works:
            return 0
        pending = self._works.popleft()
        try:
            computed = pending.work.run_piece(budget)
            if pending.work.done:
                self._answers.extend(_answers_of(pending))
            else:
                self._works.append(pending)  # the next work's turn
        except ScratchMemoryError as error:  # the memory went to other work since admission
            what = "rerank" if pending.rerank else "embedding"
            for task in pending.tasks.values():
                self._answers.append(
                    (task, _error(task, f"{what} refused: {error}", 503, "overloaded"))
                )
            return 0
        except Exception as error:
            logger.opt(exception=error).warning("embedding forward failed")
            what = "rerank" if pending.rerank else "embedding"
            for task in pending.tasks.values():
                self._answers.append((task, _error(task, f"{what} failed: {error}", 500)))
            return 0
        return computed

    def cancel(self, task_id: TaskId) -> Embedding | None:
        """Stop working for `task_id`: its rows are dropped (a work nobody waits for is
        dropped whole, its scratch memory with it). Returns its task, or None when it is
        not waiting here (answered already, or never part of the job)."""
        for pending in list(self._works):
            task = pending.tasks.pop(task_id, None)
            if task is None:
                continue
            start, end = pending.spans.pop(task_id)
            pending.work.drop(range(start, end))
            if not pending.tasks:
                self._works.remove(pending)
            return task
        return None

    def cancel_all(self) -> list[Embedding]:
        """Drop every work; the tasks that were waiting on them."""
        tasks = [task for pending in self._works for task in pending.tasks.values()]
        self._works.clear()
        return tasks


def answer_embeddings(backend: EmbeddingBackend, tasks: Sequence[Embedding]) -> list[Chunk]:
    """One final chunk per task, in order, every work run to its end in pieces of no bound
    (the model's own batching)."""
    job = EmbeddingJob(backend, tasks)
    while not job.done:
        job.run_piece(None)
    answers = {id(task): chunk for task, chunk in job.take_answers()}
    return [answers[id(task)] for task in tasks]


def check_dimensions(backend: EmbeddingBackend, dimensions: int | None) -> None:
    """Raises EmbeddingRequestError unless `dimensions` is None, the full width, or (for a
    Matryoshka model) between its smallest trained width and the full one."""
    if dimensions is None or dimensions == backend.dimensions:
        return
    allowed = backend.matryoshka_dimensions
    if not allowed:
        raise EmbeddingRequestError(
            f"this model does not support dimensions other than {backend.dimensions}",
            "dimensions",
        )
    if not min(allowed) <= dimensions <= backend.dimensions:
        raise EmbeddingRequestError(
            f"dimensions must be between {min(allowed)} and {backend.dimensions}", "dimensions"
        )


def check_request_tokens(tokens: int, field: str) -> None:
    """Raises EmbeddingRequestError (`field`, code `max_tokens_per_request`) when `tokens`
    exceed `MAX_REQUEST_TOKENS`."""
    if tokens > MAX_REQUEST_TOKENS:
        raise EmbeddingRequestError(
            f"'$.{field}' is too long: requested {tokens} tokens, max {MAX_REQUEST_TOKENS} "
            "tokens per request",
            field,
            MAX_TOKENS_PER_REQUEST,
        )


def _embedding_rows(backend: EmbeddingBackend, params: EmbeddingTaskParams) -> list[list[int]]:
    """The token ids of each input, cut to the context when `truncate`; the request's sum
    within `MAX_REQUEST_TOKENS`; each input's scratch memory within the memory free now
    (`EmbeddingBackend.scratch_bytes`; checked again when a chunked input starts)."""
    check_dimensions(backend, params.dimensions)
    texts = [item for item in params.inputs if isinstance(item, str)]
    tokenized = iter(backend.tokenize(texts) if texts else [])
    rows: list[list[int]] = []
    limit = backend.max_input_tokens
    for position, item in enumerate(params.inputs):
        ids = next(tokenized) if isinstance(item, str) else list(item)
        if not ids:
            raise EmbeddingRequestError(f"input[{position}] has no tokens", "input")
        if len(ids) > limit:
            if not params.truncate:
                raise EmbeddingRequestError(
                    f"input[{position}]: the prompt is {len(ids)} tokens; the model's context "
                    f"is {limit} tokens (ask for truncation to cut it)",
                    "input",
                    CONTEXT_LENGTH_EXCEEDED,
                )
            ids = ids[:limit]
        try:  # an input whose scratch memory the node cannot hold: refused before any work
            check_scratch_memory(backend.scratch_bytes(len(ids)), len(ids))
        except ScratchMemoryError as error:
            raise EmbeddingRequestError(f"input[{position}]: {error}", "input") from None
        rows.append(ids)
    check_request_tokens(sum(len(ids) for ids in rows), "input")
    return rows


def _rerank_work(backend: EmbeddingBackend, task: Embedding) -> _Pending:
    """A rerank task's work, its usage the tokens the model reads (`work.tokens`): each
    (query, document) pair as the backend builds it, its special tokens or prompt included,
    after its cut to the context; tokenized once, by the backend.

    Raises:
        EmbeddingRequestError: the model is no reranker (`model`); the request is over
            `MAX_REQUEST_TOKENS` (`documents`).
    """
    params = task.params
    query = params.query or ""
    documents = [item for item in params.inputs if isinstance(item, str)]
    work = backend.start_scoring([(query, document) for document in documents])
    if work is None:
        raise EmbeddingRequestError(f"{params.model} is not a reranker", "model")
    check_request_tokens(work.tokens, "documents")
    return _Pending(
        work,
        {task.task_id: (0, work.rows)},
        {task.task_id: task},
        rerank=True,
        prompt_tokens={task.task_id: work.tokens},
    )


def _answers_of(pending: _Pending) -> list[tuple[Embedding, Chunk]]:
    """The chunks of a finished work's tasks."""
    result = pending.work.result()
    answers: list[tuple[Embedding, Chunk]] = []
    for task_id, task in pending.tasks.items():
        start, end = pending.spans[task_id]
        params = task.params
        if pending.rerank:
            chunk = EmbeddingChunk(
                command_id=task.command_id,
                model=params.model,
                scores=tuple(float(score) for score in result[start:end].tolist()),
                prompt_tokens=pending.prompt_tokens[task_id],
            )
        else:
            pooled = result[start:end, : params.dimensions or result.shape[1]]
            normalized = torch.nn.functional.normalize(pooled.float(), dim=-1)
            chunk = EmbeddingChunk(
                command_id=task.command_id,
                model=params.model,
                vectors=tuple(tuple(row) for row in normalized.tolist()),
                prompt_tokens=pending.prompt_tokens[task_id],
            )
        answers.append((task, chunk))
    return answers


def _error(task: Embedding, message: str, status_code: int, code: str | None = None) -> Chunk:
    return ErrorChunk(
        command_id=task.command_id,
        model=task.params.model,
        error_message=message,
        status_code=status_code,
        error_code=code,
    )
