"""Download progress as the cluster state carries it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo.shared.types.common import FrozenModel


class FileProgress(FrozenModel):
    """One file: `downloaded_bytes` of `total_bytes` on disk (a resumed file starts at
    what its partial file held); `sha256` the digest it is checked against, when its
    source publishes one (the Hub's LFS files)."""

    path: str
    downloaded_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    source: str = "hub"
    sha256: str | None = None


class DownloadProgress(FrozenModel):
    """A download's state: totals over its files, `speed_bytes_per_second` averaged over
    this download's transfers (bytes received / seconds since it started), `eta_seconds`
    None until a byte arrived. `complete` only once every file is verified in place."""

    downloaded_bytes: int = Field(ge=0)
    total_bytes: int = Field(ge=0)
    speed_bytes_per_second: float = Field(ge=0)
    eta_seconds: float | None = Field(default=None, ge=0)
    files: tuple[FileProgress, ...] = ()
    complete: bool = False


DownloadAction = Literal["start", "cancel", "delete"]
"""What a node is asked to do with a model's files: fetch them all, stop fetching them
(partial files stay), remove them from its writable models directory."""
