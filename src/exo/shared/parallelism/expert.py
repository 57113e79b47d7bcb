"""Expert parallelism: every rank holds every layer's attention and dense parts whole (and
the embedding), its share of the LM head's vocabulary (`vocab_share`, as tensor ranks: the
logits are gathered), and of each MoE layer's routed experts only its own run
(`moe.experts_of_rank`: `experts / world_size` each, uneven counts allowed); every rank
runs the whole step on every token, its experts' weighted outputs are its partial sum of
each MoE block, all-reduced once per MoE layer. A rank reads only its experts' tensors.

Replicated attention rather than tensor-split attention: one all-reduce per MoE layer
instead of two per layer, and no head-count constraint; what it costs is each rank reading
the attention weights, a small part of a MoE layer (Qwen3-30B-A3B: 19M of 623M weights).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import ClassVar

from exo.shared.models.memory import vocab_rows, vocab_share
from exo.shared.models.moe import experts_of_rank
from exo.shared.models.weight_formats import FLOAT32_BYTES
from exo.shared.models.weight_share import WeightShare
from exo.shared.parallelism.base import (
    EveryLayerParallelism,
    LayerRange,
    Sharding,
    ShardMetadata,
    StepNetwork,
)
from exo.shared.types.models import ModelCard

# A routed expert's tensor: `...layers.<n>.mlp.experts.<expert>.<linear>...`.
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class ExpertParallelism(EveryLayerParallelism):
    sharding: ClassVar[Sharding] = "expert"

    def tensor_parallel_ranks(self, world_size: int) -> int:
        return 1

    def holds_embedding(self, rank: int, world_size: int) -> bool:
        return True

    def holds_output_layer(self, rank: int, world_size: int) -> bool:
        return True

    def split_error(self, card: ModelCard, world_size: int) -> str | None:
        """The card is a mixture-of-experts model (whatever the node count: a dense model
        asked for by experts is refused, as docs/cluster.md says, even on one node) with at
        least one expert per node."""
        if card.moe is None:
            return f"{card.model_id} cannot be expert-split: it is not a mixture-of-experts model"
        if card.moe.experts < world_size:
            return (
                f"{card.model_id} cannot be expert-split over {world_size} nodes: it has "
                f"{card.moe.experts} experts per layer"
            )
        return None

    def shard_error(self, shard: ShardMetadata) -> str | None:
        error = self.every_layer_error(shard)
        if error is not None:
            return error
        if shard.world_size > 1:
            return self.split_error(shard.model_card, shard.world_size)
        return None

    def step_seconds(
        self,
        card: ModelCard,
        stage_seconds: Sequence[float],
        network: StepNetwork,
        activation_bytes: float,
    ) -> float:
        """The slowest rank plus one all-reduce per MoE layer, the logits' gather (each rank
        sends its share of the vocabulary, float32, to every other) and the step header
        rank 0 sends every rank before the step."""
        sparse = card.moe.sparse_layers(card.n_layers) if card.moe is not None else 0
        all_reduce = network.all_reduce_seconds(activation_bytes)
        share = vocab_share(card.vocab_size, len(stage_seconds)) * FLOAT32_BYTES
        gather = network.all_gather_seconds(share)
        return max(stage_seconds) + sparse * all_reduce + gather + network.latency_seconds()

    def weight_share(
        self, card: ModelCard, rank: int, world_size: int, layer_range: LayerRange
    ) -> WeightShare:
        """Every layer and the embedding; its share of the LM head's vocabulary; of each
        MoE layer the rank's experts."""
        share = super().weight_share(card, rank, world_size, layer_range)
        if card.moe is None or world_size == 1:
            return share
        experts = len(experts_of_rank(card.moe.experts, rank, world_size))
        rows = vocab_rows(card.vocab_size, rank, world_size)
        return dataclasses.replace(share, experts=experts, output_layer_rows=rows)

    def reads_tensor(self, name: str, shard: ShardMetadata) -> bool:
        """Every tensor but the routed experts of other ranks."""
        match = _EXPERT.search(name)
        moe = shard.model_card.moe
        if match is None or moe is None or shard.world_size == 1:
            return super().reads_tensor(name, shard)
        held = experts_of_rank(moe.experts, shard.device_rank, shard.world_size)
        return int(match.group(1)) in held
