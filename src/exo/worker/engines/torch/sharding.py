"""Shard-only loading for multi-rank shards: a meta-device skeleton of the whole model is cut
down to this rank's part (pipeline: a range of decoder layers; tensor: a slice of every
attention and MLP projection), then only the tensors that part needs are read from
safetensors, so a rank's peak memory is its share of the weights.

Parallelism is a transform on the unchanged transformers modules (the approach of gpt-fast's
`tp.py`): layers are dropped or their linears swapped for smaller ones; the model code is
never forked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata
from exo.worker.engines.torch.loading import (
    _LAYER_INDEX,
    LayerProgressCallback,
    _assign_tensor,
    _empty_model,
    _group_tensor_names_by_layer,
    _tie_output_embeddings,
)

COLUMN_PARALLEL = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
)
ROW_PARALLEL = (("self_attn", "o_proj"), ("mlp", "down_proj"))

# How a tensor is read: whole, or the rank's slice of a safetensors slice object.
TensorReader = Callable[[Any], torch.Tensor]


class UnsupportedArchitectureError(ValueError):
    """The model's module structure is not one the sharding transform recognises."""


class AbsentModule(nn.Module):
    """Stands in for a module another pipeline rank holds (embedding, LM head)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"the {self.what} is not on this pipeline rank")


class RowParallelLinear(nn.Linear):
    """A linear holding columns `[rank * in/world, (rank+1) * in/world)` of the full weight:
    the local matmul gives a partial sum, all-reduced over the group; the bias is added once,
    after the reduce."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output = torch.nn.functional.linear(input, self.weight)  # [batch, seq, out] partial
        dist.all_reduce(output, op=dist.ReduceOp.SUM)
        if self.bias is not None:
            output = output + self.bias
        return output


class AllReducedLinear(nn.Module):
    """A row-parallel linear whose local matmul is some other module (a quantized linear):
    partial sum, all-reduce over the group, then the bias once."""

    def __init__(self, local: nn.Module, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.local = local
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.local(input)  # [batch, seq, out] partial sum
        dist.all_reduce(output, op=dist.ReduceOp.SUM)
        if self.bias is not None:
            output = output + self.bias
        return output


def _architecture(config: PretrainedConfig) -> str:
    names = getattr(config, "architectures", None) or [type(config).__name__]
    return str(names[0])


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.model.layers`).

    Raises:
        UnsupportedArchitectureError: the model has no such list, or no embedding / final
            norm / LM head under the usual names.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    architecture = _architecture(model.config)
    if not isinstance(layers, nn.ModuleList):
        raise UnsupportedArchitectureError(
            f"{architecture}: no decoder layers at model.model.layers; cannot shard it"
        )
    for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head")):
        if not isinstance(getattr(owner, name, None), nn.Module):
            raise UnsupportedArchitectureError(
                f"{architecture}: no {name} module where decoder models keep it; cannot shard it"
            )
    return layers


def _cut_to_pipeline_stage(model: PreTrainedModel, shard: PipelineShardMetadata) -> None:
    """Keep decoder layers [start_layer, end_layer) (renumbered from 0 for the KV cache), the
    embedding on the first rank only, the final norm and LM head on the last rank only."""
    layers = decoder_layers(model)
    inner: Any = model.model
    if len(layers) != shard.model_card.n_layers:
        raise ValueError(
            f"the model has {len(layers)} decoder layers, its card says {shard.model_card.n_layers}"
        )
    kept = list(layers)[shard.start_layer : shard.end_layer]
    inner.layers = nn.ModuleList(kept)
    for layer in kept:
        for module in layer.modules():
            layer_index = getattr(module, "layer_idx", None)
            if isinstance(layer_index, int):
                setattr(module, "layer_idx", layer_index - shard.start_layer)  # noqa: B010
    # Attention modules read their layer type at construction (done above with the global
    # index); the model's forward and the cache read the per-layer lists by local index.
    text_config = model.config.get_text_config()
    text_config.num_hidden_layers = len(kept)
    layer_types = getattr(text_config, "layer_types", None)
    if isinstance(layer_types, list | tuple):
        text_config.layer_types = list(layer_types)[shard.start_layer : shard.end_layer]
    if not shard.is_first_rank:
        inner.embed_tokens = AbsentModule("token embedding")
    if not shard.is_last_rank:
        inner.norm = nn.Identity()
        model.lm_head = AbsentModule("LM head")


def check_tensor_parallel(config: PretrainedConfig, world_size: int) -> None:
    """Raises ValueError naming the architecture and field when attention heads, KV heads or
    the MLP width do not divide by `world_size`."""
    text_config = config.get_text_config()
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text_config, field, None)
        if not isinstance(value, int):
            raise UnsupportedArchitectureError(
                f"{_architecture(config)}: config has no integer {field}; cannot shard it "
                "tensor-parallel"
            )
        if value % world_size:
            raise ValueError(
                f"{_architecture(config)}: {field}={value} is not divisible by the tensor "
                f"parallel world size {world_size}"
            )


def _split_linears(model: PreTrainedModel, world_size: int) -> None:
    """Swap every layer's attention/MLP projections (on meta) for their per-rank shapes."""
    architecture = _architecture(model.config)
    for index, layer in enumerate(decoder_layers(model)):
        for block_name, linear_name in (*COLUMN_PARALLEL, *ROW_PARALLEL):
            block = getattr(layer, block_name, None)
            linear = getattr(block, linear_name, None)
            if type(linear) is not nn.Linear:
                raise UnsupportedArchitectureError(
                    f"{architecture}: layer {index} has no plain linear {block_name}."
                    f"{linear_name}; cannot shard it tensor-parallel"
                )
            has_bias = linear.bias is not None
            replacement: nn.Linear
            if (block_name, linear_name) in ROW_PARALLEL:
                replacement = RowParallelLinear(
                    linear.in_features // world_size, linear.out_features, has_bias, "meta"
                )
            else:
                replacement = nn.Linear(
                    linear.in_features, linear.out_features // world_size, has_bias, "meta"
                )
            setattr(block, linear_name, replacement)


def _tensor_reader(name: str, rank: int, world_size: int) -> TensorReader:
    """How to read tensor `name` for tensor-parallel rank `rank`: rows of column-parallel
    weights and biases, columns of row-parallel weights, everything else whole."""
    parts = name.split(".")
    if len(parts) >= 3 and (parts[-3], parts[-2]) in COLUMN_PARALLEL:

        def rows(tensor_slice: Any) -> torch.Tensor:
            size = tensor_slice.get_shape()[0] // world_size
            tensor: torch.Tensor = tensor_slice[rank * size : (rank + 1) * size]
            return tensor

        return rows
    if len(parts) >= 3 and (parts[-3], parts[-2]) in ROW_PARALLEL and parts[-1] == "weight":

        def columns(tensor_slice: Any) -> torch.Tensor:
            size = tensor_slice.get_shape()[1] // world_size
            tensor: torch.Tensor = tensor_slice[:, rank * size : (rank + 1) * size]
            return tensor

        return columns
    return lambda tensor_slice: tensor_slice[:]


def _target_name(name: str, shard: ShardMetadata) -> str | None:
    """The model's name for checkpoint tensor `name` on this rank (None: not on it)."""
    if not isinstance(shard, PipelineShardMetadata):
        return name
    match = _LAYER_INDEX.search(name)
    if match is None:
        return name
    index = int(match.group(1))
    if not shard.start_layer <= index < shard.end_layer:
        return None
    start, end = match.span(1)
    return f"{name[:start]}{index - shard.start_layer}{name[end:]}"


def _model_entries(model: nn.Module) -> set[str]:
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name in module._buffers:
            if buffer_name not in module._non_persistent_buffers_set:
                names.add(f"{module_name}.{buffer_name}" if module_name else buffer_name)
    return names


def load_sharded_model(
    model_dir: Path,
    shard: ShardMetadata,
    device: torch.device,
    on_layer_loaded: LayerProgressCallback | None = None,
) -> PreTrainedModel:
    """Load this rank's part of the model in `model_dir`, fp32 on `device`.

    Args:
        model_dir: HF-format directory (config.json + *.safetensors).
        shard: a pipeline shard (any layer range) or a tensor shard (any world size).
        device: target device.
        on_layer_loaded: called as (decoder layers loaded, decoder layers on this rank).

    Returns:
        The cut-down model in eval mode: for a pipeline rank that is not the last,
        `model.model(...)` returns the hidden states to send on (its final norm is an
        identity); a tensor rank's forward all-reduces and needs the process group.

    Raises:
        UnsupportedArchitectureError / ValueError: unrecognised structure, indivisible
            heads for tensor parallelism, missing or mis-shaped tensors.
    """
    config = AutoConfig.from_pretrained(model_dir)
    model = _empty_model(config)
    match shard:
        case PipelineShardMetadata():
            _cut_to_pipeline_stage(model, shard)
        case TensorShardMetadata():
            check_tensor_parallel(config, shard.world_size)
            decoder_layers(model)
            _split_linears(model, shard.world_size)
    wanted = _model_entries(model)
    groups = _group_tensor_names_by_layer(model_dir)
    layer_indices = sorted(
        index
        for index in groups
        if index is not None and _target_name(f"model.layers.{index}.x", shard) is not None
    )
    if on_layer_loaded is not None:
        on_layer_loaded(0, len(layer_indices))
    handles: dict[Path, Any] = {}

    def read(path: Path, name: str, target: str) -> None:
        handle = handles.get(path)
        if handle is None:
            handle = handles[path] = safe_open(str(path), framework="pt")
        reader = (
            _tensor_reader(name, shard.device_rank, shard.world_size)
            if isinstance(shard, TensorShardMetadata)
            else (lambda tensor_slice: tensor_slice[:])
        )
        tensor = reader(handle.get_slice(name)).to(device=device, dtype=torch.float32)
        if not _assign_tensor(model, target, tensor):
            logger.warning("tensor {} has no place in the model", name)

    try:
        for done, index in enumerate([None, *layer_indices]):
            for path, name in groups.get(index, []):
                target = _target_name(name, shard)
                if target is not None and target in wanted:
                    read(path, name, target)
            if index is not None and on_layer_loaded is not None:
                on_layer_loaded(done, len(layer_indices))
        _fill_tied_lm_head(model, groups.get(None, []), read)
    finally:
        handles.clear()
    missing = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if missing:
        raise ValueError(
            f"{model_dir} lacks {len(missing)} tensors rank {shard.device_rank} needs, "
            f"e.g. {missing[:5]}"
        )
    torch.nn.Module.to(model, device)  # non-persistent buffers (rotary frequencies)
    model.eval()
    model.requires_grad_(False)
    return model


def _fill_tied_lm_head(
    model: PreTrainedModel,
    unlayered: list[tuple[Path, str]],
    read: Callable[[Path, str, str], None],
) -> None:
    """With tied embeddings the checkpoint stores the embedding only: share it with the LM
    head where both are here, or read it into the LM head (last pipeline rank)."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return
    lm_head = getattr(model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_meta:
        return
    embedding = getattr(model.model, "embed_tokens", None)
    if isinstance(embedding, nn.Embedding) and not embedding.weight.is_meta:
        _tie_output_embeddings(model)
        return
    for path, name in unlayered:
        if name.endswith("embed_tokens.weight"):
            read(path, name, "lm_head.weight")
            return


def loaded_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's (distinct, non-meta) parameters: what this rank holds."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if parameter.is_meta or id(parameter) in seen:
            continue
        seen.add(id(parameter))
        total += parameter.numel() * parameter.element_size()
    return total
