"""A model directory's completion marker (`.exo-complete`, JSON), written last and
atomically: the repository, its commit, every file's size and the files verified in the
directory. A directory is ready for a shard only when its marker lists every file the
shard needs (`missing_files`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from exo.download.hub_listing import HubDownloadError
from exo.download.shard_files import INDEX_FILE, small_files, weight_files_for_shard
from exo.shared.types.shards import ShardMetadata

COMPLETION_MARKER = ".exo-complete"


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The directory's completion marker, or None when there is none (or it is unreadable)."""
    try:
        content = json.loads((directory / COMPLETION_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def missing_files(directory: Path, shard: ShardMetadata | None) -> list[str] | None:
    """The files `shard` (None: the whole model) needs that `directory`'s marker does not
    list as verified: `[]` when ready. None when the directory has no marker that lists
    its repository's files (nothing known). A marker without a file list (a converted
    model, written whole) counts as ready."""
    marker = read_marker(directory)
    if marker is None:
        return None
    verified = marker.get("files")
    repository_files = marker.get("repository_files")
    if verified is None:
        return []
    if not isinstance(verified, dict) or not isinstance(repository_files, dict):
        return None
    needed = needed_files(repository_files, _local_index(directory, verified), shard)
    return [path for path in needed if path not in verified]


def _local_index(directory: Path, verified: Mapping[str, object]) -> dict[str, Any] | None:
    if INDEX_FILE not in verified:
        return None
    try:
        index = json.loads((directory / INDEX_FILE).read_text())
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) else None


def needed_files(
    repository_files: Iterable[str], index: Mapping[str, object] | None, shard: ShardMetadata | None
) -> tuple[str, ...]:
    """Small files plus the shard's weight files (see `shard_files`)."""
    names = list(repository_files)
    try:
        weights = weight_files_for_shard(names, index, shard)
    except ValueError as error:
        raise HubDownloadError(str(error)) from None
    return tuple(sorted({*small_files(names), *weights}))


def write_marker(directory: Path, content: Mapping[str, Any]) -> None:
    temporary = directory / f"{COMPLETION_MARKER}{'.partial'}"
    temporary.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    temporary.replace(directory / COMPLETION_MARKER)
