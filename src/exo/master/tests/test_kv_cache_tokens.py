"""`--kv-cache-tokens`: parsed into the node's options, carried in its `NodeInfo`, and used
by placement for every share it puts on that node (the runner's engine holds the same
budget; `tests/test_single_node.py` checks it reaches the engine and `/state`)."""

from __future__ import annotations

import pytest

from exo.master.group_layout import layout
from exo.master.placement import PlacementError, place_instance, placement_previews
from exo.master.placement_memory import (
    KV_CACHE_MAX_CONTEXTS,
    pipeline_share_bytes,
    placement_room,
    required_memory_bytes,
    runner_bytes,
)
from exo.node_options import parse_args
from exo.shared.models.kv_cache_memory import (
    DEFAULT_KV_CACHE_TOKENS,
    MIN_KV_CACHE_TOKENS,
    SLIDING_WINDOW_EXTRA_POSITIONS,
    kv_budget_tokens_of_length,
    kv_cache_budget_bytes,
    kv_geometry,
    longest_length_in_kv_budget,
)
from exo.shared.models.weight_share import whole_model
from exo.shared.types.common import InstanceId, ModelId, NodeId
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard, SlidingWindow
from exo.shared.types.nodes import NodeInfo, TopologyEdge
from exo.shared.types.state import State
from exo.testing.builders import MIB, make_card, make_node_info, make_state
from exo.worker.runner.options import RunnerOptions

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
# Most of this model's serving memory is its KV budget at the default (many layers, wide KV
# heads, a small vocabulary), so the budget decides whether it fits.
CARD = make_card(n_layers=12).model_copy(
    update={"vocab_size": 512, "num_key_value_heads": 9, "num_attention_heads": 9}
)
SMALL = 1024


def node(available_bytes: int, kv_cache_tokens: int | None = DEFAULT_KV_CACHE_TOKENS) -> NodeInfo:
    info = make_node_info(-(-available_bytes // MIB))
    return info.model_copy(update={"kv_cache_tokens": kv_cache_tokens})


def linked(nodes: dict[NodeId, NodeInfo]) -> State:
    state = make_state(nodes=nodes)
    topology = {
        source: {
            sink: TopologyEdge(
                source=source, sink=sink, address="127.0.0.1", latency_ms=1, bandwidth_mbps=1
            )
            for sink in nodes
            if sink != source
        }
        for source in nodes
    }
    return state.model_copy(update={"topology": topology})


def test_the_option_is_parsed_checked_and_defaults_to_memory_sized() -> None:
    assert parse_args([]).kv_cache_tokens is None  # placement sizes it from memory
    assert parse_args(["--kv-cache-tokens", "4096"]).kv_cache_tokens == 4096
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-tokens", str(MIN_KV_CACHE_TOKENS - 1)])
    assert RunnerOptions().kv_cache_tokens is None


def test_the_kv_budget_is_sized_from_one_geometry() -> None:
    geometry = kv_geometry(CARD, whole_model(CARD))
    # A key and a value per layer and KV head, bfloat16.
    assert geometry.bytes_per_token == 12 * 9 * CARD.attention_head_dim * 2 * 2
    assert kv_cache_budget_bytes(CARD, tokens=SMALL) == SMALL * geometry.bytes_per_token
    # The KV budget is what differs between the two sizes.
    difference = required_memory_bytes(CARD) - required_memory_bytes(CARD, 1, SMALL)
    budget_difference = (DEFAULT_KV_CACHE_TOKENS - SMALL) * geometry.bytes_per_token
    assert abs(difference - int(budget_difference * 1.1)) <= 1


def test_a_node_with_a_smaller_budget_fits_what_the_default_does_not() -> None:
    room = required_memory_bytes(CARD, 1, SMALL) + MIB
    assert room < required_memory_bytes(CARD)  # the default budget does not fit
    with pytest.raises(Exception, match="needs"):
        place_instance(CARD, make_state(nodes={NODE_A: node(room)}), InstanceId("i"))
    state = make_state(nodes={NODE_A: node(room, SMALL)})
    instance = place_instance(CARD, state, InstanceId("i"))
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    # What the placed runner promises on its node is sized with the node's budget.
    placed = state.model_copy(update={"instances": {instance.instance_id: instance}})
    assert placement_room(placed)[NODE_A].promised_bytes == runner_bytes(shard, SMALL)
    assert runner_bytes(shard, SMALL) < runner_bytes(shard)


def test_each_pipeline_share_is_sized_with_its_own_nodes_budget() -> None:
    plenty = 4 * required_memory_bytes(CARD)
    state = linked({NODE_A: node(plenty, SMALL), NODE_B: node(plenty)})
    chosen = layout(CARD, state, "pipeline", [NODE_A, NODE_B])
    budgets = {NODE_A: SMALL, NODE_B: DEFAULT_KV_CACHE_TOKENS}
    last = len(chosen.nodes) - 1
    for rank, (node_id, (start, end), share) in enumerate(
        zip(chosen.nodes, chosen.layer_ranges, chosen.bytes_per_node, strict=True)
    ):
        expected = pipeline_share_bytes(
            CARD, end - start, rank == 0, rank == last, budgets[node_id]
        )
        assert share == expected


# --- the memory-sized default ------------------------------------------------------------

LONG = CARD.model_copy(update={"context_length": 32_768})
GIB = 2**30


def placed_budget(state: State, card: ModelCard = LONG, instance_id: str = "i") -> Instance:
    instance = place_instance(card, state, InstanceId(instance_id))
    assert instance.kv_cache_tokens is not None
    return instance


def test_a_node_with_room_to_spare_gets_four_contexts() -> None:
    state = make_state(nodes={NODE_A: node(64 * GIB, None)})
    instance = placed_budget(state)
    assert instance.kv_cache_tokens == KV_CACHE_MAX_CONTEXTS * LONG.context_length
    assert layout(LONG, state, "pipeline", [NODE_A]).kv_cache_tokens == instance.kv_cache_tokens


def test_a_short_context_model_gets_no_more_than_four_contexts() -> None:
    """A 512-token model's budget is four of its contexts, not the 8,192 default it could
    never fill, in the instance, its preview and the memory placement checks."""
    short = CARD.model_copy(update={"context_length": 512})
    budget = KV_CACHE_MAX_CONTEXTS * short.context_length
    assert budget < DEFAULT_KV_CACHE_TOKENS
    # Room for the runner at that budget, not at the default one.
    available = required_memory_bytes(short, 1, budget) + MIB
    assert available < required_memory_bytes(short)
    state = make_state(nodes={NODE_A: node(available, None)})
    assert placed_budget(state, short).kv_cache_tokens == budget
    (preview,) = [
        p for p in placement_previews(short, state) if (p.sharding, p.node_count) == ("pipeline", 1)
    ]
    assert preview.error is None and preview.kv_cache_tokens == budget
    # A node's own --kv-cache-tokens stays what it said.
    assert placed_budget(make_state(nodes={NODE_A: node(64 * GIB)}), short).kv_cache_tokens == (
        DEFAULT_KV_CACHE_TOKENS
    )


def test_a_node_takes_the_planned_budget_plus_half_of_what_is_left() -> None:
    available = (required_memory_bytes(LONG) // MIB + 256) * MIB  # nodes report whole MiB
    state = make_state(nodes={NODE_A: node(available, None)})
    instance = placed_budget(state)
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    budget = instance.kv_cache_tokens
    assert budget is not None
    assert DEFAULT_KV_CACHE_TOKENS < budget < KV_CACHE_MAX_CONTEXTS * LONG.context_length
    left = available - runner_bytes(shard, DEFAULT_KV_CACHE_TOKENS)
    taken = runner_bytes(shard, budget) - runner_bytes(shard, DEFAULT_KV_CACHE_TOKENS)
    per_token = runner_bytes(shard, budget + 1) - runner_bytes(shard, budget)
    # Half of what was left, to within a token's bytes (and the rounding of the overhead).
    assert abs(taken - left // 2) <= 2 * per_token
    # The node still has the other half for the next placement.
    placed = state.model_copy(update={"instances": {instance.instance_id: instance}})
    assert placement_room(placed)[NODE_A].available_bytes >= left // 2 - 2 * per_token


def test_a_second_instance_takes_its_fraction_of_what_the_first_left() -> None:
    # Room for three at the planned budget: the first takes half of what its planned
    # budget left, the second still fits in the other half (a node with room for only
    # two refuses the second: `--kv-cache-tokens` keeps the first to the planned budget).
    available = 3 * required_memory_bytes(LONG)
    state = make_state(nodes={NODE_A: node(available, None)})
    first = placed_budget(state)
    state = state.model_copy(update={"instances": {first.instance_id: first}})
    other = LONG.model_copy(update={"model_id": ModelId("other/model")})
    second = placed_budget(state, other, "j")
    assert first.kv_cache_tokens is not None and second.kv_cache_tokens is not None
    assert DEFAULT_KV_CACHE_TOKENS <= second.kv_cache_tokens < first.kv_cache_tokens
    both = state.model_copy(update={"instances": {**state.instances, "j": second}})
    # Every runner's promise, budgets included, fits in what the node reported.
    room = placement_room(both)[NODE_A]
    assert room.promised_runners == 2 and room.promised_bytes <= room.reported_bytes


def test_an_explicit_budget_is_kept_and_the_ranks_share_the_smallest() -> None:
    plenty = 64 * GIB
    state = make_state(nodes={NODE_A: node(plenty, SMALL)})
    assert placed_budget(state).kv_cache_tokens == SMALL
    state = linked({NODE_A: node(plenty, SMALL), NODE_B: node(plenty, None)})
    chosen = layout(LONG, state, "pipeline", [NODE_A, NODE_B])
    assert chosen.kv_cache_tokens == SMALL
    last = len(chosen.nodes) - 1
    for rank, ((start, end), share) in enumerate(
        zip(chosen.layer_ranges, chosen.bytes_per_node, strict=True)
    ):
        # The memory-sized node reserves the instance's budget, not its own larger one.
        assert share == pipeline_share_bytes(LONG, end - start, rank == 0, rank == last, SMALL)


def test_a_node_too_small_for_the_planned_budget_is_refused_with_its_reason() -> None:
    available = required_memory_bytes(LONG) - MIB
    with pytest.raises(PlacementError, match="needs"):
        place_instance(LONG, make_state(nodes={NODE_A: node(available, None)}), InstanceId("i"))


def test_instances_placed_before_budgets_were_carried_promise_their_nodes_budget() -> None:
    state = make_state(nodes={NODE_A: node(64 * GIB, SMALL)})
    instance = placed_budget(state).model_copy(update={"kv_cache_tokens": None})
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    placed = state.model_copy(update={"instances": {instance.instance_id: instance}})
    assert placement_room(placed)[NODE_A].promised_bytes == runner_bytes(shard, SMALL)


def test_sliding_window_layers_count_their_window_in_the_budget() -> None:
    """A card whose layers mostly slide (Gemma 3's five in six): a context costs fewer
    budget tokens, so four contexts are a smaller budget and memory, and a budget fits a
    longer request than its tokens (the API's limit and the engine's agree)."""
    sliding = LONG.model_copy(update={"sliding_window": SlidingWindow(window=512, layers=10)})
    context = kv_budget_tokens_of_length(sliding, sliding.context_length)
    kept = 512 + SLIDING_WINDOW_EXTRA_POSITIONS
    assert context == -(-(2 * 32_768 + 10 * kept) // 12)
    assert kv_budget_tokens_of_length(sliding, 300) == 300  # within the window: every layer
    for budget in (300, 8_192, context):
        longest = longest_length_in_kv_budget(sliding, budget)
        assert kv_budget_tokens_of_length(sliding, longest) <= budget
        assert kv_budget_tokens_of_length(sliding, longest + 1) > budget
    assert longest_length_in_kv_budget(sliding, context) >= sliding.context_length
    state = make_state(nodes={NODE_A: node(64 * GIB, None)})
    assert placed_budget(state, sliding).kv_cache_tokens == KV_CACHE_MAX_CONTEXTS * context
    assert required_memory_bytes(sliding, 1, KV_CACHE_MAX_CONTEXTS * context) < (
        required_memory_bytes(LONG, 1, KV_CACHE_MAX_CONTEXTS * LONG.context_length)
    )
