"""The speed-balanced pipeline split: the layer counts that minimize the slowest stage
(against a brute force over every split), within each node's memory, and placement using
it for measured nodes only."""

from __future__ import annotations

import pytest

from exo.master.placement import placement_previews, speed_balanced_split
from exo.master.placement_memory import pipeline_share_bytes
from exo.master.speed_prediction import DEFAULT_PROMPT_TOKENS, decode_stage_seconds
from exo.master.tests.speed_builders import CARD, A, B, link, speed
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import NodeSpeed
from exo.testing.builders import make_node_info, make_state

ROOMY = 10**12  # bytes: memory never binds


def stage_times(card: ModelCard, speeds: list[NodeSpeed], counts: list[int]) -> list[float]:
    last = len(counts) - 1
    return [
        decode_stage_seconds(
            card, node, WeightShare(layers=n, holds_embedding=r == 0, holds_output_layer=r == last),
            DEFAULT_PROMPT_TOKENS,
        )
        for r, (node, n) in enumerate(zip(speeds, counts, strict=True))
    ]  # fmt: skip


def brute_force_bottleneck(card: ModelCard, speeds: list[NodeSpeed], room: list[int]) -> float:
    """The smallest slowest-stage time over every split (compositions of the layers)."""
    best = float("inf")

    def splits(layers: int, parts: int) -> list[list[int]]:
        if parts == 1:
            return [[layers]]
        return [[first, *rest] for first in range(1, layers - parts + 2)
                for rest in splits(layers - first, parts - 1)]  # fmt: skip

    for counts in splits(card.n_layers, len(speeds)):
        last = len(counts) - 1
        if all(
            pipeline_share_bytes(card, n, r == 0, r == last) <= room[r]
            for r, n in enumerate(counts)
        ):
            best = min(best, max(stage_times(card, speeds, counts)))
    return best


@pytest.mark.parametrize(
    ("gbps", "room"),
    [
        ((10.0, 10.0), (ROOMY, ROOMY)),
        ((10.0, 3.0), (ROOMY, ROOMY)),
        ((2.0, 10.0, 5.0), (ROOMY, ROOMY, ROOMY)),
        ((10.0, 10.0), (ROOMY, 0)),  # B holds no layer within its memory: no split
    ],
)
def test_the_speed_balanced_split_minimizes_the_slowest_stage(
    gbps: tuple[float, ...], room: tuple[int, ...]
) -> None:
    card = CARD.model_copy(update={"vocab_size": 32768})  # an LM head worth a few layers
    speeds = [speed(int4_gbps=g) for g in gbps]
    counts = speed_balanced_split(card, speeds, list(room))
    best = brute_force_bottleneck(card, speeds, list(room))
    if best == float("inf"):
        assert counts is None
        return
    assert counts is not None and sum(counts) == card.n_layers and min(counts) >= 1
    assert max(stage_times(card, speeds, counts)) == pytest.approx(best)


def test_equal_nodes_give_the_lm_heads_rank_fewer_layers_and_a_faster_node_more() -> None:
    card = CARD.model_copy(update={"vocab_size": 32768})
    even = speed_balanced_split(card, [speed(), speed()], [ROOMY, ROOMY])
    assert even is not None and even[0] > even[1]  # the last rank also runs the LM head
    fast_first = speed_balanced_split(card, [speed(20.0), speed(5.0)], [ROOMY, ROOMY])
    assert fast_first is not None and fast_first[0] > even[0]
    # Memory still binds: rank 0 holds at most what fits (5 layers here, fewer than the
    # unbounded split gives it).
    tight = pipeline_share_bytes(card, 5, True, False)
    capped = speed_balanced_split(card, [speed(20.0), speed(5.0)], [tight, ROOMY])
    assert fast_first[0] > 5 and capped == [5, 7]


def test_placement_balances_measured_nodes_and_splits_unmeasured_ones_by_memory() -> None:
    card = CARD.model_copy(update={"vocab_size": 32768})
    fast = make_node_info(4096).model_copy(update={"speed": speed(20.0)})
    slow = make_node_info(4096, name="b").model_copy(update={"speed": speed(5.0)})
    state = make_state(nodes={A: fast, B: slow}).model_copy(update={"topology": link()})
    previews = {(p.sharding, p.node_count): p for p in placement_previews(card, state, 128)}
    expected = speed_balanced_split(card, [speed(20.0), speed(5.0)], [ROOMY, ROOMY])
    pipeline = previews[("pipeline", 2)]
    assert expected is not None and pipeline.node_ids == (A, B)
    assert [end - start for start, end in pipeline.layer_ranges] == expected
    unmeasured = state.model_copy(
        update={"node_info": {A: fast, B: slow.model_copy(update={"speed": None})}}
    )
    previews = {(p.sharding, p.node_count): p for p in placement_previews(card, unmeasured, 128)}
    assert [end - start for start, end in previews[("pipeline", 2)].layer_ranges] == [6, 6]
