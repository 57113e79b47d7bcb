"""Where a Hub model's files may already be on this machine, and where a download goes.

Searched in order, each used in place when it holds every file the shard needs:
1. `EXO_MODELS_DIRS` (`os.pathsep`-separated, writable; default: the node's models
   directory), then `EXO_MODELS_READ_ONLY_DIRS` (searched, never written or deleted): a
   model is `<dir>/<org>--<name>/` or `<dir>/<org>/<name>/`;
2. the Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
   `~/.cache/huggingface/hub`): `models--<org>--<name>/snapshots/<commit>/`, the commit
   being the revision itself or what `refs/<revision>` names.

A download goes into the first writable directory that already holds a partial download of
the model (to resume it), else the first with room for the model's stored size.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo.download.completion import COMPLETION_MARKER, missing_files, needed_files
from exo.download.fetch import PARTIAL_SUFFIX
from exo.download.hub_download import disk_free_bytes
from exo.download.hub_listing import HubDownloadError
from exo.download.model_lock import model_lock
from exo.download.shard_files import INDEX_FILE
from exo.shared.types.shards import ShardMetadata

# A TikToken `tiktoken.model` is Kimi's (`exo.chat_protocol.tokenizer_loading`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model")
# How long a delete waits for a download or conversion of the model to finish.
DELETE_WAIT_SECONDS = 10.0
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def _paths(value: str | None) -> tuple[Path, ...]:
    if not value:
        return ()
    return tuple(Path(part).expanduser() for part in value.split(os.pathsep) if part.strip())


def default_hub_cache(environment: Mapping[str, str]) -> Path:
    if environment.get("HF_HUB_CACHE"):
        return Path(environment["HF_HUB_CACHE"]).expanduser()
    if environment.get("HF_HOME"):
        return Path(environment["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


@dataclass(frozen=True, slots=True)
class ModelLocations:
    writable: tuple[Path, ...]
    read_only: tuple[Path, ...]
    hub_cache: Path

    @classmethod
    def from_environment(
        cls, default_models_dir: Path, environment: Mapping[str, str] | None = None
    ) -> ModelLocations:
        """`EXO_MODELS_DIRS` (else `default_models_dir`), `EXO_MODELS_READ_ONLY_DIRS` and
        the Hugging Face cache, as set in `environment` (default: the process's)."""
        env = os.environ if environment is None else environment
        writable = _paths(env.get("EXO_MODELS_DIRS")) or (default_models_dir,)
        return cls(writable, _paths(env.get("EXO_MODELS_READ_ONLY_DIRS")), default_hub_cache(env))


def directory_name(model_id: str) -> str:
    return model_id.strip("/").replace("/", "--")


def missing_in_directory(directory: Path, shard: ShardMetadata | None) -> list[str] | None:
    """What `directory` lacks for `shard`: `[]` when ready, None when it is no model
    directory. With exo's completion marker, its verified file list decides; otherwise
    (a directory someone else filled, a Hub cache snapshot) the files present: config.json,
    a tokenizer and the shard's weight files (by the safetensors index)."""
    if not directory.is_dir():
        return None
    marked = missing_files(directory, shard)
    if marked is not None:
        return marked
    # `exists()` drops dangling links (a cache snapshot whose blob was never fetched).
    present = {
        path.name
        for path in directory.iterdir()
        if not path.name.endswith(PARTIAL_SUFFIX) and path.exists()
    }
    if "config.json" not in present:
        return None
    missing: list[str] = []
    if not any(name in present for name in TOKENIZER_FILES):
        missing.append(" or ".join(TOKENIZER_FILES))
    index: dict[str, Any] | None = None
    if INDEX_FILE in present:
        try:
            loaded = json.loads((directory / INDEX_FILE).read_text())
        except (OSError, ValueError):
            return None
        index = loaded if isinstance(loaded, dict) else None
        weight_map = index.get("weight_map") if index else None
        listed = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        universe = present | {str(name) for name in listed}
    else:
        universe = present
        if not any(name.endswith(".safetensors") for name in present):
            missing.append("*.safetensors")
    try:
        needed = needed_files(universe, index, shard)
    except HubDownloadError:  # an index naming files the directory lacks
        return None
    return missing + [name for name in needed if name not in present]


def hub_cache_snapshot(hub_cache: Path, repo_id: str, revision: str) -> Path | None:
    """The cache's snapshot directory of `repo_id` at `revision` (None: not cached)."""
    repository = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = revision if _COMMIT.match(revision) else None
    if commit is None:
        try:
            commit = (repository / "refs" / revision).read_text().strip()
        except OSError:
            return None
    snapshot = repository / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def candidates(locations: ModelLocations, model_id: str, repo_id: str, revision: str) -> list[Path]:
    """Every place a copy of the model may be, in search order."""
    places: list[Path] = []
    for root in (*locations.writable, *locations.read_only):
        places.append(root / directory_name(model_id))
        places.append(root / repo_id)
    snapshot = hub_cache_snapshot(locations.hub_cache, repo_id, revision)
    if snapshot is not None:
        places.append(snapshot)
    return places


@dataclass(frozen=True, slots=True)
class LocalSearch:
    """`ready`: a directory holding every file the shard needs (None: none does);
    `nearest`: the copy lacking the fewest files, with what it lacks (for offline errors)."""

    ready: Path | None
    nearest: tuple[Path, list[str]] | None
    searched: tuple[Path, ...]


def find_local_copy(
    locations: ModelLocations,
    model_id: str,
    repo_id: str,
    revision: str,
    shard: ShardMetadata | None,
) -> LocalSearch:
    places = candidates(locations, model_id, repo_id, revision)
    nearest: tuple[Path, list[str]] | None = None
    for place in places:
        missing = missing_in_directory(place, shard)
        if missing is None:
            continue
        if not missing:
            return LocalSearch(place, None, tuple(places))
        if nearest is None or len(missing) < len(nearest[1]):
            nearest = (place, missing)
    return LocalSearch(None, nearest, tuple(places))


def offline_message(repo_id: str, revision: str, search: LocalSearch) -> str:
    """What offline mode says when no copy is ready: exactly which files are missing."""
    if search.nearest is not None:
        place, missing = search.nearest
        return (
            f"offline mode: {repo_id}@{revision} is incomplete on this node; {place} lacks "
            f"{', '.join(missing)}"
        )
    searched = ", ".join(str(path) for path in search.searched)
    return f"offline mode: {repo_id}@{revision} is not on this node (searched {searched})"


def choose_download_directory(
    locations: ModelLocations,
    model_id: str,
    size_bytes: int,
    free_bytes: Callable[[Path], int] = disk_free_bytes,
) -> Path:
    """Where a download of `model_id` goes: a writable directory already holding part of
    it, else the first with `size_bytes` free, else the first (whose download then
    reports the disk it lacks)."""
    writable: Sequence[Path] = locations.writable
    for root in writable:
        target = root / directory_name(model_id)
        if target.is_dir() and any(target.iterdir()):
            return target
    for root in writable:
        if free_bytes(root) >= size_bytes:
            return root / directory_name(model_id)
    return writable[0] / directory_name(model_id)


def delete_downloaded_model(
    default_models_dir: Path, model_id: str, wait_s: float = DELETE_WAIT_SECONDS
) -> list[Path]:
    """Remove the model's directory from every writable models directory (never from a
    read-only one or the Hugging Face cache), its completion marker first so a removal
    cut short leaves nothing that looks complete. Holds the model's lock (`model_lock`):
    waits up to `wait_s` for a download or conversion of it to finish.

    Returns:
        The directories removed.

    Raises:
        ModelBusyError: the model was still being downloaded or converted after `wait_s`.
    """
    removed: list[Path] = []
    with model_lock(default_models_dir, directory_name(model_id), wait_s=wait_s):
        for root in ModelLocations.from_environment(default_models_dir).writable:
            target = root / directory_name(model_id)
            if not target.is_dir():
                continue
            (target / COMPLETION_MARKER).unlink(missing_ok=True)
            _remove_tree(target)
            removed.append(target)
    return removed


def _remove_tree(target: Path, attempts: int = 3) -> None:
    """`shutil.rmtree` that tolerates a download writing into `target` meanwhile (found by
    the long fuzz: a delete racing a download answered 500): a file that vanished (renamed
    from `.partial`, or removed) is skipped, and a directory that gained a file before it
    was removed is walked again, up to `attempts` times.

    Raises:
        OSError: any other failure, or the directory still gaining files after `attempts`.
    """

    def skip_vanished(_function: Callable[..., Any], _path: str, error: Any) -> None:
        if not isinstance(error[1], FileNotFoundError):
            raise error[1]

    for attempt in range(attempts):
        try:
            shutil.rmtree(target, onerror=skip_vanished)
            return
        except OSError as error:
            if error.errno != errno.ENOTEMPTY or attempt == attempts - 1:
                raise
