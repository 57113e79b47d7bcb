"""Models already on this machine, found without a download.

Two questions, answered from the same places (`exo.download.locations`: the models
directories `EXO_MODELS_DIRS` / `EXO_MODELS_READ_ONLY_DIRS`, the Hugging Face cache) and
Ollama's store (`exo.download.gguf_models`):

- `catalog_copies`: which catalog (or custom) models with a Hub source have a whole copy
  here, by the same `find_local_copy` a placement's download step uses, so a model reported
  downloaded is one the node then loads in place. The node reports them at start and every
  `RESCAN_SECONDS` as `NodeDownloadProgress(DownloadCompleted)` (`download_reports`), the
  event a real download ends with, so every node's `/models` shows them.
- `scan_on_disk`: every supported model of those places that is no card yet (a Hub
  repository in the cache, a directory someone filled), listed by `GET /models/on_disk`
  with the name `POST /models/add` takes. They are not added by themselves: the Hugging
  Face cache is shared by every HF tool and holds what a user tried once, and a card added
  is seen by every node of the cluster (docs/models.md says more).

Every scan is bounded: `MAX_ENTRIES` directory entries per root, `MAX_SCAN_SECONDS` in all,
a fixed depth (`<root>/<org>--<name>`, `<root>/<org>/<name>`, the cache's
`models--<org>--<name>/snapshots/<commit>`); linked directories are skipped and a
config.json is read only when it lies inside its root (a cache snapshot's links into its
own repository's `blobs/` do). `catalog_copies` is the download step's own lookup, and
follows what it follows.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from exo.download.custom_cards import REPO_ID
from exo.download.locations import (
    ModelLocations,
    find_local_copy,
    hub_cache_snapshot,
    missing_in_directory,
)
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.events import NodeDownloadProgress
from exo.shared.types.models import (
    GgufFileSource,
    HuggingFaceSource,
    LocalDirectorySource,
    ModelCard,
)
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.state import State

# Directory entries read per scanned root (a models directory, the cache, Ollama's manifests).
MAX_ENTRIES = 2000
# Wall time of one scan of every place; what is not reached by then is left out (logged).
MAX_SCAN_SECONDS = 5.0
# A config.json larger than this is no model's config (bytes).
MAX_CONFIG_BYTES = 1 << 20
# How often a node looks again for catalog models put on disk by other tools (seconds).
RESCAN_SECONDS = 300.0

Place = Literal["models_dir", "hf_cache"]


@dataclass(slots=True)
class ScanBudget:
    """What a scan may still spend: entries read and a deadline (`time.monotonic`)."""

    deadline: float
    entries_left: int = MAX_ENTRIES * 8
    exhausted: bool = False

    @classmethod
    def start(cls, seconds: float = MAX_SCAN_SECONDS) -> ScanBudget:
        return cls(deadline=time.monotonic() + seconds)

    def spend(self) -> bool:
        """Take one entry; False (and `exhausted`) once the count or the time is spent."""
        if self.entries_left <= 0 or time.monotonic() > self.deadline:
            self.exhausted = True
            return False
        self.entries_left -= 1
        return True


@dataclass(frozen=True, slots=True)
class OnDiskModel:
    """A whole HF-format copy of a Hub repository that no card names yet.

    `repo_id`: what `POST /models/add` takes; `architecture`: its config's first
    `architectures` entry; `supported`: whether a family file of the engine runs it."""

    repo_id: str
    place: Place
    path: Path
    architecture: str | None
    supported: bool


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except (OSError, ValueError):
        return False
    return True


def _directories(root: Path, budget: ScanBudget) -> Iterator[os.DirEntry[str]]:
    """The real directories (no links) directly under `root`, by name, at most
    `MAX_ENTRIES` of them."""
    try:
        with os.scandir(root) as scanned:
            entries: list[os.DirEntry[str]] = []
            for entry in scanned:
                if len(entries) >= MAX_ENTRIES or not budget.spend():
                    break
                entries.append(entry)
    except OSError:
        return
    for entry in sorted(entries, key=lambda found: found.name):
        try:
            if entry.is_dir(follow_symlinks=False):
                yield entry
        except OSError:
            continue


def _architecture(config_path: Path, root: Path) -> str | None:
    """The first `architectures` entry of a config.json inside `root` (None: unreadable,
    too large, a link out of `root`, or no such field)."""
    if not _inside(config_path, root):
        return None
    try:
        if config_path.stat().st_size > MAX_CONFIG_BYTES:
            return None
        config: Any = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        return architectures[0]
    return None


def _repo_id(directory_name_: str) -> str | None:
    """`org--name` -> `org/name` (None for anything else: a converted GGUF, `gpt2`)."""
    org, separator, name = directory_name_.partition("--")
    if not separator or "--" in name or name.endswith(".gguf"):
        return None
    repo_id = f"{org}/{name}"
    return repo_id if REPO_ID.match(repo_id) else None


def _whole(directory: Path) -> bool:
    return missing_in_directory(directory, None) == []


def _hub_cache_models(hub_cache: Path, budget: ScanBudget) -> Iterator[tuple[str, Path, Path]]:
    """(repo id, snapshot of `refs/main`, the repository's directory) for each model
    repository of the cache whose snapshot lies inside it."""
    for entry in _directories(hub_cache, budget):
        if not entry.name.startswith("models--"):
            continue
        repo_id = _repo_id(entry.name.removeprefix("models--"))
        if repo_id is None:
            continue
        snapshot = hub_cache_snapshot(hub_cache, repo_id, "main")
        if snapshot is None or snapshot.is_symlink() or not _inside(snapshot, Path(entry.path)):
            continue
        yield repo_id, snapshot, Path(entry.path)


def _models_directory_models(root: Path, budget: ScanBudget) -> Iterator[tuple[str, Path]]:
    """(repo id, directory) for `<root>/<org>--<name>` and `<root>/<org>/<name>`."""
    for entry in _directories(root, budget):
        repo_id = _repo_id(entry.name)
        if repo_id is not None:
            yield repo_id, Path(entry.path)
            continue
        if "--" in entry.name or entry.name.startswith("."):
            continue
        for inner in _directories(Path(entry.path), budget):
            repo_id = _repo_id(f"{entry.name}--{inner.name}")
            if repo_id is not None:
                yield repo_id, Path(inner.path)


def scan_on_disk(
    locations: ModelLocations,
    known_repositories: Collection[str],
    supported: Collection[str],
    budget: ScanBudget | None = None,
) -> list[OnDiskModel]:
    """Whole HF-format copies in the models directories and the Hugging Face cache of
    repositories no card names (`known_repositories`, compared without letter case), first
    place first, each repository once.

    Args:
        supported: the architectures the engine runs (`SERVED_ARCHITECTURES`); a copy of
            another is listed with `supported=False`, never as something to add.
    """
    budget = budget or ScanBudget.start()
    known = {repo.lower() for repo in known_repositories}
    found: dict[str, OnDiskModel] = {}

    def consider(repo_id: str, place: Place, directory: Path, root: Path) -> None:
        if repo_id.lower() in known or repo_id.lower() in found or not _whole(directory):
            return
        architecture = _architecture(directory / "config.json", root)
        found[repo_id.lower()] = OnDiskModel(
            repo_id, place, directory, architecture, architecture in supported
        )

    for root in (*locations.writable, *locations.read_only):
        for repo_id, directory in _models_directory_models(root, budget):
            consider(repo_id, "models_dir", directory, root)
    for repo_id, snapshot, repository in _hub_cache_models(locations.hub_cache, budget):
        consider(repo_id, "hf_cache", snapshot, repository)
    return list(found.values())


def catalog_copies(
    locations: ModelLocations, cards: Mapping[ModelId, ModelCard], budget: ScanBudget | None = None
) -> dict[ModelId, Path]:
    """Where each card's model is whole on this machine, for the cards whose model is: a
    Hub source's copy (the one a placement's download step would use in place), a local
    directory's own path, a GGUF source's file (an Ollama blob)."""
    budget = budget or ScanBudget.start()
    copies: dict[ModelId, Path] = {}
    for model_id, card in cards.items():
        if not budget.spend():
            break
        match card.source:
            case HuggingFaceSource(repo_id=repo_id, revision=revision):
                search = find_local_copy(locations, model_id, repo_id, revision, None)
                if search.ready is not None:
                    copies[model_id] = search.ready
            case LocalDirectorySource(path=path):
                if _whole(Path(path)):
                    copies[model_id] = Path(path)
            case GgufFileSource(path=path):
                if Path(path).is_file():
                    copies[model_id] = Path(path)
            case _:
                continue  # a PyPI wheel's model: prepared by exo only, reported then
    return copies


def download_reports(
    node_id: NodeId, state: State, copies: Mapping[ModelId, Path]
) -> list[NodeDownloadProgress]:
    """The events that tell the cluster `node_id` holds `copies`: one per model the state
    does not already record as completed there at the same path."""
    recorded = state.downloads.get(node_id, {})
    reports: list[NodeDownloadProgress] = []
    for model_id, path in copies.items():
        status = recorded.get(model_id)
        if isinstance(status, DownloadCompleted) and status.path == str(path):
            continue
        reports.append(
            NodeDownloadProgress(
                node_id=node_id, model_id=model_id, status=DownloadCompleted(path=str(path))
            )
        )
    return reports


def known_repositories(cards: Mapping[ModelId, ModelCard]) -> set[str]:
    """The Hub repositories (and models-directory names) the cards already name."""
    names: set[str] = set()
    for model_id, card in cards.items():
        names.add(str(model_id))
        if isinstance(card.source, HuggingFaceSource):
            names.add(card.source.repo_id)
    return names
