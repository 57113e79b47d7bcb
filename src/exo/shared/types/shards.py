"""Shard metadata: which part of a model one runner holds.

One type for every parallelism: `sharding` names the kind (`exo.shared.parallelism`
describes each); a world of one rank is a single node holding the whole model. Every shard
carries its layer range so kinds can compose later (pipeline stages split by tensor or
expert): a tensor rank holds every layer, `[0, n_layers)`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exo.shared.parallelism import parallelism
from exo.shared.types.common import FrozenModel
from exo.shared.types.models import ModelCard

Sharding = Literal["pipeline", "tensor", "expert"]
"""How a model is split across ranks: pipeline (layer ranges, hidden states pass rank to
rank), tensor (a slice of every layer's linears, an all-reduce per block) or expert (a
mixture-of-experts model's routed experts divided, the rest whole on every rank, an
all-reduce per MoE block)."""


class ShardMetadata(FrozenModel):
    """Rank `device_rank` of `world_size`, holding decoder layers `[start_layer, end_layer)`
    cut by `sharding`.

    Pipeline: the embedding lives on the first rank, the final norm and LM head on the
    last. Tensor: every layer, the `device_rank`-th of `world_size` slices of each weight."""

    model_card: ModelCard
    sharding: Sharding
    device_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)

    @model_validator(mode="after")
    def _valid_for_its_kind(self) -> ShardMetadata:
        if self.device_rank >= self.world_size:
            raise ValueError(f"device_rank {self.device_rank} >= world_size {self.world_size}")
        if not self.start_layer < self.end_layer <= self.model_card.n_layers:
            raise ValueError(
                f"layer range [{self.start_layer}, {self.end_layer}) is not inside "
                f"the model's {self.model_card.n_layers} layers"
            )
        error = parallelism(self.sharding).shard_error(self)
        if error is not None:
            raise ValueError(error)
        return self

    @property
    def is_first_rank(self) -> bool:
        return self.device_rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.device_rank == self.world_size - 1

    @property
    def n_shard_layers(self) -> int:
        return self.end_layer - self.start_layer
