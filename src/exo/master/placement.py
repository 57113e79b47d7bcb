"""Placement: which node(s) run which shard of a model. Pure functions of the state.

This version places on a single node (world size 1); multi-node pipeline and tensor
placement extend `placement_candidates`.
"""

from __future__ import annotations

from collections.abc import Sequence

from exo.shared.types.common import FrozenModel, InstanceId, NodeId, RunnerId
from exo.shared.types.instances import (
    Instance,
    PipelineInstance,
    ShardAssignments,
    Sharding,
    TensorInstance,
)
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata
from exo.shared.types.state import State

# Activations, KV cache of typical requests and allocator slack on top of the weights.
MEMORY_OVERHEAD_FRACTION = 0.10


class PlacementError(ValueError):
    """No valid placement; the message says why in words a user can act on."""


class PlacementPreview(FrozenModel):
    """One way to place a model, valid or not (`error` says why not)."""

    model_id: str
    sharding: Sharding
    node_count: int
    node_ids: tuple[NodeId, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    bytes_per_node: tuple[int, ...]
    error: str | None = None


def required_memory_bytes(card: ModelCard, world_size: int = 1) -> int:
    """Bytes one rank needs to hold its share of the model (weights plus overhead)."""
    share = card.storage_size_bytes / world_size
    return int(share * (1 + MEMORY_OVERHEAD_FRACTION))


def runner_id_for(instance_id: InstanceId, rank: int) -> RunnerId:
    return RunnerId(f"{instance_id}-rank{rank}")


def _shard(card: ModelCard, sharding: Sharding) -> ShardMetadata:
    if sharding == "pipeline":
        return PipelineShardMetadata(
            model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers
        )
    return TensorShardMetadata(model_card=card, device_rank=0, world_size=1)


def _candidate_nodes(state: State, node_ids: Sequence[NodeId] | None) -> list[NodeId]:
    if node_ids is None:
        return list(state.node_info)
    unknown = [node_id for node_id in node_ids if node_id not in state.node_info]
    if unknown:
        raise PlacementError(f"unknown node id(s): {', '.join(unknown)}")
    return list(node_ids)


def place_instance(
    card: ModelCard,
    state: State,
    instance_id: InstanceId,
    sharding: Sharding = "pipeline",
    min_nodes: int = 1,
    node_ids: Sequence[NodeId] | None = None,
) -> Instance:
    """Choose where to run `card` and return the instance to create.

    Picks the node with the most available memory among those that can hold the whole
    model (fewest nodes first: one node is always preferred when it fits).

    Raises:
        PlacementError: no node is known, `min_nodes` exceeds what this placement can
            use, or no node has enough available memory.
    """
    candidates = _candidate_nodes(state, node_ids)
    if not candidates:
        raise PlacementError("no nodes are known yet; wait for the node to report its memory")
    if min_nodes > 1:
        raise PlacementError(
            f"min_nodes={min_nodes} but multi-node placement is not available in this "
            "version; use min_nodes=1"
        )
    needed = required_memory_bytes(card)
    fitting = [
        node_id
        for node_id in candidates
        if state.node_info[node_id].memory.available_bytes >= needed
    ]
    if not fitting:
        best = max(candidates, key=lambda n: state.node_info[n].memory.available_bytes)
        available = state.node_info[best].memory.available_bytes
        raise PlacementError(
            f"model {card.model_id} needs {needed / 2**20:.0f} MiB but the node with the "
            f"most available memory ({best}) has {available / 2**20:.0f} MiB"
        )
    node_id = max(fitting, key=lambda n: (state.node_info[n].memory.available_bytes, n))
    runner_id = runner_id_for(instance_id, 0)
    assignments = ShardAssignments(
        model_id=card.model_id,
        runner_to_shard={runner_id: _shard(card, sharding)},
        node_to_runner={node_id: runner_id},
    )
    if sharding == "pipeline":
        return PipelineInstance(instance_id=instance_id, shard_assignments=assignments)
    return TensorInstance(instance_id=instance_id, shard_assignments=assignments)


def placement_previews(card: ModelCard, state: State) -> list[PlacementPreview]:
    """Every (sharding, node count) combination with its layout, or why it is invalid."""
    previews: list[PlacementPreview] = []
    node_count = len(state.node_info)
    for sharding in ("pipeline", "tensor"):
        for count in range(1, max(node_count, 1) + 1):
            try:
                instance = place_instance(
                    card, state, InstanceId("preview"), sharding=sharding, min_nodes=count
                )
            except PlacementError as error:
                previews.append(
                    PlacementPreview(
                        model_id=card.model_id,
                        sharding=sharding,
                        node_count=count,
                        node_ids=(),
                        layer_ranges=(),
                        bytes_per_node=(),
                        error=str(error),
                    )
                )
                continue
            assignments = instance.shard_assignments
            nodes = tuple(assignments.node_to_runner)
            ranges = tuple((0, card.n_layers) for _ in nodes)
            previews.append(
                PlacementPreview(
                    model_id=card.model_id,
                    sharding=sharding,
                    node_count=len(nodes),
                    node_ids=nodes,
                    layer_ranges=ranges,
                    bytes_per_node=tuple(card.storage_size_bytes for _ in nodes),
                )
            )
    return previews
