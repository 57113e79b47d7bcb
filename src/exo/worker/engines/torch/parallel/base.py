"""What every parallelism does to the engine: how the meta skeleton is cut to one rank's
part, how the rank reads its tensors, and how a step travels between the ranks.

A split instance's `RankGroup` (`rank_group.py`) and the loader look the transform up by
the shard's `sharding` (`engine_transform`) and call it instead of testing the kind; the
torch-free rules of the same kind (which layers, memory share, KV heads) are
`exo.shared.parallelism`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar, Protocol

import torch
from transformers import PretrainedConfig, PreTrainedModel

from exo.shared.parallelism import Parallelism, parallelism
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.worker.engines.torch.batching.batch_attention import BatchPlan
from exo.worker.engines.torch.batching.scheduler import BatchForward, BatchLaunch
from exo.worker.engines.torch.model.families import ModelFamily
from exo.worker.engines.torch.model.sharding import TensorReader
from exo.worker.engines.torch.parallel.cache_ops import CacheOp
from exo.worker.engines.torch.parallel.last_rank_sampling import PipelineTraffic
from exo.worker.engines.torch.parallel.rank_steps import StepHeader


class RankEngine(Protocol):
    """What a transform needs of the rank (its `RankGroup`) to move a step."""

    model: PreTrainedModel
    device: torch.device
    rank: int
    world_size: int
    # Rank 0 of a pipeline: what came back from the last rank (`last_rank_sampling`).
    traffic: PipelineTraffic

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def is_last_rank(self) -> bool: ...

    @property
    def layer_range(self) -> tuple[int, int]:
        """The model's decoder layers `[start, end)` this rank holds (global indices)."""
        ...

    def take_cache_ops(self) -> tuple[CacheOp, ...]:
        """Rank 0's KV operations since the last step (for the next header)."""
        ...


@dataclass(frozen=True, slots=True)
class SchedulerHooks:
    """How rank 0's `BatchScheduler` runs a step over the group: a collective `forward`,
    or a `launch` with up to `max_in_flight` steps in flight."""

    forward: BatchForward | None = None
    launch: BatchLaunch | None = None
    max_in_flight: int = 1


class EngineTransform(ABC):
    """One parallelism's engine side."""

    sharding: ClassVar[Sharding]

    @property
    def description(self) -> Parallelism:
        """The torch-free rules of the same kind."""
        return parallelism(self.sharding)

    # -- the skeleton and its tensors ---------------------------------------------------

    @abstractmethod
    def cut(self, model: PreTrainedModel, family: ModelFamily, shard: ShardMetadata) -> None:
        """Cut the meta skeleton down to `shard` in place (world size 1: the whole model).

        Raises:
            UnsupportedArchitectureError / ValueError: the model cannot be cut this way.
        """

    @abstractmethod
    def tensor_reader(
        self, family: ModelFamily, config: PretrainedConfig, model_name: str, shard: ShardMetadata
    ) -> TensorReader:
        """How rank `shard.device_rank` reads model tensor `model_name` (its slice)."""

    @abstractmethod
    def split_output_layer(self, model: PreTrainedModel, shard: ShardMetadata) -> bool:
        """After loading: keep only this rank's part of the LM head; whether it did."""

    def kv_heads(self, kv_heads: int, shard: ShardMetadata) -> int:
        """KV heads per layer this rank caches, of a model with `kv_heads`."""
        return self.description.kv_heads_per_rank(kv_heads, shard.world_size)

    def runs_vision_tower(self, shard: ShardMetadata) -> bool:
        """Whether rank `shard.device_rank` of a vision model loads and runs its image
        tower: a whole model's rank; of a split one, rank 0 only where its steps carry the
        images' blocks and rows to the other ranks (`rank_steps.py`), else none (the
        instance then refuses images)."""
        return shard.world_size == 1

    # -- how a step travels -------------------------------------------------------------

    @abstractmethod
    def scheduler_hooks(self, engine: RankEngine) -> SchedulerHooks:
        """Rank 0: how its scheduler's steps reach the other ranks."""

    @abstractmethod
    def agree(self, engine: RankEngine, value: torch.Tensor) -> None:
        """Collective: every rank's `value` becomes rank 0's (in place)."""

    @abstractmethod
    def send_control(self, engine: RankEngine, header: StepHeader) -> None:
        """Rank 0: send a control header (warm-up done, shutdown) to the other ranks."""

    @abstractmethod
    def receive_header(self, engine: RankEngine, idle_wait: timedelta) -> StepHeader:
        """Ranks > 0: the next header from rank 0 (waiting up to `idle_wait`)."""

    @abstractmethod
    def pass_on_control(self, engine: RankEngine, header: StepHeader) -> None:
        """Ranks > 0: hand a control header on to the ranks that still need it."""

    @abstractmethod
    def serve_step(self, engine: RankEngine, header: StepHeader, plan: BatchPlan) -> None:
        """Ranks > 0: run this rank's part of rank 0's step."""
