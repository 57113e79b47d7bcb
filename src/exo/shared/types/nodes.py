"""What a node reports about itself."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import FrozenModel


class MemoryInfo(FrozenModel):
    """Bytes of RAM; `available_bytes` is what a new model may use."""

    total_bytes: int = Field(ge=0)
    available_bytes: int = Field(ge=0)


class NodeInfo(FrozenModel):
    friendly_name: str
    memory: MemoryInfo
    cpu_model: str = ""
    cpu_cores: int = Field(default=1, ge=1)


class DownloadPending(FrozenModel):
    kind: Literal["DownloadPending"] = "DownloadPending"


class DownloadOngoing(FrozenModel):
    kind: Literal["DownloadOngoing"] = "DownloadOngoing"
    message: str = ""


class DownloadCompleted(FrozenModel):
    kind: Literal["DownloadCompleted"] = "DownloadCompleted"
    path: str


class DownloadFailed(FrozenModel):
    kind: Literal["DownloadFailed"] = "DownloadFailed"
    error_message: str


DownloadStatus = Annotated[
    DownloadPending | DownloadOngoing | DownloadCompleted | DownloadFailed,
    Field(discriminator="kind"),
]
