"""Expert parallelism's engine side: every rank keeps every layer whole except each MoE
block's routed experts, of which it keeps its own (`moe.experts_of_rank`); the checkpoint
tensors of the others are never planned, so never read. Every rank runs the whole batched
step in lockstep, as tensor ranks do (one broadcast of the step header per step): attention and
dense layers are computed alike on every rank, and each MoE block's partial sum (this rank's
experts' weighted outputs) is all-reduced once (`RoutedExperts.reduce`, `LeanMoe`).

The LM head is split by vocabulary as on tensor ranks (`split_head_by_vocab`, Megatron-LM's
vocabulary-parallel output layer): each rank reads only its rows of the head per token and
the logits are gathered, so every rank holds the same logits; ranks > 0 drop theirs. Kept
whole, every rank read the whole head: 311 MB of the 967 MB a token of 18 of
Qwen3-30B-A3B's layers reads in its int8 form, the same on each rank: one of the two costs
named for expert x2 on two 1-core nodes reaching only 1.11x one node; with the head split,
1.50x (docs/benchmarks/2026-12-06-moe-pairs-and-head-split.md).
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig, PreTrainedModel

from exo.shared.models.moe import experts_of_rank
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.worker.engines.torch.model.families import ModelFamily, UnsupportedArchitectureError
from exo.worker.engines.torch.model.moe import routed_experts_of
from exo.worker.engines.torch.model.sharding import (
    TensorReader,
    decoder_layers,
    read_whole,
    split_head_by_vocab,
)
from exo.worker.engines.torch.parallel.tensor import TensorTransform


class ExpertTransform(TensorTransform):
    """The step travels as on tensor ranks (`TensorTransform`'s lockstep broadcast); the
    skeleton is cut by experts instead of by rows and columns."""

    sharding: ClassVar[Sharding] = "expert"

    def cut(self, model: PreTrainedModel, family: ModelFamily, shard: ShardMetadata) -> None:
        layers = decoder_layers(model)
        if shard.world_size == 1:
            return
        architecture = type(model).__name__
        if family.moe is None:
            raise UnsupportedArchitectureError(
                f"{architecture}: no expert parallelism: the {family.name} family has no "
                "mixture-of-experts layers"
            )
        split = 0
        for layer in layers:
            experts = routed_experts_of(layer, family)
            if experts is not None:
                experts.keep(experts_of_rank(experts.total, shard.device_rank, shard.world_size))
                split += 1
        if split == 0:
            raise UnsupportedArchitectureError(f"{architecture}: no MoE layer to split by experts")

    def tensor_reader(
        self, family: ModelFamily, config: PretrainedConfig, model_name: str, shard: ShardMetadata
    ) -> TensorReader:
        return read_whole

    def split_output_layer(self, model: PreTrainedModel, shard: ShardMetadata) -> bool:
        return split_head_by_vocab(model, shard.device_rank, shard.world_size)
