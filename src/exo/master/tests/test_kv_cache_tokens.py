"""`--kv-cache-tokens`: parsed into the node's options, carried in its `NodeInfo`, and used
by placement for every share it puts on that node (the runner's engine holds the same
budget; `tests/test_single_node.py` checks it reaches the engine and `/state`)."""

from __future__ import annotations

import pytest

from exo.master.placement import layout, place_instance
from exo.master.placement_memory import (
    pipeline_share_bytes,
    placement_room,
    required_memory_bytes,
    runner_bytes,
)
from exo.node_options import parse_args
from exo.shared.models.memory import (
    DEFAULT_KV_CACHE_TOKENS,
    MIN_KV_CACHE_TOKENS,
    kv_cache_budget_bytes,
    kv_geometry,
    whole_model,
)
from exo.shared.types.common import InstanceId, NodeId
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


def node(available_bytes: int, kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS) -> NodeInfo:
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


def test_the_option_is_parsed_checked_and_defaults_to_8192() -> None:
    assert parse_args([]).kv_cache_tokens == DEFAULT_KV_CACHE_TOKENS == 8192
    assert parse_args(["--kv-cache-tokens", "4096"]).kv_cache_tokens == 4096
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-tokens", str(MIN_KV_CACHE_TOKENS - 1)])
    assert RunnerOptions().kv_cache_tokens == DEFAULT_KV_CACHE_TOKENS


def test_the_kv_budget_is_sized_from_one_geometry() -> None:
    geometry = kv_geometry(CARD, whole_model(CARD))
    assert geometry.bytes_per_token == 12 * 9 * CARD.attention_head_dim * 2 * 4
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
