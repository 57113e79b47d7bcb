"""What the API's cluster client is configured with for requests that name a model
(`LoadOnRequest`), and the errors a command sent to the master ends in."""

from __future__ import annotations

from dataclasses import dataclass

from exo.api.serving.model_aliases import ModelAlias


@dataclass(frozen=True, slots=True)
class LoadOnRequest:
    """How this node's API loads models that requests name (`exo.api.serving.load_on_request`).

    Args:
        auto_place: place a model a request names when it has no instance
            (`--no-auto-place` turns this off).
        idle_unload_seconds: the keep-alive given to instances this node places and to
            those its requests use, unless a request says otherwise (`--idle-unload`);
            None: they stay until deleted.
        ready_timeout_seconds: how long a request waits for the instance it placed to load.
        offline: never download (`--offline`): Ollama's pull only finds files already here.
        model_aliases: client model names mapped to served models (`--model-alias`,
            `exo.api.serving.model_aliases`).
        load_failure_seconds: how long after a model failed to load for good
            (`State.load_failures`) requests for it are answered with that failure instead
            of placing it again (`exo.api.serving.load_on_request`).
    """

    auto_place: bool = True
    idle_unload_seconds: float | None = None
    ready_timeout_seconds: float = 600.0
    offline: bool = False
    model_aliases: tuple[ModelAlias, ...] = ()
    load_failure_seconds: float = 300.0


class CommandRejectedError(Exception):
    def __init__(self, reason: str, status_code: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status_code = status_code


class CommandTimeoutError(Exception):
    pass
