"""The runner's embedding and rerank tasks, answered in turns between its generation steps.

Tasks wait for the next turn (`waiting`); a turn takes them all into the one job being
answered (`embedding_batch.EmbeddingJob`: started then, or joined while it runs), and each
later turn runs one piece of it, as many tokens as the pacer allows beside the streams
decoding (`embedding_batch.EmbeddingPacer`, fed the pieces' and the steps' measured times),
so a long embedding input delays a stream's next token by a bounded piece, not by its whole
forward. Every answer leaves as its chunk and its task's status; a task cancelled waiting
or between pieces gets no answer (the runner ends it). The runner holds its output while a
turn runs, as while a step runs, so a turn's messages leave together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from exo.shared.types.chunks import Chunk, ErrorChunk
from exo.shared.types.common import TaskId
from exo.shared.types.tasks import Embedding, TaskComplete, TaskFailed, TaskRunning, TaskStatus
from exo.worker.runner.embedding_batch import EmbeddingJob, EmbeddingPacer
from exo.worker.runner.messages import ChunkReport, RunnerOutbound, TaskStatusReport

if TYPE_CHECKING:
    from exo.worker.engines.torch.engine_factory import Engine


class EmbeddingTurns:
    """The embedding tasks of one runner: those waiting for the next turn, the job being
    answered, and the pacer sizing its pieces.

    Args:
        send: where the turns' messages go (the runner's output, held while a turn runs).
    """

    def __init__(self, send: Callable[[RunnerOutbound], None]) -> None:
        self._send = send
        self.waiting: list[Embedding] = []  # answered together at the next turn
        self.job: EmbeddingJob | None = None  # the one being answered
        self.pacer = EmbeddingPacer()  # each piece's tokens

    def take(self, engine: Engine) -> None:
        """Take every waiting task into the job (started here, or joined while it runs); the
        refused ones are answered at once (a split instance's engine has no pooled states
        on one rank: a 400 for each, its code `invalid_model`: the model's placement is
        at fault, not the input)."""
        tasks, self.waiting = self.waiting, []
        for task in tasks:
            self._send(TaskStatusReport(task_id=task.task_id, status=TaskRunning()))
        try:
            backend = engine.embedding_backend()
        except ValueError as error:  # a split instance: no pooled states on one rank
            for task in tasks:
                chunk = ErrorChunk(
                    command_id=task.command_id,
                    model=task.params.model,
                    error_message=str(error),
                    status_code=400,
                    error_code="invalid_model",
                )
                self._send_answer(task, chunk)
            return
        job = self.job or EmbeddingJob(backend)
        job.add(tasks)
        self._send_answers(job)
        self.job = None if job.done else job

    def run_piece(self, decoding: int) -> None:
        """Run one piece of the job, as many tokens as the pacer allows beside `decoding`
        streams, and send the answers it completed (nothing where it was cancelled whole)."""
        job = self.job
        if job is None:
            return  # cancelled whole
        budget = self.pacer.piece_tokens(decoding)
        if budget > 0:
            started = time.monotonic()
            computed = job.run_piece(budget)
            self.pacer.observe_piece(decoding, computed, time.monotonic() - started)
        self._send_answers(job)
        if job.done:
            self.job = None

    def cancel(self, task_id: TaskId) -> list[Embedding]:
        """Drop the task, waiting or in the job; the tasks dropped (the caller ends them:
        no answer follows)."""
        dropped = [waiting for waiting in self.waiting if waiting.task_id == task_id]
        for waiting in dropped:
            self.waiting.remove(waiting)
        if self.job is not None:
            running = self.job.cancel(task_id)
            if running is not None:  # dropped from its work: no answer follows
                dropped.append(running)
                if self.job.done:
                    self.job = None  # its works (and scratch memory) go with it
        return dropped

    def cancel_all(self) -> list[Embedding]:
        """Drop every task (the runner shuts down); the tasks dropped, waiting ones first."""
        dropped, self.waiting = self.waiting, []
        if self.job is not None:
            dropped += self.job.cancel_all()
            self.job = None
        return dropped

    def _send_answers(self, job: EmbeddingJob) -> None:
        for task, chunk in job.take_answers():
            self._send_answer(task, chunk)

    def _send_answer(self, task: Embedding, chunk: Chunk) -> None:
        self._send(ChunkReport(chunk=chunk))
        status: TaskStatus = (
            TaskFailed(error_message=chunk.error_message)
            if isinstance(chunk, ErrorChunk)
            else TaskComplete()
        )
        self._send(TaskStatusReport(task_id=task.task_id, status=status))
