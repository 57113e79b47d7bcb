"""How a pipeline's layers are split over its ranks (used by `placement`): in proportion to
the nodes' available memory (exo's rule, `layer_split`), or, when every node measured its
speed, so that the slowest rank's predicted decode stage is as short as the nodes' memory
allows (`speed_balanced_split`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from exo.master.placement_memory import pipeline_share_bytes
from exo.master.speed_prediction import DEFAULT_PROMPT_TOKENS, decode_stage_seconds
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import NodeSpeed


class PlacementError(ValueError):
    """No valid placement; the message says why in words a user can act on."""


def layer_split(n_layers: int, weights: Sequence[int]) -> list[int]:
    """Split `n_layers` in proportion to `weights`, each part at least 1.

    Largest-remainder (Hamilton) apportionment of the layers left after giving each part
    one. Raises:
        PlacementError: fewer layers than parts, or no weights.
    """
    parts = len(weights)
    if parts == 0:
        raise PlacementError("no nodes to split the layers over")
    if n_layers < parts:
        raise PlacementError(f"{n_layers} layers cannot give each of {parts} nodes one")
    spare = n_layers - parts
    total = sum(weights)
    quotas = [spare * w / total if total > 0 else spare / parts for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(parts), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: spare - sum(counts)]:
        counts[i] += 1
    return [1 + c for c in counts]


def speed_balanced_split(
    card: ModelCard,
    speeds: Sequence[NodeSpeed],
    available_bytes: Sequence[int],
    kv_cache_tokens: Sequence[int] | None = None,
) -> list[int] | None:
    """Layer counts per rank (in rank order) that minimize the slowest rank's predicted
    decode stage (`decode_stage_seconds` with `DEFAULT_PROMPT_TOKENS` of context; rank 0
    holds the embedding, the last rank the LM head), each rank's share within its
    `available_bytes` (`pipeline_share_bytes` with its node's `kv_cache_tokens`; None:
    the default everywhere), at least one layer each; ties go to the
    split whose stages are most even (layers taken, one at a time, from the slowest rank).

    The bottleneck split: the smallest time T at which the most layers each rank can hold
    within T (and its memory) add up to `card.n_layers` (T is one of the W x L stage times).
    Returns None when no split fits the memory.
    """
    world_size, n_layers = len(speeds), card.n_layers
    if world_size == 0 or world_size > n_layers or len(available_bytes) != world_size:
        return None
    last = world_size - 1
    most = n_layers - last  # the others keep one layer each

    def stage(rank: int, layers: int) -> float:
        share = WeightShare(
            layers=layers,
            holds_embedding=rank == 0,
            holds_output_layer=rank == last,
            holds_vision_tower=rank == 0,
        )
        return decode_stage_seconds(card, speeds[rank], share, DEFAULT_PROMPT_TOKENS)

    def fitting_layers(rank: int) -> int:
        """The most layers (up to `most`) whose share fits the rank's memory (the share
        grows with the layers), 0 if none."""
        low, high = 0, most
        while low < high:
            middle = (low + high + 1) // 2
            tokens = None if kv_cache_tokens is None else kv_cache_tokens[rank]
            share = pipeline_share_bytes(card, middle, rank == 0, rank == last, tokens)
            if share <= available_bytes[rank]:
                low = middle
            else:
                high = middle - 1
        return low

    # A stage's time is affine in its layers (fixed head and embedding parts plus a
    # per-layer part), so two evaluations give each rank's row: one stage time per layer
    # count that fits its memory. (Evaluating every entry took 1.9 s for the previews of
    # an 80-layer model on 8 nodes.)
    times: list[list[float | None]] = []
    for rank in range(world_size):
        first, per_layer = stage(rank, 1), stage(rank, 2) - stage(rank, 1)
        fitting = fitting_layers(rank)
        row: list[float | None] = []
        for layers in range(1, most + 1):
            row.append(first + (layers - 1) * per_layer if layers <= fitting else None)
        times.append(row)

    def counts_within(bound: float) -> list[int]:
        # Stage times grow with the layers, so each rank's count is a prefix of its row.
        return [
            sum(1 for _ in itertools.takewhile(lambda t: t is not None and t <= bound, row))
            for row in times
        ]

    def fits(counts: list[int]) -> bool:
        return min(counts) >= 1 and sum(counts) >= n_layers

    bounds = sorted({t for row in times for t in row if t is not None})
    if not bounds or not fits(counts_within(bounds[-1])):
        return None
    low, high = 0, len(bounds) - 1  # the smallest feasible bound, by bisection
    while low < high:
        middle = (low + high) // 2
        if fits(counts_within(bounds[middle])):
            high = middle
        else:
            low = middle + 1
    counts = counts_within(bounds[low])
    while sum(counts) > n_layers:
        slowest = max(
            (rank for rank in range(world_size) if counts[rank] > 1),
            key=lambda rank: (times[rank][counts[rank] - 1] or 0.0, -rank),
        )
        counts[slowest] -= 1
    return counts
