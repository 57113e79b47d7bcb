"""Placement rules on built states: single nodes, pipeline and tensor groups."""

from __future__ import annotations

import pytest

from exo.master.placement import (
    MEMORY_OVERHEAD_FRACTION,
    PlacementError,
    layer_split,
    place_instance,
    placement_previews,
    rendezvous_port,
    required_memory_bytes,
)
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.instances import PipelineInstance, TensorInstance
from exo.shared.types.nodes import DownloadCompleted, GpuInfo, TopologyEdge
from exo.shared.types.shards import PipelineShardMetadata, TensorShardMetadata
from exo.shared.types.state import State
from exo.testing.builders import MIB, make_card, make_node_info, make_state

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
INSTANCE = InstanceId("instance-1")
# 1000 MiB of weights need 1100 MiB with the 10% overhead.
CARD = make_card(n_layers=12, storage_size_bytes=1000 * MIB)
TENSOR_CARD = make_card(
    n_layers=12, storage_size_bytes=1000 * MIB, supports_tensor=True
).model_copy(update={"num_attention_heads": 8, "num_key_value_heads": 4})


def edge(source: NodeId, sink: NodeId, address: str = "127.0.0.1") -> TopologyEdge:
    return TopologyEdge(source=source, sink=sink, address=address, latency_ms=1, bandwidth_mbps=1)


def state_with(linked: bool = True, **available_mb: int) -> State:
    """`state_with(node_a=100)`: node "node-a" with 100 MiB available; with `linked`, every
    pair of nodes has measured links both ways (address 10.0.0.<index of the sink>)."""
    nodes = {
        NodeId(name.replace("_", "-")): make_node_info(mb) for name, mb in available_mb.items()
    }
    state = make_state(nodes=nodes)
    if not linked:
        return state
    names = list(nodes)
    topology = {
        source: {
            sink: edge(source, sink, f"10.0.0.{names.index(sink) + 1}")
            for sink in names
            if sink != source
        }
        for source in names
    }
    return state.model_copy(update={"topology": topology})


def test_required_memory_adds_overhead_and_splits_by_world_size() -> None:
    assert MEMORY_OVERHEAD_FRACTION == 0.10
    assert required_memory_bytes(CARD) == 1100 * MIB
    assert required_memory_bytes(CARD, world_size=2) == 550 * MIB


@pytest.mark.parametrize(
    ("n_layers", "weights", "expected"),
    [
        (12, [1, 1], [6, 6]),
        (12, [3, 1], [9, 3]),
        (30, [100, 100, 100], [10, 10, 10]),
        (10, [1000, 1, 1], [8, 1, 1]),  # at least one layer each
        (7, [1, 1], [4, 3]),  # the remainder goes to the earlier node on a tie
        (5, [2, 1, 1], [2, 2, 1]),
    ],
)
def test_layer_split_is_proportional_with_largest_remainder(
    n_layers: int, weights: list[int], expected: list[int]
) -> None:
    assert layer_split(n_layers, weights) == expected
    assert sum(layer_split(n_layers, weights)) == n_layers


def test_layer_split_needs_a_layer_per_node() -> None:
    with pytest.raises(PlacementError, match="2 layers cannot give each of 3"):
        layer_split(2, [1, 1, 1])


def test_a_model_that_fits_goes_on_one_node_with_all_layers() -> None:
    instance = place_instance(CARD, state_with(node_a=1100, node_b=5000), INSTANCE)
    assert isinstance(instance, PipelineInstance)
    assignments = instance.shard_assignments
    # The node with the most memory; one node is preferred over a split.
    assert assignments.node_to_runner == {NODE_B: RunnerId("instance-1-rank0")}
    shard = assignments.runner_to_shard[RunnerId("instance-1-rank0")]
    assert isinstance(shard, PipelineShardMetadata)
    assert (shard.start_layer, shard.end_layer, shard.world_size) == (0, 12, 1)
    assert instance.rendezvous is None


def test_nodes_holding_the_files_are_preferred_over_more_memory() -> None:
    state = state_with(node_a=2000, node_b=5000)
    held = {NODE_A: {CARD.model_id: DownloadCompleted(path="/models/x")}}
    state = state.model_copy(update={"downloads": held})
    instance = place_instance(CARD, state, INSTANCE)
    assert list(instance.shard_assignments.node_to_runner) == [NODE_A]


def test_too_big_for_one_node_splits_layers_by_memory() -> None:
    state = state_with(node_a=900, node_b=300)
    instance = place_instance(CARD, state, INSTANCE)
    assignments = instance.shard_assignments
    assert list(assignments.node_to_runner) == [NODE_A, NODE_B]
    shards = [assignments.runner_to_shard[runner] for runner in assignments.node_to_runner.values()]
    assert [
        (s.start_layer, s.end_layer) for s in shards if isinstance(s, PipelineShardMetadata)
    ] == [
        (0, 9),
        (9, 12),
    ]
    assert [s.device_rank for s in shards] == [0, 1]
    rendezvous = instance.rendezvous
    assert rendezvous is not None
    assert rendezvous.backend == "gloo"
    assert rendezvous.port == rendezvous_port(INSTANCE)
    # Node B reaches rank 0 (node A) on the address it measured.
    assert rendezvous.addresses[NODE_B] == "10.0.0.1"


def test_a_split_needs_each_share_to_fit() -> None:
    # 12 layers over 1150 MiB: B's memory is enough in total but its share is not.
    state = state_with(node_a=1100, node_b=50)
    with pytest.raises(PlacementError, match="node-b would need"):
        place_instance(CARD, state, INSTANCE, min_nodes=2)


def test_nodes_without_a_link_are_not_grouped() -> None:
    state = state_with(linked=False, node_a=600, node_b=600)
    with pytest.raises(PlacementError, match="no measured link"):
        place_instance(CARD, state, INSTANCE)


def test_not_enough_memory_anywhere_says_how_much_in_mib() -> None:
    with pytest.raises(PlacementError) as error:
        place_instance(CARD, state_with(node_a=500, node_b=400), INSTANCE)
    message = str(error.value)
    assert "needs 1100 MiB" in message
    assert str(CARD.model_id) in message


def test_min_nodes_forces_a_split() -> None:
    instance = place_instance(
        CARD, state_with(node_a=5000, node_b=5000, node_c=5000), INSTANCE, min_nodes=3
    )
    assert instance.shard_assignments.world_size == 3


def test_min_nodes_above_the_cluster_size_is_an_error() -> None:
    with pytest.raises(PlacementError, match="min_nodes=2 but only 1"):
        place_instance(CARD, state_with(node_a=5000), INSTANCE, min_nodes=2)


def test_node_ids_restrict_the_candidates() -> None:
    instance = place_instance(
        CARD, state_with(node_a=1100, node_b=9000), INSTANCE, node_ids=[NODE_A]
    )
    assert list(instance.shard_assignments.node_to_runner) == [NODE_A]


def test_unknown_node_id_is_an_error_naming_it() -> None:
    with pytest.raises(PlacementError, match="node-x"):
        place_instance(CARD, state_with(node_a=5000), INSTANCE, node_ids=[NodeId("node-x")])


def test_no_known_nodes_is_an_error() -> None:
    with pytest.raises(PlacementError, match="no nodes are known"):
        place_instance(CARD, State(), INSTANCE)


def test_tensor_sharding_splits_every_layer() -> None:
    state = state_with(node_a=600, node_b=600)
    instance = place_instance(TENSOR_CARD, state, INSTANCE, sharding="tensor")
    assert isinstance(instance, TensorInstance)
    shards = list(instance.shard_assignments.runner_to_shard.values())
    assert all(isinstance(s, TensorShardMetadata) and s.world_size == 2 for s in shards)


def test_tensor_sharding_needs_support_and_divisible_heads() -> None:
    state = state_with(node_a=600, node_b=600)
    with pytest.raises(PlacementError, match="does not support tensor"):
        place_instance(CARD, state, INSTANCE, sharding="tensor", min_nodes=2)
    # SmolLM2's 9 heads do not divide by 2.
    nine_heads = TENSOR_CARD.model_copy(update={"num_attention_heads": 9})
    with pytest.raises(PlacementError, match=r"attention heads \(9\) are not divisible by 2"):
        place_instance(nine_heads, state, INSTANCE, sharding="tensor", min_nodes=2)


def test_all_cuda_nodes_use_nccl() -> None:
    gpu = (GpuInfo(name="H200", total_memory_bytes=140 * 2**30),)
    state = state_with(node_a=600, node_b=600)
    nodes = {n: info.model_copy(update={"gpus": gpu}) for n, info in state.node_info.items()}
    instance = place_instance(CARD, state.model_copy(update={"node_info": nodes}), INSTANCE)
    assert instance.rendezvous is not None and instance.rendezvous.backend == "nccl"


def test_previews_list_every_sharding_and_node_count_with_reasons() -> None:
    state = state_with(node_a=900, node_b=300)
    previews = {(p.sharding, p.node_count): p for p in placement_previews(TENSOR_CARD, state)}
    assert set(previews) == {("pipeline", 1), ("pipeline", 2), ("tensor", 1), ("tensor", 2)}
    assert previews[("pipeline", 1)].error is not None
    assert "needs 1100 MiB" in (previews[("pipeline", 1)].error or "")
    split = previews[("pipeline", 2)]
    assert split.error is None
    assert split.node_ids == (NODE_A, NODE_B)
    assert split.layer_ranges == ((0, 9), (9, 12))
    assert split.bytes_per_node == (int(1000 * MIB * 9 / 12 * 1.1), int(1000 * MIB * 3 / 12 * 1.1))
    # Tensor halves need 550 MiB each; B has 300.
    assert "node-b would need 550 MiB" in (previews[("tensor", 2)].error or "")


def test_previews_without_nodes_say_so() -> None:
    previews = placement_previews(CARD, State())
    assert len(previews) == 2
    assert all(p.error is not None for p in previews)


def test_instance_ids_decide_the_rendezvous_port() -> None:
    assert rendezvous_port(InstanceId("a")) == rendezvous_port(InstanceId("a"))
    assert 40000 <= rendezvous_port(InstanceId("b")) < 50000
    assert ModelId(CARD.model_id) == CARD.model_id
