"""Shared FastAPI dependencies and lookups for the routers."""

from __future__ import annotations

from fastapi import Request

from exo.api.cluster import ClusterClient
from exo.shared.types.common import ModelId


def cluster_dependency(request: Request) -> ClusterClient:
    cluster: ClusterClient = request.app.state.cluster
    return cluster


def known_model_ids(cluster: ClusterClient) -> list[ModelId]:
    """Built-in catalog models first, then any other model with a placed instance."""
    model_ids = list(cluster.cards)
    for instance in cluster.state.instances.values():
        if instance.model_id not in model_ids:
            model_ids.append(instance.model_id)
    return model_ids
