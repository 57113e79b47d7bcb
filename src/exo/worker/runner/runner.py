"""The runner: the subprocess that owns an engine and runs one shard of one instance.

Once ready it hands every generation task to the engine at once (`submit`) and loops over
`engine.step()`, each step advancing every running request by one token (continuous
batching: a single-rank engine runs up to `max_concurrent_requests` at once, queueing the
rest). What a step produces for all its requests (chunks, ended tasks, status) goes to the
supervisor as one pipe message. Between steps it reads its inbound pipe without blocking,
so a new request joins and a cancel or shutdown takes effect at the next step. Embedding
and rerank tasks are answered a piece at a time between two steps of the running streams
(`embedding_turns.py`); a cancel stops them between pieces. A request that fails alone
(the request was at fault) fails only itself (`failures.py` words what its client is
told). A crash here never takes the node down: the supervisor sees the pipe close. The
steps before serving (joining the group, loading, warming up) are `engine_lifecycle.py`'s."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from exo.shared.types.chunks import (
    TokenChunk,
)
from exo.shared.types.common import InstanceId, RunnerId, TaskId
from exo.shared.types.runners import (
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    Embedding,
    LoadModel,
    Shutdown,
    StartWarmup,
    TaskCancelled,
    TaskComplete,
    TaskFailed,
    TaskRunning,
    TaskStatus,
    TextGeneration,
)
from exo.utils.heap import HeapTrimmer
from exo.worker.engines.parsed_generation import OutputPiece
from exo.worker.runner.embedding_turns import EmbeddingTurns
from exo.worker.runner.engine_lifecycle import join_group, load_engine, speculation_stats, warm_up
from exo.worker.runner.failures import generation_failure, peer_failure
from exo.worker.runner.generation_feed import Generation, parsed_output, replay_forced_pieces
from exo.worker.runner.messages import (
    ChunkReport,
    KVCacheReport,
    RunnerInbound,
    RunnerOutbound,
    RunnerStatusReport,
    TaskStatusReport,
    encode_outbound,
    runner_inbound_adapter,
)
from exo.worker.runner.options import RunnerOptions
from exo.worker.runner.piece_chunks import piece_chunks
from exo.worker.runner.stream_grouping import ChunkGrouper

if TYPE_CHECKING:
    from exo.worker.engines.torch.engine_factory import Engine


# The runner's KV-cache use reaches the node's /metrics at most this often while it changes
# (a scrape every 15 s or so needs no more; each report is one small pipe message).
KV_REPORT_INTERVAL_S = 1.0
# While a runner generates, its speculative-decoding counts reach the cluster state (a
# status event through the master's log) at most this often; at once when its batch empties.
SPECULATION_REPORT_INTERVAL_S = 10.0
# How often an idle runner whose drafts come over a link re-checks that link for the state.
DRAFT_LINK_CHECK_S = 2.0
# Freed heap memory goes back to the OS at most this often while serving (and on going
# idle): see `exo.utils.heap` (the soak's runner RSS crept up with heap holes).
HEAP_TRIM_INTERVAL_SECONDS = 30.0


class _ShutdownRequested(Exception):
    """The supervisor asked this runner to shut down."""


class Runner:
    def __init__(
        self,
        runner_id: RunnerId,
        shard: ShardMetadata,
        inbound: Connection,
        outbound: Connection,
        options: RunnerOptions | None = None,
    ) -> None:
        self.runner_id = runner_id
        self.shard = shard
        self._inbound = inbound
        self._outbound = outbound
        self._engine: Engine | None = None
        self._queue: deque[TextGeneration] = deque()  # arrived before the engine was ready
        self._embeddings = EmbeddingTurns(self._send)
        self._generations: dict[str, Generation] = {}  # by task id (the engine's request id)
        self._status: RunnerStatus = RunnerIdle()
        self._ready = RunnerReady()
        self._options = options or RunnerOptions()
        self._card_mismatches: tuple[str, ...] = ()  # what the loaded model's files contradict
        self._kv_reported: tuple[int, int, int] | None = None
        self._kv_reported_at = float("-inf")
        self._speculation_reported_at = float("-inf")
        # Messages held while a step runs (`_holding`), sent together when it ends.
        self._unsent: list[RunnerOutbound] = []
        self._holding = False
        self._heap_trimmer = HeapTrimmer(HEAP_TRIM_INTERVAL_SECONDS)
        # A fast stream's token chunks leave grouped (stream_grouping.py); the last step's
        # duration tells it whether the next chunk comes soon.
        self._grouper = ChunkGrouper(
            self._options.stream_interval_seconds,
            lambda chunk: self._send(ChunkReport(chunk=chunk)),
        )
        self._last_step_seconds = 0.0

    @property
    def _is_follower(self) -> bool:
        """A rank other than 0 of a multi-rank instance: rank 0 drives its forward passes."""
        return self.shard.world_size > 1 and self.shard.device_rank != 0

    def run(self) -> None:
        self._set_status(RunnerIdle())
        try:
            while True:
                if isinstance(self._status, RunnerFailed):
                    return  # the supervisor reports it; a broken group is not reused
                if self._is_follower and isinstance(self._status, RunnerReady):
                    self._follow()
                    continue
                if self._queue and isinstance(self._status, RunnerReady | RunnerRunning):
                    self._start_generation(self._queue.popleft())
                    continue
                if self._embeddings.waiting and isinstance(
                    self._status, RunnerReady | RunnerRunning
                ):
                    self._take_embeddings()
                    continue
                if self._embeddings.job is not None:
                    self._run_embedding_piece()
                    if self._generations:  # the running streams' step between two pieces
                        self._run_step()
                        self._heap_trimmer.maybe_trim()
                    continue
                if self._generations:
                    self._run_step()
                    self._heap_trimmer.maybe_trim()
                    continue
                self._heap_trimmer.maybe_trim(force=True)  # going idle
                self._wait_for_a_message()
                self._handle(self._receive())
        except _ShutdownRequested:
            for generation in list(self._generations.values()):
                self._end_task(generation.task, TaskCancelled())
            self._generations.clear()
            for task in self._queue:
                self._end_task(task, TaskCancelled())
            for waiting in self._embeddings.cancel_all():
                self._end_task(waiting, TaskCancelled())
            if self._engine is not None and self.shard.world_size > 1 and not self._is_follower:
                with contextlib.suppress(Exception):
                    self._engine.shutdown()  # releases the other ranks
            self._set_status(RunnerShutdown())

    def _wait_for_a_message(self) -> None:
        """Idle: return once a message waits in the pipe. A runner drafting over a link
        meanwhile re-checks it every `DRAFT_LINK_CHECK_S`, so a draft node lost (or back)
        while no request runs shows in the state (`SpeculationStats.draft_connected`)."""
        while self._watches_draft_link() and not self._inbound.poll(DRAFT_LINK_CHECK_S):
            self._update_status()

    def _watches_draft_link(self) -> bool:
        """Whether, idle, this runner re-checks its draft link (its engine drafts over one
        and has reported speculation counts, which carry the link's state)."""
        return (
            isinstance(self._status, RunnerReady)
            and getattr(self._engine, "draft_connected", None) is not None
            and self._ready.speculation is not None
        )

    def _send(self, message: RunnerOutbound) -> None:
        """Send `message` now, or with the rest of the step's output while a step runs."""
        self._unsent.append(message)
        if not self._holding:
            self._flush()

    def _flush(self) -> None:
        if self._unsent:
            messages, self._unsent = self._unsent, []
            self._outbound.send_bytes(encode_outbound(messages))

    def _receive(self) -> RunnerInbound:
        try:
            raw = self._inbound.recv_bytes()
        except EOFError:
            # The supervisor is gone; nobody can use our output any more.
            raise _ShutdownRequested() from None
        return runner_inbound_adapter.validate_json(raw)

    def _set_status(self, status: RunnerStatus) -> None:
        self._status = status
        self._send(RunnerStatusReport(status=status))

    def _handle(self, message: RunnerInbound) -> None:
        match message:
            case ConnectToGroup():
                self._connect(message)
            case LoadModel(model_dir=model_dir, instance_id=instance_id):
                self._load(Path(model_dir), instance_id)
            case StartWarmup():
                self._warm_up()
            case TextGeneration():
                if isinstance(self._status, RunnerReady | RunnerRunning) and not self._queue:
                    self._start_generation(message)
                else:
                    self._queue.append(message)
            case Embedding():
                self._embeddings.waiting.append(message)
            case CancelTask(task_id=task_id):
                self._cancel(task_id)
            case Shutdown():
                raise _ShutdownRequested()

    # -- lifecycle -------------------------------------------------------------------

    def _connect(self, task: ConnectToGroup) -> None:
        self._set_status(RunnerConnecting())
        self._set_status(join_group(task, self.shard, self._options, self.runner_id))

    def _follow(self) -> None:
        """Serve rank 0's forward passes until it shuts the group down (or the group
        breaks: then this rank has failed and the instance starts over)."""
        assert self._engine is not None
        try:
            self._engine.serve_forever()
        except Exception as error:
            if peer_failure(error):
                # Expected when a node of the instance dies: one line (traceback at -v).
                logger.warning(f"runner {self.runner_id}: another rank left the group")
                logger.opt(exception=error).debug(f"runner {self.runner_id}: the group broke")
            else:
                logger.opt(exception=error).error(f"runner {self.runner_id}: the group broke")
            self._set_status(RunnerFailed(error_message=f"process group failed: {error}"))
            return
        raise _ShutdownRequested()

    def _load(self, model_dir: Path, instance_id: InstanceId) -> None:
        loaded = load_engine(
            model_dir, self.shard, self._options, instance_id, self.runner_id, self._set_status
        )
        if isinstance(loaded, RunnerFailed):
            self._set_status(loaded)
            return
        self._engine, self._card_mismatches = loaded
        self._set_status(RunnerLoaded())

    def _warm_up(self) -> None:
        if self._engine is None:
            self._set_status(RunnerFailed(error_message="warm-up requested before loading"))
            return
        self._set_status(RunnerWarmingUp())
        warmed = warm_up(self._engine, self.runner_id, self._card_mismatches)
        if isinstance(warmed, RunnerReady):
            self._ready = warmed
        self._set_status(warmed)

    # -- generation ------------------------------------------------------------------

    def _start_generation(self, task: TextGeneration) -> None:
        """Hand a task to the engine (it joins the batch at the next step); a request the
        engine refuses (too long, a template refusal) fails alone with a 400."""
        assert self._engine is not None, "generation is only started when ready"
        self._send(TaskStatusReport(task_id=task.task_id, status=TaskRunning()))
        try:
            prompt = self._engine.render_prompt(task.params)
            handle = self._engine.submit(task.params, prompt, request_id=str(task.task_id))
        except Exception as error:
            self._fail_generation(task, error)
            self._update_status()
            return
        feed, parsed = parsed_output(task.params, prompt)
        try:
            replay_forced_pieces(feed, parsed, handle.forced_pieces)
        except Exception as error:
            self._engine.cancel(handle.request_id)
            self._fail_generation(task, ValueError(f"the forced tokens do not parse: {error}"))
            self._update_status()
            return
        self._generations[str(task.task_id)] = Generation(
            task,
            handle.prompt_tokens,
            feed,
            parsed,
            cached_tokens=lambda: handle.cached_tokens,
            prefill_progress=lambda: handle.prefill_progress,
        )
        self._update_status()

    def _take_embeddings(self) -> None:
        """Take every embedding task waiting (those in the pipe included) into the job
        (`EmbeddingTurns.take`)."""
        assert self._engine is not None, "embeddings are only answered when ready"
        self._holding = True
        try:
            self._handle_waiting_messages()
            self._embeddings.take(self._engine)
        finally:
            self._holding = False
            self._flush()

    def _run_embedding_piece(self) -> None:
        """Take the messages that arrived (a cancel among them), then run one piece of the
        embedding job (`EmbeddingTurns.run_piece`)."""
        self._holding = True
        try:
            self._handle_waiting_messages()
            self._embeddings.run_piece(len(self._generations))
        finally:
            self._holding = False
            self._flush()

    def _run_step(self) -> None:
        """Take the messages that arrived, then run one step; everything both produce (for
        every request) leaves as one pipe message at the end. Then the KV of the requests
        that finished enters the prefix cache (their last pieces are out by then)."""
        self._holding = True
        try:
            self._handle_waiting_messages()
            if self._generations:
                self._step()
        finally:
            self._holding = False
            self._flush()
        if self._engine is not None and self._engine.store_finished():
            self._report_kv_cache(force=not self._generations)  # KV moved to the prefix cache

    def _step(self) -> None:
        """One engine step; stream each request's pieces, end the finished ones."""
        assert self._engine is not None
        rows = len(self._generations)
        decode_only = all(generation.first_sent for generation in self._generations.values())
        started = time.monotonic()
        try:
            outputs = self._engine.step()
        except Exception as error:  # the step failed: every request in it fails
            # Each leaves the engine too (the engine drops its running ones; a queued one
            # would otherwise run later for nobody), so the next request meets a clean batch.
            for request_id, failed in list(self._generations.items()):
                with contextlib.suppress(Exception):  # a broken engine: report them anyway
                    self._engine.cancel(request_id)
                self._fail_generation(failed.task, error)
            self._generations.clear()
            if not isinstance(self._status, RunnerFailed):
                self._update_status()
            return
        self._last_step_seconds = time.monotonic() - started
        if decode_only:  # the base of an embedding piece's gap (`EmbeddingPacer`)
            self._embeddings.pacer.observe_step(rows, self._last_step_seconds)
        for request_id, output in outputs:
            generation = self._generations.get(request_id)
            if generation is None:
                continue
            if isinstance(output, Exception):
                del self._generations[request_id]
                self._fail_generation(generation.task, output)
                continue
            try:
                generation.feed.piece = output
                piece = next(generation.parsed)
            except Exception as error:
                self._engine.cancel(request_id)
                del self._generations[request_id]
                self._fail_generation(generation.task, error)
                continue
            if generation.first_sent:
                self._send_piece(generation.task, piece)
            else:
                cached = generation.cached_tokens()
                self._send_piece(generation.task, piece, generation.prompt_tokens, cached)
            generation.first_sent = True
            if piece.finish_reason is not None:
                del self._generations[request_id]
                self._grouper.forget(generation.task.command_id)  # nothing is held by now
                self._send(TaskStatusReport(task_id=generation.task.task_id, status=TaskComplete()))
        self._report_prefill_progress()
        if not isinstance(self._status, RunnerFailed):
            self._update_status()
        self._report_kv_cache(force=not self._generations)

    def _report_prefill_progress(self) -> None:
        """A `PrefillProgressChunk` for each request still without its first token, when
        due (`Generation.progress_chunk`)."""
        now = time.monotonic()
        for generation in self._generations.values():
            chunk = generation.progress_chunk(now)
            if chunk is not None:
                self._send(ChunkReport(chunk=chunk))

    def _report_kv_cache(self, force: bool = False) -> None:
        """Tell the supervisor the KV cache's use (for the node's `/metrics`) when it changed:
        at most every `KV_REPORT_INTERVAL_S`, or at once when `force` (the batch emptied)."""
        now = time.monotonic()
        if not force and now - self._kv_reported_at < KV_REPORT_INTERVAL_S:
            return
        usage = self._engine.kv_cache_usage() if self._engine is not None else None
        if usage is None or usage == self._kv_reported:
            return
        self._kv_reported, self._kv_reported_at = usage, now
        running, cached, budget = usage
        self._send(
            KVCacheReport(running_tokens=running, prefix_cache_tokens=cached, budget_tokens=budget)
        )

    def _update_status(self) -> None:
        """RunnerRunning while any generation runs, else ready (reported on change), with
        the speculative-decoding counts (`speculation_stats`; while running at most every
        `SPECULATION_REPORT_INTERVAL_S`)."""
        if isinstance(self._status, RunnerFailed):
            return
        now = time.monotonic()
        if (
            self._generations
            and isinstance(self._status, RunnerRunning)
            and now - self._speculation_reported_at < SPECULATION_REPORT_INTERVAL_S
        ):
            return  # unchanged (a step's common case: no status built and compared)
        self._speculation_reported_at = now
        speculation = speculation_stats(self._engine)
        if speculation != self._ready.speculation:
            self._ready = self._ready.model_copy(update={"speculation": speculation})
        status: RunnerStatus = (
            RunnerRunning(
                weight_bytes=self._ready.weight_bytes,
                max_concurrent_requests=self._ready.max_concurrent_requests,
                kv_cache_tokens=self._ready.kv_cache_tokens,
                card_mismatches=self._ready.card_mismatches,
                speculation=speculation,
                draft_model=self._ready.draft_model,
                draft_left_out=self._ready.draft_left_out,
            )
            if self._generations
            else self._ready
        )
        if status != self._status:
            self._set_status(status)

    def _cancel(self, task_id: str) -> None:
        """End a queued or running task with a final "cancelled" chunk."""
        for task in list(self._queue):
            if task.task_id == task_id:
                self._queue.remove(task)
                self._end_task(task, TaskCancelled())
        for dropped in self._embeddings.cancel(TaskId(task_id)):
            self._end_task(dropped, TaskCancelled())
        generation = self._generations.pop(str(task_id), None)
        if generation is not None:
            if self._engine is not None:
                self._engine.cancel(str(task_id))
            self._end_task(generation.task, TaskCancelled())
            self._update_status()
            # No step may follow (the batch emptied): the node's /metrics learns it now.
            self._report_kv_cache(force=not self._generations)

    def _handle_waiting_messages(self) -> None:
        """Handle every message that arrived since the last step, without blocking."""
        while self._inbound.poll(0):
            self._handle(self._receive())

    def _send_piece(
        self,
        task: TextGeneration,
        piece: OutputPiece,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """One parsed piece as chunks (`piece_chunks`): its text chunk grouped per stream,
        what follows it (tool calls, then the finish) sent at once."""
        chunks = piece_chunks(task, piece, prompt_tokens, cached_tokens)
        if chunks.text is not None:
            self._grouper.token_chunk(chunks.text, not piece.tool_calls, self._last_step_seconds)
        elif piece.tool_calls:
            self._grouper.release(task.command_id)
        for chunk in chunks.after:
            self._send(ChunkReport(chunk=chunk))

    def _fail_generation(self, task: TextGeneration, error: Exception) -> None:
        """Report a failed generation (worded by `failures.generation_failure`: a 400 where
        the request was at fault); a failure that broke the group fails this runner, once: a
        step whose batch held several generations fails each of them with the same broken
        group, and the state counts every `RunnerFailed` report as one failure of the
        instance (`apply._instance_failures`), so one break reported per generation could
        reach `MAX_INSTANCE_FAILURES` and delete the instance before the master, seeing the
        node lost, places it again on the nodes that remain."""
        chunk, group_broke = generation_failure(
            task, error, self.runner_id, self.shard.world_size > 1
        )
        self._grouper.forget(task.command_id)
        self._send(ChunkReport(chunk=chunk))
        self._send(
            TaskStatusReport(task_id=task.task_id, status=TaskFailed(error_message=str(error)))
        )
        if group_broke and not isinstance(self._status, RunnerFailed):
            self._set_status(RunnerFailed(error_message=f"process group failed: {error}"))

    def _end_task(self, task: TextGeneration | Embedding, status: TaskStatus) -> None:
        """End a task that did not run to completion; its stream gets a final chunk."""
        self._grouper.forget(task.command_id)
        self._send(
            ChunkReport(
                chunk=TokenChunk(
                    command_id=task.command_id,
                    model=task.params.model,
                    text="",
                    finish_reason="cancelled",
                )
            )
        )
        self._send(TaskStatusReport(task_id=task.task_id, status=status))
