"""What a failed generation's client is told (`generation_failure`): a 400 where the request
was at fault, a 503 the API retries elsewhere where another rank of the group went away, else
a 500; the error code a dialect reports; whether the failure broke a split instance's group;
whether a failed load or warm-up is the model's own (`load_failure`)."""

from __future__ import annotations

from loguru import logger

from exo.shared.types.chunks import INSTANCE_UNAVAILABLE, ErrorChunk
from exo.shared.types.common import RunnerId
from exo.shared.types.runners import RunnerFailed
from exo.shared.types.tasks import TextGeneration

# What gloo and torch.distributed say when another rank's process or link goes away.
PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "Timed out waiting",
    "timed out",
)


def peer_failure(error: BaseException) -> bool:
    """Whether `error` is another rank of the process group going away (its node died or
    lost its link), as opposed to a failure of this rank's own computation."""
    import torch.distributed

    if isinstance(error, torch.distributed.DistError):
        return True
    return any(marker in str(error) for marker in PEER_FAILURE_MARKERS)


# What torch says when an allocation fails (CPU: "DefaultCPUAllocator: can't allocate
# memory"; CUDA: "CUDA out of memory"): memory that other work may free.
OUT_OF_MEMORY_MARKERS = ("can't allocate memory", "out of memory")


def load_failure_is_permanent(error: BaseException) -> bool:
    """Whether `error`, raised while loading or warming up a model, is the model's own (a
    tensor of the wrong shape, a config or checkpoint the engine refuses), so loading it
    again the same way fails again (`RunnerFailed.permanent`). Not so: running out of
    memory (others may free it), another rank going away (`peer_failure`), and an
    operating-system error (a file unreadable now, a full disk), which may all pass."""
    import torch

    if isinstance(error, MemoryError | torch.OutOfMemoryError | OSError):
        return False
    if any(marker in str(error) for marker in OUT_OF_MEMORY_MARKERS):
        return False
    return not peer_failure(error)


def load_failure(stage: str, error: Exception) -> RunnerFailed:
    """The status of a runner whose `stage` ("loading", "warm-up") raised `error`."""
    return RunnerFailed(
        error_message=f"{stage} failed: {error}", permanent=load_failure_is_permanent(error)
    )


def error_code_of(error: Exception) -> str | None:
    from exo.worker.engines.torch.engine_requests import PromptTooLongError

    if isinstance(error, PromptTooLongError):
        return "context_length_exceeded"  # OpenAI's code for the same condition
    return None


def generation_failure(
    task: TextGeneration, error: Exception, runner_id: RunnerId, split: bool
) -> tuple[ErrorChunk, bool]:
    """The error chunk a failed generation's client gets (the failure logged once), and
    whether it broke the group (`split`: a multi-rank instance; any failure but the
    request's own). A ValueError means the request was at fault (prompt longer than the
    context, a conversation the template refuses): a 400."""
    bad_request = isinstance(error, ValueError)
    peer_left = split and not bad_request and peer_failure(error)
    message, status_code, error_code = str(error), 500, error_code_of(error)
    if bad_request:
        logger.info(f"runner {runner_id}: request refused: {error}")
        status_code = 400
    elif peer_left:
        # A rank's node died: expected, one line (traceback at -v); the client gets a
        # 503 that the API retries elsewhere, never the library's message.
        logger.warning(
            f"runner {runner_id}: another rank left the group; generation {task.task_id} stopped"
        )
        logger.opt(exception=error).debug(f"runner {runner_id}: generation failed")
        message = (
            f"instance of {task.params.model} is unavailable: another rank of this split "
            "instance left (its node stopped or lost its link); re-placing"
        )
        status_code, error_code = 503, INSTANCE_UNAVAILABLE
    else:
        logger.opt(exception=error).warning(f"runner {runner_id}: generation failed")
    chunk = ErrorChunk(
        command_id=task.command_id,
        model=task.params.model,
        error_message=message,
        status_code=status_code,
        error_code=error_code,
    )
    return chunk, split and not bad_request
