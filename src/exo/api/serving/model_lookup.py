"""Shared FastAPI dependencies and lookups for the routers."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, TypeVar

from fastapi import Depends, Request
from pydantic import BaseModel

from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.model_aliases import aliased_model
from exo.download.locations import ModelLocations, find_local_copy
from exo.download.pypi_gguf import is_prepared, model_directory_name
from exo.shared.constants import models_dir
from exo.shared.models.names import resolve_model_name
from exo.shared.types.common import ModelId
from exo.shared.types.models import (
    GgufFileSource,
    HuggingFaceSource,
    LocalDirectorySource,
    ModelCard,
)
from exo.shared.types.nodes import DownloadCompleted

RequestBody = TypeVar("RequestBody", bound=BaseModel)


def cluster_dependency(request: Request) -> ClusterClient:
    cluster: ClusterClient = request.app.state.cluster
    return cluster


Cluster = Annotated[ClusterClient, Depends(cluster_dependency)]
"""A route parameter: the node's cluster client."""


def known_model_ids(cluster: ClusterClient) -> list[ModelId]:
    """Built-in catalog models first, then any other model with a placed instance."""
    model_ids = list(cluster.cards)
    for instance in cluster.state.instances.values():
        if instance.model_id not in model_ids:
            model_ids.append(instance.model_id)
    return model_ids


def resolve_model_id(cluster: ClusterClient, name: str) -> ModelId | None:
    """The model `name` means (catalog id, short name, a custom model's name, the id of
    a placed model, or what `--model-alias` maps it to), or None when the cluster knows no
    such model."""
    placed = [instance.model_id for instance in cluster.state.instances.values()]
    custom = cluster.state.custom_cards
    found = resolve_model_name(name, catalog_of(cluster), placed, custom)
    if found is not None:
        return found
    # A name the cluster does not know may be aliased (`--model-alias`) to one it does.
    target = aliased_model(cluster.load_on_request.model_aliases, name)
    if target is None:
        return None
    return resolve_model_name(target, catalog_of(cluster), placed, custom)


def catalog_of(cluster: ClusterClient) -> Mapping[ModelId, ModelCard]:
    """The catalog's cards: `cluster.cards` without the state's custom models (which
    answer only to the names the catalog leaves free, see `resolve_model_name`)."""
    custom = cluster.state.custom_cards
    if not custom:
        return cluster.cards
    return {model_id: card for model_id, card in cluster.cards.items() if model_id not in custom}


def with_resolved_model(cluster: ClusterClient, body: RequestBody) -> RequestBody:
    """`body` with its `model` field replaced by the canonical id it names (unchanged when
    the name is unknown: the generation route answers that with its 404)."""
    name = getattr(body, "model", None)
    if not isinstance(name, str):
        return body
    resolved = resolve_model_id(cluster, name)
    if resolved is None or resolved == name:
        return body
    return body.model_copy(update={"model": str(resolved)})


def card_of(cluster: ClusterClient, model_id: ModelId) -> ModelCard | None:
    """The card of a known model: the catalog's, else the one its placed instance carries."""
    if model_id in cluster.cards:
        return cluster.cards[model_id]
    for instance in cluster.state.instances_of_model(model_id):
        for shard in instance.shard_assignments.runner_to_shard.values():
            return shard.model_card
    return None


def is_downloaded(cluster: ClusterClient, card: ModelCard, models_directory: Path) -> bool:
    """Whether the model's files are ready on some node: a node reported the download
    complete, or this node's models directory holds a complete copy (the check the node
    makes before preparing a model; the state only learns of downloads that placements
    asked for)."""
    for downloads in cluster.state.downloads.values():
        if isinstance(downloads.get(card.model_id), DownloadCompleted):
            return True
    match card.source:
        case LocalDirectorySource(path=path):
            return Path(path).expanduser().is_dir()
        case GgufFileSource(path=path):
            # Converted on first use; the file being here is what counts.
            return Path(path).is_file() or is_prepared(
                models_directory / model_directory_name(card.model_id)
            )
        case HuggingFaceSource(repo_id=repo_id, revision=revision):
            # Any models directory (writable or read-only) or the Hugging Face cache.
            locations = ModelLocations.from_environment(models_directory)
            found = find_local_copy(locations, card.model_id, repo_id, revision, None)
            return found.ready is not None
        case _:
            return is_prepared(models_directory / model_directory_name(card.model_id))


def servable_model_ids(
    cluster: ClusterClient, models_directory: Path | None = None
) -> list[ModelId]:
    """What the cluster can serve now: models with a placed instance first, then catalog
    models whose files are downloaded."""
    directory = models_directory or models_dir()
    model_ids: list[ModelId] = []
    for instance in cluster.state.instances.values():
        if instance.model_id not in model_ids:
            model_ids.append(instance.model_id)
    for model_id, card in cluster.cards.items():
        if model_id not in model_ids and is_downloaded(cluster, card, directory):
            model_ids.append(model_id)
    return model_ids
