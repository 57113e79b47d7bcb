"""Expert parallelism's engine side: every rank keeps every layer whole except each MoE
block's routed experts, of which it keeps its own (`moe.experts_of_rank`); the checkpoint
tensors of the others are never planned, so never read. Every rank runs the whole batched
step in lockstep, as tensor ranks do (one broadcast of the step header per step): attention,
dense layers and the LM head are computed alike on every rank, and each MoE block's partial
sum (this rank's experts' weighted outputs) is all-reduced once (`RoutedExperts.reduce`,
`LeanMoe`), so every rank computes the same logits; ranks > 0 drop theirs.
"""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig, PreTrainedModel

from exo.shared.models.moe import experts_of_rank
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.worker.engines.torch.model.families import ModelFamily, UnsupportedArchitectureError
from exo.worker.engines.torch.model.moe import routed_experts_of
from exo.worker.engines.torch.model.sharding import TensorReader, decoder_layers, read_whole
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
        return False  # every rank computes the whole logits
