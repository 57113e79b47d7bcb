"""The runner: the subprocess that owns an engine and runs one shard of one instance.

It runs one generation at a time (first come, first served) and checks its inbound
pipe between decoded pieces, so a cancel or shutdown takes effect within one token.
A crash here never takes the node down: the supervisor sees the pipe close.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, ErrorChunk, TokenChunk, ToolCallChunk
from exo.shared.types.common import RunnerId
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
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
from exo.worker.engines.output_parsing import OutputParser
from exo.worker.engines.parsed_generation import OutputPiece, parse_generation
from exo.worker.runner.messages import (
    ChunkReport,
    RunnerInbound,
    RunnerOutbound,
    RunnerStatusReport,
    TaskStatusReport,
    runner_inbound_adapter,
)

if TYPE_CHECKING:
    import torch

    from exo.worker.engines.torch.engine import TorchEngine


# Bounds every collective: a rank that vanished without closing its sockets (a machine
# that lost power) fails the others after this long instead of hanging them.
GROUP_TIMEOUT_SECONDS = 60.0


class _ShutdownRequested(Exception):
    pass


class Runner:
    def __init__(
        self,
        runner_id: RunnerId,
        shard: ShardMetadata,
        inbound: Connection,
        outbound: Connection,
    ) -> None:
        self.runner_id = runner_id
        self.shard = shard
        self._inbound = inbound
        self._outbound = outbound
        self._engine: TorchEngine | None = None
        self._queue: deque[TextGeneration] = deque()
        self._status: RunnerStatus = RunnerIdle()
        self._ready = RunnerReady()

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
                    self._generate(self._queue.popleft())
                    continue
                self._handle(self._receive())
        except _ShutdownRequested:
            for task in self._queue:
                self._end_task(task, TaskCancelled())
            if self._engine is not None and self.shard.world_size > 1 and not self._is_follower:
                with contextlib.suppress(Exception):
                    self._engine.shutdown()  # releases the other ranks
            self._set_status(RunnerShutdown())

    # -- messages --------------------------------------------------------------------

    def _send(self, message: RunnerOutbound) -> None:
        self._outbound.send_bytes(message.model_dump_json().encode())

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
            case LoadModel(model_dir=model_dir):
                self._load(Path(model_dir))
            case StartWarmup():
                self._warm_up()
            case TextGeneration():
                self._queue.append(message)
            case CancelTask(task_id=task_id):
                for task in list(self._queue):
                    if task.task_id == task_id:
                        self._queue.remove(task)
                        self._end_task(task, TaskCancelled())
            case Shutdown():
                raise _ShutdownRequested()

    # -- lifecycle -------------------------------------------------------------------

    def _connect(self, task: ConnectToGroup) -> None:
        from exo.worker.engines.torch.distributed import init_group

        self._set_status(RunnerConnecting())
        try:
            init_group(
                task.backend,
                self.shard.device_rank,
                self.shard.world_size,
                task.master_addr,
                task.master_port,
                timeout_s=GROUP_TIMEOUT_SECONDS,
            )
        except Exception as error:
            logger.opt(exception=error).error(f"runner {self.runner_id}: joining the group failed")
            self._set_status(
                RunnerFailed(error_message=f"joining the process group failed: {error}")
            )
            return
        self._set_status(RunnerConnected())

    def _follow(self) -> None:
        """Serve rank 0's forward passes until it shuts the group down (or the group
        breaks: then this rank has failed and the instance starts over)."""
        assert self._engine is not None
        try:
            self._engine.serve_forever()
        except Exception as error:
            if _peer_failure(error):
                # Expected when a node of the instance dies: one line (traceback at -v).
                logger.warning(f"runner {self.runner_id}: another rank left the group")
                logger.opt(exception=error).debug(f"runner {self.runner_id}: the group broke")
            else:
                logger.opt(exception=error).error(f"runner {self.runner_id}: the group broke")
            self._set_status(RunnerFailed(error_message=f"process group failed: {error}"))
            return
        raise _ShutdownRequested()

    def _load(self, model_dir: Path) -> None:
        from exo.worker.engines.torch.engine import TorchEngine

        total_layers = self.shard.model_card.n_layers
        self._set_status(RunnerLoading(layers_loaded=0, total_layers=total_layers))

        def on_layer_loaded(loaded: int, total: int) -> None:
            self._set_status(RunnerLoading(layers_loaded=loaded, total_layers=total))

        try:
            self._engine = TorchEngine.load(model_dir, self.shard, on_layer_loaded=on_layer_loaded)
        except Exception as error:
            logger.opt(exception=error).error(f"runner {self.runner_id}: loading failed")
            self._set_status(RunnerFailed(error_message=f"loading failed: {error}"))
            return
        self._set_status(RunnerLoaded())

    def _warm_up(self) -> None:
        if self._engine is None:
            self._set_status(RunnerFailed(error_message="warm-up requested before loading"))
            return
        self._set_status(RunnerWarmingUp())
        started = time.perf_counter()
        try:
            self._engine.warmup()
        except Exception as error:
            logger.opt(exception=error).error(f"runner {self.runner_id}: warm-up failed")
            self._set_status(RunnerFailed(error_message=f"warm-up failed: {error}"))
            return
        logger.info(f"runner {self.runner_id}: warmed up in {time.perf_counter() - started:.1f}s")
        self._ready = RunnerReady(weight_bytes=parameter_bytes(self._engine.model))
        self._set_status(self._ready)

    # -- generation ------------------------------------------------------------------

    def _generate(self, task: TextGeneration) -> None:
        assert self._engine is not None, "generation is only started when ready"
        self._set_status(RunnerRunning())
        self._send(TaskStatusReport(task_id=task.task_id, status=TaskRunning()))
        try:
            prompt = self._engine.render_prompt(task.params)
        except Exception as error:
            self._fail_generation(task, error)
            return
        pieces = self._engine.generate(task.params, prompt)
        # A constrained request's output is the JSON document alone: no thinking section.
        # A raw prompt's output is returned as generated.
        constrained = task.params.forces_tool_call or task.params.response_format != "text"
        parser = OutputParser(
            tools=task.params.offered_tools,
            tool_call_format=prompt.tool_call_format,
            thinking_open=prompt.thinking_open and not constrained,
            forced_tool_call=task.params.forces_tool_call,
            parse_reasoning=not constrained and not task.params.is_raw,
        )
        # The first chunk tells the API the prompt's size (Claude reports it up front).
        prompt_tokens: int | None = len(prompt.token_ids)
        try:
            for piece in parse_generation(pieces, parser, task.params):
                self._send_piece(task, piece, prompt_tokens)
                prompt_tokens = None
                if piece.finish_reason is not None:
                    break
                if self._cancelled_while_running(task):
                    pieces.close()
                    self._end_task(task, TaskCancelled())
                    self._set_status(self._ready)
                    return
        except _ShutdownRequested:
            pieces.close()
            self._end_task(task, TaskCancelled())
            raise
        except Exception as error:
            pieces.close()
            self._fail_generation(task, error)
            return
        else:
            self._send(TaskStatusReport(task_id=task.task_id, status=TaskComplete()))
        self._set_status(self._ready)

    def _send_piece(
        self, task: TextGeneration, piece: OutputPiece, prompt_tokens: int | None = None
    ) -> None:
        """One parsed piece as chunks: its text (with its tokens), then its tool calls; the
        finish always rides on a final `TokenChunk`. `prompt_tokens` (first piece only)
        rides on a `TokenChunk` sent first."""
        model = task.params.model
        has_text = bool(piece.text or piece.reasoning_text or piece.token_ids)
        finishes_here = piece.finish_reason is not None and not piece.tool_calls
        if has_text or finishes_here or prompt_tokens is not None:
            self._send(
                ChunkReport(
                    chunk=TokenChunk(
                        command_id=task.command_id,
                        model=model,
                        text=piece.text,
                        reasoning_text=piece.reasoning_text,
                        token_ids=piece.token_ids,
                        logprobs=piece.logprobs,
                        finish_reason=None if piece.tool_calls else piece.finish_reason,
                        usage=None if piece.tool_calls else piece.usage,
                        stop_sequence=None if piece.tool_calls else piece.stop_sequence,
                        prompt_tokens=prompt_tokens,
                    )
                )
            )
        if not piece.tool_calls:
            return
        self._send(
            ChunkReport(
                chunk=ToolCallChunk(
                    command_id=task.command_id, model=model, tool_calls=tuple(piece.tool_calls)
                )
            )
        )
        if piece.finish_reason is not None:
            self._send(
                ChunkReport(
                    chunk=TokenChunk(
                        command_id=task.command_id,
                        model=model,
                        text="",
                        finish_reason=piece.finish_reason,
                        usage=piece.usage,
                    )
                )
            )

    def _fail_generation(self, task: TextGeneration, error: Exception) -> None:
        """Report a failed generation; a ValueError means the request was at fault (prompt
        longer than the context, a conversation the template refuses): a 400."""
        bad_request = isinstance(error, ValueError)
        peer_left = self.shard.world_size > 1 and not bad_request and _peer_failure(error)
        message, status_code, error_code = str(error), 500, _error_code(error)
        if bad_request:
            logger.info(f"runner {self.runner_id}: request refused: {error}")
            status_code = 400
        elif peer_left:
            # A rank's node died: expected, one line (traceback at -v); the client gets a
            # 503 that the API retries elsewhere, never the library's message.
            logger.warning(
                f"runner {self.runner_id}: another rank left the group; "
                f"generation {task.task_id} stopped"
            )
            logger.opt(exception=error).debug(f"runner {self.runner_id}: generation failed")
            message = (
                f"instance of {task.params.model} is unavailable: another rank of this split "
                "instance left (its node stopped or lost its link); re-placing"
            )
            status_code, error_code = 503, INSTANCE_UNAVAILABLE
        else:
            logger.opt(exception=error).warning(f"runner {self.runner_id}: generation failed")
        self._send(
            ChunkReport(
                chunk=ErrorChunk(
                    command_id=task.command_id,
                    model=task.params.model,
                    error_message=message,
                    status_code=status_code,
                    error_code=error_code,
                )
            )
        )
        self._send(
            TaskStatusReport(task_id=task.task_id, status=TaskFailed(error_message=str(error)))
        )
        if self.shard.world_size > 1 and not bad_request:
            self._set_status(RunnerFailed(error_message=f"process group failed: {error}"))
            return
        self._set_status(self._ready)

    def _cancelled_while_running(self, running: TextGeneration) -> bool:
        """Handle every message that arrived meanwhile; True if `running` was cancelled."""
        cancelled = False
        while self._inbound.poll(0):
            message = self._receive()
            if isinstance(message, CancelTask) and message.task_id == running.task_id:
                cancelled = True
            else:
                self._handle(message)
        return cancelled

    def _end_task(self, task: TextGeneration, status: TaskStatus) -> None:
        """End a task that did not run to completion; its stream gets a final chunk."""
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


# What gloo and torch.distributed say when another rank's process or link goes away.
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
    "timed out",
)


def _peer_failure(error: BaseException) -> bool:
    """Whether `error` is another rank of the process group going away (its node died or
    lost its link), as opposed to a failure of this rank's own computation."""
    import torch.distributed

    if isinstance(error, torch.distributed.DistError):
        return True
    return any(marker in str(error) for marker in _PEER_FAILURE_MARKERS)


def _error_code(error: Exception) -> str | None:
    from exo.worker.engines.torch.engine import PromptTooLongError

    if isinstance(error, PromptTooLongError):
        return "context_length_exceeded"  # OpenAI's code for the same condition
    return None


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers actually held (meta tensors are placeholders)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """A runner whose node was killed (SIGKILL, OOM) must not go on serving its shard:
    ask Linux to kill it when its parent dies, and exit at once if that already happened."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def runner_main(
    runner_id: str, shard_json: str, inbound: Connection, outbound: Connection, log_level: str
) -> None:
    """Entry point of the spawned runner process."""
    from pydantic import TypeAdapter

    # Ctrl-C reaches the whole process group; the node shuts runners down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    logger.remove()
    logger.add(sys.stderr, level=log_level, format="{time:HH:mm:ss} runner | {level} | {message}")
    shard: ShardMetadata = TypeAdapter(ShardMetadata).validate_json(shard_json)
    Runner(RunnerId(runner_id), shard, inbound, outbound).run()
