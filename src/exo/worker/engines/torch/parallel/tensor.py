"""Tensor parallelism's engine side: every rank keeps every layer with its slice of each
column- and row-parallel linear (the family file says which), its KV heads and its rows of
the LM head; every rank runs the whole batched step in lockstep (the row-parallel linears
all-reduce, so every rank computes the same logits; ranks > 0 drop theirs). One broadcast
of the step header per step (one message per rank).

A vision model's images: rank 0 alone runs the tower; every rank embeds the tokens, so a
step with image rows (`StepHeader.image_rows`) is followed by their features, `[rows,
image_width]` float32 (the hidden size, or a multiple of it with Qwen3-VL's deepstack
features), sent from rank 0 to each other rank (`send_image_rows`); the header carries
Qwen-VL's multimodal rotary positions.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from exo.shared.models.tensor_names import LAYER_TENSOR
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.worker.engines.torch.batching.batch_attention import BatchPlan, forward_batch
from exo.worker.engines.torch.comm.parallel_linears import RowParallelLinear, SplitWidthRMSNorm
from exo.worker.engines.torch.comm.process_group import IDLE_WAIT, broadcast_tensor
from exo.worker.engines.torch.model.families import ModelFamily, UnsupportedArchitectureError
from exo.worker.engines.torch.model.moe import routed_experts_of
from exo.worker.engines.torch.model.sharding import (
    TensorReader,
    decoder_layers,
    read_whole,
    split_head_by_vocab,
)
from exo.worker.engines.torch.parallel.base import EngineTransform, RankEngine, SchedulerHooks
from exo.worker.engines.torch.parallel.rank_steps import (
    StepHeader,
    broadcast_step,
    receive_image_rows,
    send_image_rows,
)


def check_tensor_parallel(
    family: ModelFamily, architecture: str, config: PretrainedConfig, world_size: int
) -> None:
    """Raises UnsupportedArchitectureError / ValueError naming the architecture and field
    when the family refuses tensor parallelism, or attention heads, KV heads, the MLP width
    (and an expert's, for a MoE family) or a fused linear's parts do not divide by
    `world_size`."""
    if family.tensor_parallel_note is not None:
        raise UnsupportedArchitectureError(
            f"{architecture}: no tensor parallelism: {family.tensor_parallel_note}"
        )
    fields = ["num_attention_heads", "num_key_value_heads", "intermediate_size"]
    if family.moe is not None:
        fields.append(family.moe.expert_width)
    for field in fields:
        value = getattr(config, field, None)
        if not isinstance(value, int):
            raise UnsupportedArchitectureError(
                f"{architecture}: config has no integer {field}; cannot shard it tensor-parallel"
            )
        if value % world_size:
            raise ValueError(
                f"{architecture}: {field}={value} is not divisible by the tensor "
                f"parallel world size {world_size}"
            )
    for path, parts in family.fused_parts.items():
        sizes = parts(config)
        if any(size % world_size for size in sizes):
            raise ValueError(
                f"{architecture}: the parts {sizes} of the fused {path} are not divisible by "
                f"the tensor parallel world size {world_size}"
            )


def split_linears(model: PreTrainedModel, family: ModelFamily, world_size: int) -> None:
    """Swap every layer's column- and row-parallel linears (on meta) for their per-rank
    shapes, then let the family adjust what reads head counts from its config.

    Raises:
        UnsupportedArchitectureError: a layer lacks a linear the family file names.
    """
    architecture = type(model).__name__
    text_config = model.config.get_text_config()
    for index, layer in enumerate(decoder_layers(model)):
        # A MoE layer: every expert split as a dense MLP, one all-reduce for the block.
        experts = routed_experts_of(layer, family)
        if experts is not None:
            experts.split_for_tensor(world_size)
        for path in (*family.column_parallel, *family.row_parallel):
            if experts is None and _in_shared_expert(family, path):
                continue  # a dense layer has no shared expert
            block_name, _, linear_name = path.rpartition(".")
            block = layer.get_submodule(block_name) if block_name else layer
            linear = getattr(block, linear_name, None)
            if linear is None and experts is not None:
                continue  # the dense MLP's linears: a MoE layer has experts instead
            if linear is None and hasattr(block, linear_name):
                continue  # an alternative the config does not build (DeepSeek-V3's q_proj)
            if type(linear) is not nn.Linear:
                raise UnsupportedArchitectureError(
                    f"{architecture}: layer {index} has no plain linear {path}; cannot shard "
                    "it tensor-parallel"
                )
            has_bias = linear.bias is not None
            replacement: nn.Linear
            if family.split_direction(path) == "row":
                replacement = RowParallelLinear(
                    linear.in_features // world_size, linear.out_features, has_bias, "meta"
                )
            else:
                replacement = nn.Linear(
                    linear.in_features, linear.out_features // world_size, has_bias, "meta"
                )
            setattr(block, linear_name, replacement)
        for path in family.projection_norms:
            _split_projection_norm(layer, path, world_size, architecture, index)
        for name in family.per_head_parameters:  # a [heads] vector: this rank's heads
            owner_path, _, attribute = name.rpartition(".")
            owner = layer.get_submodule(owner_path) if owner_path else layer
            whole = getattr(owner, attribute)
            share = torch.empty(whole.shape[0] // world_size, device="meta")
            setattr(owner, attribute, nn.Parameter(share, requires_grad=False))
        if family.after_tensor_split is not None:
            family.after_tensor_split(layer, text_config, world_size)


def _in_shared_expert(family: ModelFamily, path: str) -> bool:
    shared = None if family.moe is None else family.moe.shared_expert
    return shared is not None and path.startswith(shared + ".")


def _split_projection_norm(
    layer: nn.Module, path: str, world_size: int, architecture: str, index: int
) -> None:
    """Swap an RMSNorm over a whole column-parallel projection for this rank's
    `SplitWidthRMSNorm` (its columns of the weight; the sum of squares all-reduced)."""
    owner_name, _, name = path.rpartition(".")
    owner = layer.get_submodule(owner_name) if owner_name else layer
    norm = getattr(owner, name, None)
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        raise UnsupportedArchitectureError(
            f"{architecture}: layer {index}'s {path} is not an RMSNorm over a projection"
        )
    width = int(weight.shape[0])
    if width % world_size:
        raise ValueError(
            f"{architecture}: {path} over {width} values is not divisible by the tensor "
            f"parallel world size {world_size}"
        )
    setattr(owner, name, SplitWidthRMSNorm(width // world_size, width, eps))


def tensor_reader(
    family: ModelFamily, config: PretrainedConfig, model_name: str, shard: ShardMetadata
) -> TensorReader:
    """How rank `shard.device_rank` reads model tensor `model_name`: the rank's rows of
    column-parallel weights and biases (part by part for fused linears) and of per-head
    vectors (`ModelFamily.per_head_parameters`), its columns of row-parallel weights,
    everything else whole. An expert's down-projection bias is read by rank 0 only (zeros
    elsewhere): the experts' partial sums are all-reduced once per block, bias included."""
    if shard.world_size == 1:
        return read_whole
    match = LAYER_TENSOR.match(model_name)
    if match is None:
        return read_whole
    path, _, kind = match.group(2).rpartition(".")
    direction = family.split_direction(path)
    rank, world_size = shard.device_rank, shard.world_size
    if match.group(2) in family.per_head_parameters:
        direction = "column"
    moe = family.moe
    if moe is not None and moe.expert_linear(path) == moe.expert_down and kind == "bias":

        def rank_zero_only(tensor_slice: Any) -> torch.Tensor:
            whole: torch.Tensor = tensor_slice[:]
            return whole if rank == 0 else torch.zeros_like(whole)

        return rank_zero_only
    if direction == "column":
        parts_of = family.fused_parts.get(path)
        parts = parts_of(config) if parts_of is not None else None

        def rows(tensor_slice: Any) -> torch.Tensor:
            sizes = parts or (tensor_slice.get_shape()[0],)
            pieces: list[torch.Tensor] = []
            offset = 0
            for size in sizes:
                share = size // world_size
                start = offset + rank * share
                pieces.append(tensor_slice[start : start + share])
                offset += size
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

        return rows
    if direction == "row" and kind in ("weight", "blocks", "scales"):  # MXFP4: block columns

        def columns(tensor_slice: Any) -> torch.Tensor:
            share = tensor_slice.get_shape()[1] // world_size
            tensor: torch.Tensor = tensor_slice[:, rank * share : (rank + 1) * share]
            return tensor

        return columns
    return read_whole


class TensorTransform(EngineTransform):
    sharding: ClassVar[Sharding] = "tensor"

    def cut(self, model: PreTrainedModel, family: ModelFamily, shard: ShardMetadata) -> None:
        decoder_layers(model)
        if shard.world_size > 1:
            config = model.config.get_text_config()
            check_tensor_parallel(family, type(model).__name__, config, shard.world_size)
            split_linears(model, family, shard.world_size)

    def tensor_reader(
        self, family: ModelFamily, config: PretrainedConfig, model_name: str, shard: ShardMetadata
    ) -> TensorReader:
        return tensor_reader(family, config, model_name, shard)

    def split_output_layer(self, model: PreTrainedModel, shard: ShardMetadata) -> bool:
        return split_head_by_vocab(model, shard.device_rank, shard.world_size)

    def runs_vision_tower(self, shard: ShardMetadata) -> bool:
        return shard.is_first_rank  # the image rows follow the header (`send_image_rows`)

    def scheduler_hooks(self, engine: RankEngine) -> SchedulerHooks:
        def forward(
            model: PreTrainedModel,
            plan: BatchPlan,
            input_ids: torch.Tensor,
            position_ids: torch.Tensor,
            logit_rows: torch.Tensor,
        ) -> torch.Tensor:
            """Rank 0's step: broadcast the header, run the collective forward."""
            header = StepHeader.from_plan(
                plan, input_ids, position_ids, logit_rows, engine.take_cache_ops()
            )
            broadcast_step(header, IDLE_WAIT)
            if plan.row_embeddings:
                send_image_rows(plan.row_embeddings, range(1, engine.world_size))
            return forward_batch(model, plan, input_ids, position_ids, logit_rows)

        return SchedulerHooks(forward=forward)

    def agree(self, engine: RankEngine, value: torch.Tensor) -> None:
        broadcast_tensor(value, src=0)

    def send_control(self, engine: RankEngine, header: StepHeader) -> None:
        broadcast_step(header, IDLE_WAIT)

    def receive_header(self, engine: RankEngine, idle_wait: timedelta) -> StepHeader:
        return broadcast_step(None, idle_wait)

    def pass_on_control(self, engine: RankEngine, header: StepHeader) -> None:
        pass  # the broadcast reached every rank

    def serve_step(self, engine: RankEngine, header: StepHeader, plan: BatchPlan) -> None:
        input_ids, position_ids, logit_rows = (
            tensor.to(engine.device) for tensor in header.tensors()
        )
        if header.image_rows:
            plan.row_embeddings = receive_image_rows(
                header.image_rows, header.image_width, engine.device, source=0
            )
        forward_batch(engine.model, plan, input_ids, position_ids, logit_rows)
