import pytest

from exo.master.placement import (
    MEMORY_OVERHEAD_FRACTION,
    PlacementError,
    place_instance,
    placement_previews,
    required_memory_bytes,
)
from exo.shared.types.common import InstanceId, NodeId, RunnerId
from exo.shared.types.instances import PipelineInstance, TensorInstance
from exo.shared.types.shards import PipelineShardMetadata, TensorShardMetadata
from exo.shared.types.state import State
from exo.testing.builders import MIB, make_card, make_node_info, make_state

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
INSTANCE = InstanceId("instance-1")
# 1000 MiB of weights need 1100 MiB with the 10% overhead.
CARD = make_card(n_layers=12, storage_size_bytes=1000 * MIB)


def state_with(**available_mb: int) -> State:
    """`state_with(node_a=100)`: node "node-a" with 100 MiB available."""
    nodes = {
        NodeId(name.replace("_", "-")): make_node_info(mb) for name, mb in available_mb.items()
    }
    return make_state(nodes=nodes)


def test_required_memory_adds_overhead_and_splits_by_world_size() -> None:
    assert MEMORY_OVERHEAD_FRACTION == 0.10
    assert required_memory_bytes(CARD) == 1100 * MIB
    assert required_memory_bytes(CARD, world_size=2) == 550 * MIB


def test_model_that_fits_is_placed_on_one_node_with_all_layers() -> None:
    instance = place_instance(CARD, state_with(node_a=1100), INSTANCE)
    assert isinstance(instance, PipelineInstance)
    assert instance.instance_id == INSTANCE
    assignments = instance.shard_assignments
    runner_id = RunnerId("instance-1-rank0")
    assert assignments.model_id == CARD.model_id
    assert assignments.node_to_runner == {NODE_A: runner_id}
    shard = assignments.runner_to_shard[runner_id]
    assert isinstance(shard, PipelineShardMetadata)
    assert (shard.start_layer, shard.end_layer) == (0, 12)
    assert (shard.device_rank, shard.world_size) == (0, 1)
    assert shard.model_card == CARD


def test_model_that_does_not_fit_says_how_much_memory_in_mib() -> None:
    with pytest.raises(PlacementError) as error:
        place_instance(CARD, state_with(node_a=700, node_b=1099), INSTANCE)
    message = str(error.value)
    assert "needs 1100 MiB" in message
    assert "(node-b) has 1099 MiB" in message
    assert str(CARD.model_id) in message


def test_picks_the_node_with_most_available_memory() -> None:
    instance = place_instance(CARD, state_with(node_a=2000, node_b=5000, node_c=100), INSTANCE)
    assert list(instance.shard_assignments.node_to_runner) == [NODE_B]


def test_node_ids_restrict_the_candidates() -> None:
    state = state_with(node_a=2000, node_b=5000, node_c=3000)
    instance = place_instance(CARD, state, INSTANCE, node_ids=[NODE_A, NODE_C])
    assert list(instance.shard_assignments.node_to_runner) == [NODE_C]
    with pytest.raises(PlacementError, match=r"\(node-a\) has 200 MiB"):
        place_instance(CARD, state_with(node_a=200, node_b=5000), INSTANCE, node_ids=[NODE_A])


def test_unknown_node_id_is_an_error_naming_it() -> None:
    with pytest.raises(PlacementError, match="unknown node id\\(s\\): node-x"):
        place_instance(CARD, state_with(node_a=5000), INSTANCE, node_ids=[NodeId("node-x")])


def test_no_known_nodes_is_an_error() -> None:
    with pytest.raises(PlacementError, match="no nodes are known"):
        place_instance(CARD, make_state(), INSTANCE)


def test_more_than_one_node_is_not_available() -> None:
    with pytest.raises(PlacementError, match="min_nodes=2"):
        place_instance(CARD, state_with(node_a=5000, node_b=5000), INSTANCE, min_nodes=2)


def test_tensor_sharding_gives_a_tensor_instance() -> None:
    card = make_card(storage_size_bytes=1000 * MIB, supports_tensor=True)
    instance = place_instance(card, state_with(node_a=5000), INSTANCE, sharding="tensor")
    assert isinstance(instance, TensorInstance)
    shard = instance.shard_assignments.runner_to_shard[RunnerId("instance-1-rank0")]
    assert isinstance(shard, TensorShardMetadata)
    assert (shard.device_rank, shard.world_size) == (0, 1)


def test_previews_list_both_shardings_with_reasons() -> None:
    previews = placement_previews(CARD, state_with(node_a=5000, node_b=1000))
    summary = [(p.sharding, p.node_count, p.node_ids, p.error is None) for p in previews]
    assert summary == [
        ("pipeline", 1, (NODE_A,), True),
        ("pipeline", 2, (), False),
        ("tensor", 1, (NODE_A,), True),
        ("tensor", 2, (), False),
    ]
    assert previews[0].layer_ranges == ((0, 12),)
    assert previews[0].bytes_per_node == (1000 * MIB,)
    assert previews[0].model_id == CARD.model_id
    assert previews[1].error is not None and "min_nodes=2" in previews[1].error
    assert previews[3].error is not None and "min_nodes=2" in previews[3].error


def test_previews_explain_why_a_model_does_not_fit() -> None:
    previews = placement_previews(CARD, state_with(node_a=100))
    assert [(p.sharding, p.node_count) for p in previews] == [("pipeline", 1), ("tensor", 1)]
    for preview in previews:
        assert preview.error is not None
        assert "needs 1100 MiB" in preview.error
        assert preview.node_ids == ()


def test_previews_without_nodes_say_so() -> None:
    previews = placement_previews(CARD, make_state())
    assert len(previews) == 2
    assert all(p.error is not None and "no nodes are known" in p.error for p in previews)
