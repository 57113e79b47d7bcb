"""Pipeline parallelism: each rank holds a contiguous range of decoder layers, the first
also the embedding, the last the final norm and LM head; hidden states pass rank to rank
and the last rank's logits go back to rank 0."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import ClassVar

from exo.shared.parallelism.base import (
    LayerRange,
    Parallelism,
    Sharding,
    ShardMetadata,
    StepNetwork,
)
from exo.shared.types.models import ModelCard

# The sampled token's way back to rank 0 (a few bytes).
TOKEN_BYTES = 8


class PipelineParallelism(Parallelism):
    sharding: ClassVar[Sharding] = "pipeline"

    def tensor_parallel_ranks(self, world_size: int) -> int:
        return 1

    def holds_embedding(self, rank: int, world_size: int) -> bool:
        return rank == 0

    def holds_output_layer(self, rank: int, world_size: int) -> bool:
        return rank == world_size - 1

    def split_error(self, card: ModelCard, world_size: int) -> str | None:
        return None  # the layer split itself says when a node gets no layer

    def layer_ranges(
        self, n_layers: int, world_size: int, layer_counts: Callable[[], Sequence[int]]
    ) -> tuple[LayerRange, ...]:
        counts = list(layer_counts())
        starts = list(itertools.accumulate([0, *counts[:-1]]))
        return tuple((s, s + c) for s, c in zip(starts, counts, strict=True))

    def shard_error(self, shard: ShardMetadata) -> str | None:
        return None

    def step_seconds(
        self,
        card: ModelCard,
        stage_seconds: Sequence[float],
        network: StepNetwork,
        activation_bytes: float,
    ) -> float:
        """Stages in sequence plus one transfer per hop of the round."""
        world_size = len(stage_seconds)
        forward = sum(network.hop_seconds(rank, activation_bytes) for rank in range(world_size - 1))
        back = network.hop_seconds(world_size - 1, TOKEN_BYTES)
        return sum(stage_seconds) + forward + back
