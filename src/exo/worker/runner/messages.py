"""Messages between a runner subprocess and its supervisor (JSON over a pipe).

Runner -> supervisor framing: every pipe message is a JSON array of `RunnerOutbound`
messages, in order (`encode_outbound` / `decode_outbound`). The runner sends everything one
engine step produced for all its running requests (their chunks, finished tasks' statuses,
its own status) as one pipe message, so the supervisor wakes once per step, not once per
request per token. Supervisor -> runner: one `RunnerInbound` per pipe message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import Field, TypeAdapter

from exo.shared.types.chunks import Chunk
from exo.shared.types.common import FrozenModel, TaskId
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    Embedding,
    LoadModel,
    Shutdown,
    StartWarmup,
    TaskStatus,
    TextGeneration,
)


class RunnerStatusReport(FrozenModel):
    kind: Literal["RunnerStatusReport"] = "RunnerStatusReport"
    status: RunnerStatus


class TaskStatusReport(FrozenModel):
    kind: Literal["TaskStatusReport"] = "TaskStatusReport"
    task_id: TaskId
    status: TaskStatus


class KVCacheReport(FrozenModel):
    """The runner's KV cache now, in budget tokens (`kv_footprint.KVFootprint`: a
    sliding-window layer counts the positions it keeps): held by running requests, by the
    prefix cache, and the budget they share (`BatchScheduler.budget_tokens`). Sent after
    engine steps, at most every `KV_REPORT_INTERVAL_S` while it changes; stays on the node
    (`/metrics`)."""

    kind: Literal["KVCacheReport"] = "KVCacheReport"
    running_tokens: int = Field(ge=0)
    prefix_cache_tokens: int = Field(ge=0)
    budget_tokens: int = Field(ge=0)


class ChunkReport(FrozenModel):
    kind: Literal["ChunkReport"] = "ChunkReport"
    chunk: Chunk


RunnerOutbound = Annotated[
    RunnerStatusReport | TaskStatusReport | ChunkReport | KVCacheReport,
    Field(discriminator="kind"),
]
RunnerInbound = Annotated[
    ConnectToGroup | LoadModel | StartWarmup | TextGeneration | Embedding | CancelTask | Shutdown,
    Field(discriminator="kind"),
]

runner_outbound_adapter: TypeAdapter[RunnerOutbound] = TypeAdapter(RunnerOutbound)
runner_inbound_adapter: TypeAdapter[RunnerInbound] = TypeAdapter(RunnerInbound)
_outbound_batch_adapter: TypeAdapter[list[RunnerOutbound]] = TypeAdapter(list[RunnerOutbound])


def encode_outbound(messages: Sequence[RunnerOutbound]) -> bytes:
    """One pipe message carrying `messages` (at least one), in order: a JSON array."""
    return b"[" + b",".join(message.model_dump_json().encode() for message in messages) + b"]"


def decode_outbound(raw: bytes) -> list[RunnerOutbound]:
    """The messages of one pipe message, in the order they were sent.

    Raises:
        pydantic.ValidationError: `raw` is not a JSON array of runner messages.
    """
    return _outbound_batch_adapter.validate_json(raw)
