"""Tensor parallelism: every rank holds every layer with a slice of each attention and MLP
linear (whole heads, an equal part of the MLP) and of the KV heads, plus the embedding and
its rows of the LM head; the row-parallel linears all-reduce, twice per layer, and the
ranks gather the logits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from exo.shared.models.memory import vocab_share
from exo.shared.models.weight_formats import FLOAT32_BYTES
from exo.shared.parallelism.base import (
    EveryLayerParallelism,
    Sharding,
    ShardMetadata,
    StepNetwork,
)
from exo.shared.types.models import ModelCard


class TensorParallelism(EveryLayerParallelism):
    sharding: ClassVar[Sharding] = "tensor"

    def tensor_parallel_ranks(self, world_size: int) -> int:
        return world_size

    def holds_embedding(self, rank: int, world_size: int) -> bool:
        return True

    def holds_output_layer(self, rank: int, world_size: int) -> bool:
        return True

    def split_error(self, card: ModelCard, world_size: int) -> str | None:
        """The card allows tensor parallelism, and its attention heads, KV heads and MLP
        (intermediate) size each divide by the node count (every rank gets whole heads and
        an equal slice of the MLP)."""
        if world_size == 1:
            return None
        # The shapes first: they give the user the concrete reason.
        for what, value in (
            (f"{card.num_attention_heads} attention heads do", card.num_attention_heads),
            (f"{card.num_key_value_heads} KV heads do", card.num_key_value_heads),
            (f"MLP size ({card.intermediate_size}) does", card.intermediate_size),
        ):
            if value % world_size:
                return (
                    f"{card.model_id} cannot be tensor-split over {world_size} nodes: its "
                    f"{what} not divide by {world_size}"
                )
        if not card.supports_tensor:
            return f"{card.model_id} does not support tensor parallelism"
        return None

    def shard_error(self, shard: ShardMetadata) -> str | None:
        return self.every_layer_error(shard)

    def step_seconds(
        self,
        card: ModelCard,
        stage_seconds: Sequence[float],
        network: StepNetwork,
        activation_bytes: float,
    ) -> float:
        """The slowest rank plus two all-reduces per layer, the logits' gather (each rank
        sends its share of the vocabulary, float32, to every other) and the step header
        rank 0 sends every rank before the step."""
        world_size = len(stage_seconds)
        all_reduce = network.all_reduce_seconds(activation_bytes)
        share = vocab_share(card.vocab_size, world_size) * FLOAT32_BYTES
        gather = network.all_gather_seconds(share)
        return (
            max(stage_seconds) + 2 * card.n_layers * all_reduce + gather + network.latency_seconds()
        )
