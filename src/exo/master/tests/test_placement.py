"""Placement rules on built states: single nodes, pipeline and tensor groups."""

from __future__ import annotations

import pytest

from exo.master.placement import (
    MEMORY_OVERHEAD_FRACTION,
    PlacementError,
    layer_split,
    pipeline_share_bytes,
    place_instance,
    placement_previews,
    rendezvous_port,
    tensor_split_error,
)
from exo.master.placement_memory import required_memory_bytes
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS, kv_cache_budget_bytes
from exo.shared.models.memory import (
    RUNNER_PROCESS_OVERHEAD_BYTES,
    loading_peak_bytes,
    resident_weight_bytes,
)
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.nodes import DownloadCompleted, GpuInfo, TopologyEdge
from exo.shared.types.state import State
from exo.testing.builders import MIB, make_card, make_node_info, make_state, smollm2_card

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
NODE_C = NodeId("node-c")
INSTANCE = InstanceId("instance-1")
# SmolLM2's layers with a small vocabulary: memory is mostly decoder layers, so pipeline
# shares grow with the layers they hold.
CARD = make_card(n_layers=12).model_copy(update={"vocab_size": 512})
TENSOR_CARD = make_card(n_layers=12, supports_tensor=True).model_copy(
    update={"num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 512}
)
# What one node needs for the whole model (int4 serving peak + 10% + the runner process),
# in whole MiB; the runner process alone; and the model's part of NEED_MIB.
NEED_MIB = -(-required_memory_bytes(CARD) // MIB)
PROCESS_MIB = RUNNER_PROCESS_OVERHEAD_BYTES // MIB
MODEL_MIB = NEED_MIB - PROCESS_MIB


def mib(value: int) -> str:
    return f"{value / MIB:.0f} MiB"


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


def test_required_memory_is_the_int4_serving_peak_plus_overhead() -> None:
    assert MEMORY_OVERHEAD_FRACTION == 0.10
    whole = WeightShare(layers=12)
    peak = loading_peak_bytes(CARD, "int4", whole)
    serving = resident_weight_bytes(CARD, "int4") + kv_cache_budget_bytes(CARD, whole)
    process = RUNNER_PROCESS_OVERHEAD_BYTES
    assert required_memory_bytes(CARD) == int(max(peak, serving) * 1.1) + process
    assert process == 320 * MIB  # bench/bench_runner_memory.py: USS 299 MiB warmed up
    # The KV-cache budget: layers x KV heads x head dim x (key, value) x bfloat16 per token.
    assert kv_cache_budget_bytes(CARD, whole) == DEFAULT_KV_CACHE_TOKENS * 12 * 3 * 64 * 2 * 2
    # Far below the float32 weights plus that budget: placement reserves what the engine holds.
    real = smollm2_card()
    kv = kv_cache_budget_bytes(real)
    model_part = required_memory_bytes(real) - process
    assert model_part < 0.7 * resident_weight_bytes(real, "float32") + 1.1 * kv
    # Tensor ranks split the layers and KV heads, not the embedding and LM head.
    half = required_memory_bytes(CARD, world_size=2)
    assert required_memory_bytes(CARD) / 2 < half < required_memory_bytes(CARD)


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
    instance = place_instance(CARD, state_with(node_a=NEED_MIB, node_b=5 * NEED_MIB), INSTANCE)
    assert instance.sharding == "pipeline"
    assignments = instance.shard_assignments
    # The node with the most memory; one node is preferred over a split.
    assert assignments.node_to_runner == {NODE_B: RunnerId("instance-1-rank0")}
    shard = assignments.runner_to_shard[RunnerId("instance-1-rank0")]
    assert shard.sharding == "pipeline"
    assert (shard.start_layer, shard.end_layer, shard.world_size) == (0, 12, 1)
    assert instance.rendezvous is None


def test_nodes_holding_the_files_are_preferred_over_more_memory() -> None:
    state = state_with(node_a=2 * NEED_MIB, node_b=5 * NEED_MIB)
    held = {NODE_A: {CARD.model_id: DownloadCompleted(path="/models/x")}}
    state = state.model_copy(update={"downloads": held})
    instance = place_instance(CARD, state, INSTANCE)
    assert list(instance.shard_assignments.node_to_runner) == [NODE_A]


def offline(state: State, node_id: NodeId) -> State:
    nodes = dict(state.node_info)
    nodes[node_id] = nodes[node_id].model_copy(update={"offline": True})
    return state.model_copy(update={"node_info": nodes})


def test_an_offline_node_without_the_files_is_placed_last() -> None:
    # node-b has more memory but runs --offline with no copy: it could not fetch the files.
    state = offline(state_with(node_a=2 * NEED_MIB, node_b=5 * NEED_MIB), NODE_B)
    instance = place_instance(CARD, state, INSTANCE)
    assert list(instance.shard_assignments.node_to_runner) == [NODE_A]
    # Holding the files, the offline node is as good as any.
    held = {NODE_B: {CARD.model_id: DownloadCompleted(path="/models/x")}}
    instance = place_instance(CARD, state.model_copy(update={"downloads": held}), INSTANCE)
    assert list(instance.shard_assignments.node_to_runner) == [NODE_B]
    # A lone offline node is still used: its files may be on its disk unreported.
    lone = offline(state_with(node_a=2 * NEED_MIB), NODE_A)
    instance = place_instance(CARD, lone, INSTANCE)
    assert list(instance.shard_assignments.node_to_runner) == [NODE_A]


def test_too_big_for_one_node_splits_layers_by_memory() -> None:
    # Each node runs a runner process; the layers split by the memory beyond it.
    state = state_with(
        node_a=PROCESS_MIB + MODEL_MIB * 9 // 10, node_b=PROCESS_MIB + MODEL_MIB * 7 // 10
    )
    instance = place_instance(CARD, state, INSTANCE)
    assignments = instance.shard_assignments
    assert list(assignments.node_to_runner) == [NODE_A, NODE_B]
    shards = [assignments.runner_to_shard[runner] for runner in assignments.node_to_runner.values()]
    assert [(s.start_layer, s.end_layer) for s in shards if s.sharding == "pipeline"] == [
        (0, 7),
        (7, 12),
    ]  # 12 layers split 9:7 (the available memory)
    assert [s.device_rank for s in shards] == [0, 1]
    rendezvous = instance.rendezvous
    assert rendezvous is not None
    assert rendezvous.backend == "gloo"
    assert rendezvous.port == rendezvous_port(INSTANCE)
    # Node B reaches rank 0 (node A) on the address it measured.
    assert rendezvous.addresses[NODE_B] == "10.0.0.1"


def test_a_split_needs_each_share_to_fit() -> None:
    # Enough memory in total, but B's share (a layer, the LM head) does not fit in it.
    layer_and_head_mib = pipeline_share_bytes(CARD, 1) // MIB - PROCESS_MIB
    state = state_with(node_a=NEED_MIB, node_b=PROCESS_MIB + layer_and_head_mib // 4)
    with pytest.raises(PlacementError, match="node-b would need"):
        place_instance(CARD, state, INSTANCE, min_nodes=2)


def test_nodes_without_a_link_are_not_grouped() -> None:
    state = state_with(linked=False, node_a=NEED_MIB * 6 // 10, node_b=NEED_MIB * 6 // 10)
    with pytest.raises(PlacementError, match="no measured link"):
        place_instance(CARD, state, INSTANCE)


def test_not_enough_memory_anywhere_says_how_much_in_mib() -> None:
    with pytest.raises(PlacementError) as error:
        place_instance(CARD, state_with(node_a=NEED_MIB // 2, node_b=NEED_MIB // 3), INSTANCE)
    message = str(error.value)
    # Two nodes need the model once and two runner processes.
    two_nodes = required_memory_bytes(CARD) + RUNNER_PROCESS_OVERHEAD_BYTES
    assert (
        f"needs {mib(two_nodes)} but these 2 nodes have {NEED_MIB // 2 + NEED_MIB // 3} MiB"
        in message
    )
    assert str(CARD.model_id) in message


def test_min_nodes_forces_a_split() -> None:
    instance = place_instance(
        CARD, state_with(node_a=5000, node_b=5000, node_c=5000), INSTANCE, min_nodes=3
    )
    assert instance.shard_assignments.world_size == 3


def test_ranks_other_than_zero_link_where_they_measured_each_other() -> None:
    # Ranks reach each other on networks rank 0 may not be on: each pair of ranks other
    # than 0 carries the addresses its measured links name (node c's link to b removed).
    state = state_with(node_a=5000, node_b=5000, node_c=5000)
    topology = {
        source: {sink: e for sink, e in edges.items() if (source, sink) != (NODE_C, NODE_B)}
        for source, edges in state.topology.items()
    }
    state = state.model_copy(update={"topology": topology})
    instance = place_instance(CARD, state, INSTANCE, min_nodes=3)
    rendezvous = instance.rendezvous
    assert rendezvous is not None
    rank_zero, *others = instance.shard_assignments.node_to_runner
    assert rank_zero == NODE_A and set(others) == {NODE_B, NODE_C}
    assert rendezvous.link_addresses == {NODE_B: {NODE_C: "10.0.0.3"}}


def test_min_nodes_above_the_cluster_size_is_an_error() -> None:
    with pytest.raises(PlacementError, match="min_nodes=2 but only 1"):
        place_instance(CARD, state_with(node_a=5000), INSTANCE, min_nodes=2)


def test_node_ids_restrict_the_candidates() -> None:
    instance = place_instance(
        CARD, state_with(node_a=NEED_MIB, node_b=9 * NEED_MIB), INSTANCE, node_ids=[NODE_A]
    )
    assert list(instance.shard_assignments.node_to_runner) == [NODE_A]


def test_unknown_node_id_is_an_error_naming_it() -> None:
    with pytest.raises(PlacementError, match="node-x"):
        place_instance(CARD, state_with(node_a=5000), INSTANCE, node_ids=[NodeId("node-x")])


def test_no_known_nodes_is_an_error() -> None:
    with pytest.raises(PlacementError, match="no nodes are known"):
        place_instance(CARD, State(), INSTANCE)


def test_tensor_sharding_splits_every_layer() -> None:
    model = -(-required_memory_bytes(TENSOR_CARD) // MIB) - PROCESS_MIB
    state = state_with(node_a=PROCESS_MIB + model * 6 // 10, node_b=PROCESS_MIB + model * 6 // 10)
    instance = place_instance(TENSOR_CARD, state, INSTANCE, sharding="tensor")
    assert instance.sharding == "tensor"
    shards = list(instance.shard_assignments.runner_to_shard.values())
    assert all(s.sharding == "tensor" and s.world_size == 2 for s in shards)


def test_tensor_sharding_needs_support_and_divisible_heads() -> None:
    state = state_with(node_a=NEED_MIB, node_b=NEED_MIB)
    # A card that does not allow it, with shapes that divide.
    unsupported = TENSOR_CARD.model_copy(update={"supports_tensor": False})
    with pytest.raises(PlacementError, match="does not support tensor"):
        place_instance(unsupported, state, INSTANCE, sharding="tensor", min_nodes=2)
    # SmolLM2's 9 heads do not divide by 2.
    nine_heads = TENSOR_CARD.model_copy(update={"num_attention_heads": 9})
    with pytest.raises(PlacementError, match=r"9 attention heads do not divide by 2"):
        place_instance(nine_heads, state, INSTANCE, sharding="tensor", min_nodes=2)


def test_a_dense_model_split_by_experts_is_refused_whatever_min_nodes() -> None:
    # Room for the whole model on one node: the refusal is not about memory.
    state = state_with(node_a=9 * NEED_MIB, node_b=9 * NEED_MIB)
    for min_nodes in (1, 2):
        with pytest.raises(PlacementError, match="not a mixture-of-experts model"):
            place_instance(CARD, state, INSTANCE, sharding="expert", min_nodes=min_nodes)
    # Also where no node has room: the reason is the model, not a memory figure.
    with pytest.raises(PlacementError, match="not a mixture-of-experts model"):
        place_instance(CARD, state_with(node_a=1), INSTANCE, sharding="expert")
    previews = {(p.sharding, p.node_count): p for p in placement_previews(CARD, state)}
    assert "not a mixture-of-experts model" in (previews[("expert", 1)].error or "")
    assert previews[("pipeline", 1)].error is None


def test_all_cuda_nodes_use_nccl() -> None:
    gpu = (GpuInfo(name="H200", total_memory_bytes=140 * 2**30),)
    state = state_with(node_a=NEED_MIB, node_b=NEED_MIB)
    nodes = {n: info.model_copy(update={"gpus": gpu}) for n, info in state.node_info.items()}
    state = state.model_copy(update={"node_info": nodes})
    instance = place_instance(CARD, state, INSTANCE, min_nodes=2)
    assert instance.rendezvous is not None and instance.rendezvous.backend == "nccl"


def test_previews_list_every_sharding_and_node_count_with_reasons() -> None:
    need = required_memory_bytes(TENSOR_CARD) // MIB
    model = need - PROCESS_MIB
    state = state_with(node_a=PROCESS_MIB + model * 9 // 10, node_b=PROCESS_MIB + model * 7 // 10)
    previews = {(p.sharding, p.node_count): p for p in placement_previews(TENSOR_CARD, state)}
    assert set(previews) == {
        (sharding, count) for sharding in ("pipeline", "tensor", "expert") for count in (1, 2)
    }
    # A dense model is not split by experts, and the preview says why.
    assert "not a mixture-of-experts model" in (previews[("expert", 2)].error or "")
    assert previews[("pipeline", 1)].error is not None
    assert f"needs {mib(required_memory_bytes(TENSOR_CARD))}" in (
        previews[("pipeline", 1)].error or ""
    )
    split = previews[("pipeline", 2)]
    assert split.error is None
    assert split.node_ids == (NODE_A, NODE_B)
    assert split.layer_ranges == ((0, 7), (7, 12))
    # Each share with the KV-cache budget placement sized from the nodes' memory.
    tokens = split.kv_cache_tokens
    assert tokens is not None and tokens >= DEFAULT_KV_CACHE_TOKENS
    assert split.bytes_per_node == (
        pipeline_share_bytes(TENSOR_CARD, 7, is_first=True, is_last=False, kv_cache_tokens=tokens),
        pipeline_share_bytes(TENSOR_CARD, 5, is_first=False, is_last=True, kv_cache_tokens=tokens),
    )
    # A tensor rank holds half of every layer (and the whole embedding and LM head).
    tensor = previews[("tensor", 2)]
    tensor_share = required_memory_bytes(TENSOR_CARD, 2, tensor.kv_cache_tokens)
    assert tensor.error is None
    assert tensor.bytes_per_node == (tensor_share, tensor_share)
    assert "node-b would need" in (
        placement_previews(TENSOR_CARD, state_with(node_a=need, node_b=PROCESS_MIB + model // 3))[
            3
        ].error
        or ""
    )


def test_previews_without_nodes_say_so() -> None:
    previews = placement_previews(CARD, State())
    assert len(previews) == 3  # one per parallelism kind
    assert all(p.error is not None for p in previews)


def test_instance_ids_decide_the_rendezvous_port() -> None:
    assert rendezvous_port(InstanceId("a")) == rendezvous_port(InstanceId("a"))
    assert 20000 <= rendezvous_port(InstanceId("b")) < 30000
    assert ModelId(CARD.model_id) == CARD.model_id


def test_a_tensor_refusal_names_the_shape_that_does_not_divide() -> None:
    # SmolLM2-135M: 9 attention heads, 3 KV heads, MLP 1536; its card allows no tensor split.
    card = smollm2_card()
    over_two = tensor_split_error(card, 2)
    assert over_two is not None and "its 9 attention heads do not divide by 2" in over_two
    # Over 3 nodes every shape divides: the card's own flag is the reason.
    over_three = tensor_split_error(card, 3)
    assert over_three is not None and "does not support tensor parallelism" in over_three
    assert tensor_split_error(card, 1) is None


def test_a_card_whose_architecture_the_engine_does_not_run_is_not_placed() -> None:
    """A catalog card can precede its engine family (DeepSeek-V3.1's card before the
    deepseek_v3 family): placing it would download its weights and then fail to load, so it
    is refused up front, and every preview says why."""
    card = CARD.model_copy(update={"architecture": "NoSuchFamilyForCausalLM"})
    state = state_with(node_a=5 * NEED_MIB, node_b=5 * NEED_MIB)
    with pytest.raises(PlacementError, match="no model family for NoSuchFamilyForCausalLM"):
        place_instance(card, state, INSTANCE)
    previews = placement_previews(card, state)
    assert previews and all("NoSuchFamilyForCausalLM" in (p.error or "") for p in previews)
    # The same card with an architecture the engine runs is placed.
    assert place_instance(CARD, state, INSTANCE).model_id == CARD.model_id


def test_a_card_the_engine_cannot_serve_yet_is_refused_with_its_reason() -> None:
    """A card saying why the engine cannot serve it (`cannot_serve`) is refused with that
    reason, in placement and in every preview."""
    state = state_with(node_a=5 * NEED_MIB, node_b=5 * NEED_MIB)
    blocked = CARD.model_copy(update={"cannot_serve": "its tokenizer needs custom code"})
    with pytest.raises(PlacementError, match="its tokenizer needs custom code"):
        place_instance(blocked, state, INSTANCE)
    assert all("custom code" in (p.error or "") for p in placement_previews(blocked, state))


def test_kimi_k2_is_placed_across_nodes_that_hold_it() -> None:
    """Kimi-K2's TikToken tokenizer is built from its files (`tokenizer_loading`), so its
    card says nothing against serving it; 1 TB of weights split over three 512 GiB nodes."""
    (kimi,) = [card for card in load_builtin_cards().values() if "Kimi-K2" in card.model_id]
    assert kimi.cannot_serve is None
    state = state_with(node_a=512 * 1024, node_b=512 * 1024, node_c=512 * 1024)
    instance = place_instance(kimi, state, INSTANCE)
    assert instance.model_id == kimi.model_id
    assert instance.shard_assignments.world_size >= 2


def test_an_encoder_card_reserves_no_kv_budget_and_is_never_split() -> None:
    """An encoder (embedding-only) card: its float32 weights and no KV cache are what a
    runner needs (no chat KV budget), and it is placed whole on one node: a request for
    more nodes is refused saying so."""
    card = load_builtin_cards()[ModelId("BAAI/bge-m3")]
    assert kv_cache_budget_bytes(card) == 0
    weights = resident_weight_bytes(card, "int4")
    assert weights == resident_weight_bytes(card, "float32") == card.storage_size_bytes
    assert loading_peak_bytes(card, "int4") == weights
    expected = int(weights * (1 + MEMORY_OVERHEAD_FRACTION)) + RUNNER_PROCESS_OVERHEAD_BYTES
    assert required_memory_bytes(card) == expected
    state = state_with(node_a=5000, node_b=5000)
    instance = place_instance(card, state, INSTANCE)
    assert instance.shard_assignments.world_size == 1
    with pytest.raises(PlacementError, match=r"encoder model .* never split"):
        place_instance(card, state, INSTANCE, min_nodes=2)
