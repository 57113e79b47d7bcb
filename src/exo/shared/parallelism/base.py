"""What every parallelism describes (torch-free): the rules placement, recovery, downloads,
memory accounting and speed prediction need, answered per kind instead of by testing it.

A kind says which layers and whole-model parts (embedding, LM head) a rank holds, how many
ranks split each layer's linears (its memory share and KV geometry, `WeightShare`), whether
a model can be split that way, and how the ranks' stage times and transfers add up to one
step. The engine's side (how the skeleton is cut, how a step travels) is
`exo.worker.engines.torch.parallel`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Literal, Protocol

from exo.shared.models.weight_share import WeightShare, kv_heads_per_rank
from exo.shared.types.models import ModelCard

# `...model.layers.<n>.` (also under `language_model.` / `model.language_model.`).
_LAYER = re.compile(r"(?:^|\.)(?:model\.)?layers\.(\d+)\.")
_EMBEDDING = re.compile(r"(?:^|\.)embed_tokens\.")
_FINAL = re.compile(r"(?:^|\.)(?:lm_head|norm)\.[a-z_]+$")

LayerRange = tuple[int, int]

Sharding = Literal["pipeline", "tensor", "expert"]
"""How a model is split across ranks: pipeline (layer ranges, hidden states pass rank to
rank), tensor (a slice of every layer's linears, an all-reduce per block) or expert (a
mixture-of-experts model's routed experts divided, the rest whole on every rank, an
all-reduce per MoE block)."""


class ShardMetadata(Protocol):
    """What a description reads of a shard (`exo.shared.types.shards.ShardMetadata` has
    it): the descriptions sit below the wire type that validates itself with them, so they
    name its fields instead of importing it."""

    @property
    def model_card(self) -> ModelCard: ...
    @property
    def sharding(self) -> Sharding: ...
    @property
    def device_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def start_layer(self) -> int: ...
    @property
    def end_layer(self) -> int: ...


class StepNetwork(Protocol):
    """The measured links of a group of ranks, as speed prediction models them."""

    def hop_seconds(self, rank: int, payload_bytes: float) -> float:
        """Seconds to send `payload_bytes` from `rank` to the next rank (the last to 0)."""
        ...

    def all_reduce_seconds(self, payload_bytes: float) -> float:
        """Seconds of one all-reduce of `payload_bytes` over every rank."""
        ...

    def all_gather_seconds(self, bytes_per_rank: float) -> float:
        """Seconds for every rank to send its `bytes_per_rank` to every other."""
        ...

    def latency_seconds(self) -> float:
        """The slowest link's one-way latency (a small message to every rank)."""
        ...


class Parallelism(ABC):
    """One way of splitting a model across `world_size` ranks."""

    sharding: ClassVar[Sharding]

    @abstractmethod
    def tensor_parallel_ranks(self, world_size: int) -> int:
        """Ranks each decoder-layer linear (and the KV heads) is split over."""

    @abstractmethod
    def holds_embedding(self, rank: int, world_size: int) -> bool:
        """Whether rank `rank` holds the input embedding."""

    @abstractmethod
    def holds_output_layer(self, rank: int, world_size: int) -> bool:
        """Whether rank `rank` holds the final norm and the LM head."""

    def runs_vision_tower(self, rank: int, world_size: int) -> bool:
        """Whether rank `rank` of a model with the "vision" capability loads and runs its
        vision tower and projector (float32, `WeightShare.holds_vision_tower`): one rank
        per instance, rank 0 (a single node's, or the split instance's rank that receives
        the requests and sends the images' rows on with its steps; the engine's side is
        `EngineTransform.runs_vision_tower`)."""
        return rank == 0

    def drafts_in_rank_zero(self, world_size: int) -> bool:
        """Whether an instance of this kind over `world_size` nodes speculates with drafts
        made in its rank 0's runner (a draft model there, `exo.shared.models.drafts`, or
        n-gram prompt lookup), its ranks verifying a draft's k + 1 positions in one step.
        Every kind does: tensor and expert ranks run each step in lockstep; a pipeline
        keeps one step in flight per request (the draft's, its rows returned whole by the
        last rank) while other requests' steps fill the ranks. A kind whose ranks could not
        verify a draft in one step would answer False (placement then leaves the draft
        model out, saying why)."""
        return True

    @abstractmethod
    def split_error(self, card: ModelCard, world_size: int) -> str | None:
        """Why `card` cannot be split this way over `world_size` nodes, or None."""

    @abstractmethod
    def layer_ranges(
        self, n_layers: int, world_size: int, layer_counts: Callable[[], Sequence[int]]
    ) -> tuple[LayerRange, ...]:
        """Each rank's decoder layers `[start, end)`. `layer_counts` gives the layers per
        rank when this kind splits layers (placement's speed- or memory-balanced split)."""

    @abstractmethod
    def shard_error(self, shard: ShardMetadata) -> str | None:
        """Why `shard` is not a valid shard of this kind, or None."""

    @abstractmethod
    def step_seconds(
        self,
        card: ModelCard,
        stage_seconds: Sequence[float],
        network: StepNetwork,
        activation_bytes: float,
    ) -> float:
        """One step over every rank (more than one): the ranks' own compute
        (`stage_seconds`, rank order) and the transfers between them, `activation_bytes`
        per hidden state sent."""

    def weight_share(
        self, card: ModelCard, rank: int, world_size: int, layer_range: LayerRange
    ) -> WeightShare:
        """The part of `card` rank `rank` holds: its layers, split over this kind's
        tensor-parallel ranks, with the embedding / LM head where this kind keeps them and
        the vision tower where it runs (`runs_vision_tower`; sized only for a card with
        the "vision" capability)."""
        start, end = layer_range
        return WeightShare(
            layers=end - start,
            tensor_parallel_ranks=self.tensor_parallel_ranks(world_size),
            holds_embedding=self.holds_embedding(rank, world_size),
            holds_output_layer=self.holds_output_layer(rank, world_size),
            holds_vision_tower=self.runs_vision_tower(rank, world_size),
        )

    def shard_weight_share(self, shard: ShardMetadata) -> WeightShare:
        """`weight_share` of `shard`."""
        return self.weight_share(
            shard.model_card,
            shard.device_rank,
            shard.world_size,
            (shard.start_layer, shard.end_layer),
        )

    def kv_heads_per_rank(self, kv_heads: int, world_size: int) -> int:
        """KV heads per layer one rank caches, of a model with `kv_heads`."""
        return kv_heads_per_rank(kv_heads, self.tensor_parallel_ranks(world_size))

    def reads_tensor(self, name: str, shard: ShardMetadata) -> bool:
        """Whether `shard` reads (a slice of) text-model checkpoint tensor `name`: a layer
        of its range, the embedding (also where the LM head is, which may be tied to it),
        the final norm and LM head where this kind keeps them, anything else always."""
        rank, world_size = shard.device_rank, shard.world_size
        match = _LAYER.search(name)
        if match is not None:
            return shard.start_layer <= int(match.group(1)) < shard.end_layer
        if _EMBEDDING.search(name):
            return self.holds_embedding(rank, world_size) or self.holds_output_layer(
                rank, world_size
            )
        if _FINAL.search(name):
            return self.holds_output_layer(rank, world_size)
        return True


class EveryLayerParallelism(Parallelism):
    """A kind whose every rank holds every decoder layer (tensor, expert): each splits the
    layers' weights, not the layer range."""

    def layer_ranges(
        self, n_layers: int, world_size: int, layer_counts: Callable[[], Sequence[int]]
    ) -> tuple[LayerRange, ...]:
        return tuple((0, n_layers) for _ in range(world_size))

    def every_layer_error(self, shard: ShardMetadata) -> str | None:
        """Why `shard` is not a shard of this kind's layout: its range is not every layer."""
        layers = shard.model_card.n_layers
        if (shard.start_layer, shard.end_layer) == (0, layers):
            return None
        article = "an" if self.sharding[0] in "aeiou" else "a"
        return (
            f"{article} {self.sharding} shard holds every layer [0, {layers}), not "
            f"[{shard.start_layer}, {shard.end_layer})"
        )
