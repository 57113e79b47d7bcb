"""What a failed generation's client is told: whether another rank of the group went away
(a 503 the API retries elsewhere) and the error code a dialect reports."""

from __future__ import annotations

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


def error_code_of(error: Exception) -> str | None:
    from exo.worker.engines.torch.engine import PromptTooLongError

    if isinstance(error, PromptTooLongError):
        return "context_length_exceeded"  # OpenAI's code for the same condition
    return None
