"""`WeightShare`: the part of a model one node holds (layers, tensor-parallel ranks,
embedding, LM head, experts, vision tower).

Apart from `memory` (the bytes of a share's weights) and `kv_cache_memory` (the bytes of
its KV cache) because both size the same share: it sits below them so neither imports the
other for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from exo.shared.types.models import ModelCard


@dataclass(frozen=True, slots=True)
class WeightShare:
    """The part of a model one node holds.

    Attributes:
        layers: decoder layers held.
        tensor_parallel_ranks: ranks each decoder-layer linear is split over (1: whole).
        holds_embedding: the input embedding is here (first pipeline rank, or every
            tensor-parallel rank).
        holds_output_layer: the final norm and LM head are here (last pipeline rank, or
            every tensor-parallel rank).
        first_layer: the index of the first layer held, where known: a MoE card's layers
            differ (sparse or dense), so a share of known layers is sized exactly; None
            sizes the share's layers as the card's sparse ones first (an upper bound).
        experts: the routed experts held per MoE layer (an expert-parallel rank's share;
            None: every one).
        holds_vision_tower: the vision tower and projector are here (a vision card's
            single node, or rank 0 of a split instance: `Parallelism.runs_vision_tower`);
            sized by `vision_tower_bytes`, 0 for a card without the "vision" capability.
        output_layer_rows: rows of the LM head (vocabulary ids) held, where a split keeps
            only its own (an expert-parallel rank: `memory.vocab_rows`); None: the whole
            head, or a tensor rank's `vocab_share` (the most any of them holds).
    """

    layers: int
    tensor_parallel_ranks: int = 1
    holds_embedding: bool = True
    holds_output_layer: bool = True
    first_layer: int | None = None
    experts: int | None = None
    holds_vision_tower: bool = True
    output_layer_rows: int | None = None

    def sparse_layers(self, card: ModelCard) -> int:
        """How many of the share's layers are MoE layers of `card` (0 for a dense card)."""
        if card.moe is None:
            return 0
        if self.first_layer is None:
            return min(self.layers, card.moe.sparse_layers(card.n_layers))
        dense = set(card.moe.dense_layers)
        held = range(self.first_layer, self.first_layer + self.layers)
        return sum(1 for layer in held if layer not in dense)

    def kv_heads(self, card: ModelCard) -> int:
        """KV heads per layer this share caches: tensor ranks hold their part of the
        card's KV heads (rounded up; placement only splits where they divide)."""
        return kv_heads_per_rank(card.num_key_value_heads, self.tensor_parallel_ranks)


def whole_model(card: ModelCard) -> WeightShare:
    """Every layer, the embedding and the LM head on one node."""
    return WeightShare(layers=card.n_layers)


def kv_heads_per_rank(kv_heads: int, tensor_parallel_ranks: int) -> int:
    """KV heads one tensor rank holds (rounded up; tensor placement checks divisibility)."""
    return -(-kv_heads // tensor_parallel_ranks)
