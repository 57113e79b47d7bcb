"""The repositories the Hub stand-in (`exo.testing.hf_server`) serves: `HubRepository` at
one commit, its `HubFile`s and the identifiers the Hub reports for them (git blob id,
SHA-256, ETag, whether a file is stored in LFS).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

# Files the Hub stores in LFS (Xet) rather than git: weights, and anything large.
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".onnx", ".msgpack", ".h5")
LFS_MIN_BYTES = 10 * 2**20


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (SHA-1 of `blob <size>\\0` + content)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True, slots=True)
class HubFile:
    """One file of a repository and the identifiers the Hub reports for it."""

    path: str
    data: bytes

    @property
    def is_lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES) or len(self.data) >= LFS_MIN_BYTES

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.data)

    @property
    def etag(self) -> str:
        """The Hub's ETag: the SHA-256 for LFS files, the git blob id for the others."""
        return self.sha256 if self.is_lfs else self.blob_id


@dataclass(slots=True)
class HubRepository:
    """A model repository at one commit.

    Args:
        gated: what the model info says (`False`, `"auto"`, `"manual"`).
        tokens: when not None, the tokens allowed to read its files (see the module doc).
    """

    repo_id: str
    files: dict[str, HubFile]
    gated: Literal[False, "auto", "manual"] = False
    tokens: frozenset[str] | None = None
    sha: str = ""

    def __post_init__(self) -> None:
        if not self.sha:
            digest = hashlib.sha1(self.repo_id.encode())
            for path in sorted(self.files):
                digest.update(path.encode() + b"\0" + self.files[path].blob_id.encode())
            self.sha = digest.hexdigest()

    def has_revision(self, revision: str) -> bool:
        return revision in ("main", self.sha)
