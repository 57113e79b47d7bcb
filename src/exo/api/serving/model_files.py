"""Where this node holds a model's files, and what the listings read from them: when they
last changed (OpenAI's `created`, Ollama's `modified_at`). A model whose files are on
another node only has no such time here."""

from __future__ import annotations

from pathlib import Path

from exo.api.serving.cluster_client import ClusterClient
from exo.download.pypi_gguf import model_directory_name
from exo.shared.constants import models_dir
from exo.shared.types.models import LocalDirectorySource, ModelCard
from exo.shared.types.nodes import DownloadCompleted


def model_directories(cluster: ClusterClient, card: ModelCard) -> list[Path]:
    """Where this node may hold the model's files, most specific first: its completed
    download, the directory it was added from, then its place in the models directory."""
    directories: list[Path] = []
    download = cluster.state.downloads.get(cluster.node_id, {}).get(card.model_id)
    if isinstance(download, DownloadCompleted):
        directories.append(Path(download.path))
    if isinstance(card.source, LocalDirectorySource):
        directories.append(Path(card.source.path))
    directories.append(models_dir() / model_directory_name(card.model_id))
    return [directory for directory in directories if directory.is_dir()]


def files_modified_ns(cluster: ClusterClient, card: ModelCard) -> int | None:
    """When the model's files on this node last changed (nanoseconds since the Unix epoch:
    its directory's modification time), or None when this node has no copy."""
    for directory in model_directories(cluster, card):
        return directory.stat().st_mtime_ns
    return None
