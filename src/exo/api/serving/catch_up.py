"""A generation naming what this node has not heard of yet waits for the node to catch up.

A node that just joined, restarted from its log or dropped its history for the cluster's
(a healed split) holds an older state than the master's for a moment: a custom model
added or an instance placed through another node is not in it yet. A request naming one
waits, at most `CATCH_UP_WAIT_SECONDS`, until this node holds the history the master
announced, then is checked as usual: served, or a 404 when the cluster really does not
know the name. A request naming what the state holds never waits.
"""

from __future__ import annotations

from loguru import logger

from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.model_lookup import resolve_model_id
from exo.shared.types.common import InstanceId


def names_known(cluster: ClusterClient, model: str, instance: str | None) -> bool:
    """Whether this node's state knows `model` (any name `resolve_model_id` takes) and,
    when given, the instance id `instance`."""
    if resolve_model_id(cluster, model) is None:
        return False
    return instance is None or InstanceId(instance.strip()) in cluster.state.instances


async def catch_up_for(cluster: ClusterClient, model: str, instance: str | None = None) -> None:
    """Return once the names are known or this node caught up with the master (at most
    `CATCH_UP_WAIT_SECONDS`); the caller's checks then answer an unknown name.

    Raises:
        NoCapacityError: the node began shutting down (`NodeStop.unless_stopping`)."""
    if names_known(cluster, model, instance):
        return
    if not await cluster.stop.unless_stopping(cluster.wait_until_caught_up):
        logger.info(f"api: '{model}' is unknown and this node has not caught up with the master")
