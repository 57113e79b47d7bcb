"""Shard metadata: which part of a model one runner holds."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from exo.shared.types.common import FrozenModel
from exo.shared.types.models import ModelCard


class _ShardBase(FrozenModel):
    model_card: ModelCard
    device_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)

    @model_validator(mode="after")
    def _rank_in_world(self) -> _ShardBase:
        if self.device_rank >= self.world_size:
            raise ValueError(f"device_rank {self.device_rank} >= world_size {self.world_size}")
        return self

    @property
    def is_first_rank(self) -> bool:
        return self.device_rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.device_rank == self.world_size - 1


class PipelineShardMetadata(_ShardBase):
    """Layers `[start_layer, end_layer)` of the model; the embedding lives on the first
    rank, the final norm and LM head on the last."""

    kind: Literal["PipelineShardMetadata"] = "PipelineShardMetadata"
    start_layer: int = Field(ge=0)
    end_layer: int = Field(ge=1)

    @model_validator(mode="after")
    def _layers_in_model(self) -> PipelineShardMetadata:
        if not self.start_layer < self.end_layer <= self.model_card.n_layers:
            raise ValueError(
                f"layer range [{self.start_layer}, {self.end_layer}) is not inside "
                f"the model's {self.model_card.n_layers} layers"
            )
        return self

    @property
    def n_shard_layers(self) -> int:
        return self.end_layer - self.start_layer


class TensorShardMetadata(_ShardBase):
    """Every layer, holding the `device_rank`-th of `world_size` slices of each weight."""

    kind: Literal["TensorShardMetadata"] = "TensorShardMetadata"


ShardMetadata = Annotated[PipelineShardMetadata | TensorShardMetadata, Field(discriminator="kind")]
