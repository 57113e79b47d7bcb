"""A vision card's tower in memory estimates and placement: its float32 bytes count on the
one rank that runs it (a single node, or rank 0 of a split), never on the other ranks."""

from __future__ import annotations

from exo.master.placement import MEMORY_OVERHEAD_FRACTION, pipeline_share_bytes, placement_previews
from exo.master.placement_memory import required_memory_bytes
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.memory import (
    VISION_TOWER_LOADING_EXTRA_COPIES,
    loading_peak_bytes,
    resident_weight_bytes,
    vision_tower_bytes,
)
from exo.shared.models.weight_formats import FLOAT32_BYTES
from exo.shared.models.weight_share import WeightShare, whole_model
from exo.shared.parallelism import parallelism
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.nodes import TopologyEdge
from exo.shared.types.state import State
from exo.testing.builders import make_node_info, make_state

NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
# Gemma 3 4B: a 417M-parameter vision encoder beside a 3.9B text model (34 layers).
VISION = load_builtin_cards()[ModelId("google/gemma-3-4b-it")]
# The same card without the "vision" capability: the engine loads no tower for it.
TEXT = VISION.model_copy(update={"capabilities": ("text",)})
TOWER = VISION.vision_parameter_count * FLOAT32_BYTES


def two_nodes(mib_each: int) -> State:
    """Two linked nodes with `mib_each` MiB available each (the default KV budget)."""
    nodes = {node: make_node_info(mib_each) for node in (NODE_A, NODE_B)}
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


def test_the_tower_is_float32_vision_parameters_and_nothing_for_a_text_card() -> None:
    assert VISION.vision_parameter_count == 417_000_000
    assert vision_tower_bytes(VISION) == TOWER == 1_668_000_000  # ~1.6 GiB
    assert vision_tower_bytes(TEXT) == 0
    for weight_format in ("int4", "int8", "float32"):
        whole = resident_weight_bytes(VISION, weight_format)
        assert whole - resident_weight_bytes(TEXT, weight_format) == TOWER


def test_a_pipeline_split_counts_the_tower_on_rank_0_only() -> None:
    pipeline = parallelism("pipeline")
    ranges = ((0, 17), (17, 34))
    first, second = (pipeline.weight_share(VISION, rank, 2, ranges[rank]) for rank in range(2))
    assert first.holds_vision_tower and not second.holds_vision_tower
    grown = resident_weight_bytes(VISION, "int4", first) - resident_weight_bytes(
        TEXT, "int4", first
    )
    assert grown == TOWER
    same = resident_weight_bytes(VISION, "int4", second) == resident_weight_bytes(
        TEXT, "int4", second
    )
    assert same
    # What placement reserves per rank (the peak, its overhead fraction): rank 0 grows by
    # the tower at least (twice while it loads, less the text model's transient).
    reserved = pipeline_share_bytes(VISION, 17, True, False) - pipeline_share_bytes(
        TEXT, 17, True, False
    )
    overhead = 1 + MEMORY_OVERHEAD_FRACTION
    assert TOWER * overhead <= reserved <= 3 * TOWER * overhead
    assert pipeline_share_bytes(VISION, 17, False, True) == pipeline_share_bytes(
        TEXT, 17, False, True
    )


def test_a_tensor_split_counts_the_tower_on_rank_0_only() -> None:
    tensor = parallelism("tensor")
    shares = [tensor.weight_share(VISION, rank, 2, (0, 34)) for rank in range(2)]
    assert [share.holds_embedding for share in shares] == [True, True]
    assert [share.holds_vision_tower for share in shares] == [True, False]
    sizes = [resident_weight_bytes(VISION, "int4", share) for share in shares]
    assert sizes[0] - sizes[1] == TOWER


def test_loading_the_tower_peaks_at_two_float32_copies() -> None:
    """The tower loads after the text model, each checkpoint tensor copied into the module
    as it is read from the mapped file: that moment holds the tower about twice (measured
    1.7-2.1x, `VISION_TOWER_LOADING_EXTRA_COPIES`)."""
    whole = whole_model(VISION)
    assert VISION_TOWER_LOADING_EXTRA_COPIES == 1
    float32 = loading_peak_bytes(VISION, "float32")
    assert float32 == resident_weight_bytes(VISION, "float32") + TOWER
    text_phase = loading_peak_bytes(TEXT, "int4") - resident_weight_bytes(TEXT, "int4")
    peak = loading_peak_bytes(VISION, "int4", whole)
    assert text_phase < 2 * TOWER  # Gemma 3 4B: the tower's phase is the peak
    assert peak == resident_weight_bytes(VISION, "int4") + TOWER
    no_tower = WeightShare(layers=34, holds_vision_tower=False)
    assert loading_peak_bytes(VISION, "int4", no_tower) == loading_peak_bytes(TEXT, "int4")


def test_one_node_needs_room_for_the_tower() -> None:
    grown = required_memory_bytes(VISION) - required_memory_bytes(TEXT)
    overhead = 1 + MEMORY_OVERHEAD_FRACTION
    assert TOWER * overhead <= grown <= 3 * TOWER * overhead


def test_previews_put_the_tower_on_rank_0_of_each_split() -> None:
    """Two nodes of 10,000 MiB (the whole model needs ~11,200 at its loading peak): the
    memory split gives rank 0 fewer layers (it keeps the tower), and each preview's rank-0
    bytes carry the tower, rank 1's not."""
    state = two_nodes(10_000)
    by_kind = {(p.sharding, p.node_count): p for p in placement_previews(VISION, state)}
    text = {(p.sharding, p.node_count): p for p in placement_previews(TEXT, state)}
    pipeline, text_pipeline = by_kind[("pipeline", 2)], text[("pipeline", 2)]
    assert pipeline.error is None and text_pipeline.error is None
    assert text_pipeline.layer_ranges == ((0, 17), (17, 34))
    (start, cut), _ = pipeline.layer_ranges
    assert start == 0 and cut < 17  # the tower's rank holds fewer layers
    assert pipeline.bytes_per_node == (
        pipeline_share_bytes(VISION, cut, True, False),
        pipeline_share_bytes(VISION, 34 - cut, False, True),
    )
    assert pipeline.bytes_per_node[1] == pipeline_share_bytes(TEXT, 34 - cut, False, True)
    tensor, text_tensor = by_kind[("tensor", 2)], text[("tensor", 2)]
    assert tensor.error is None and text_tensor.error is None
    grown = [v - t for v, t in zip(tensor.bytes_per_node, text_tensor.bytes_per_node, strict=True)]
    overhead = 1 + MEMORY_OVERHEAD_FRACTION
    assert TOWER * overhead <= grown[0] <= 3 * TOWER * overhead
    assert grown[1] == 0
