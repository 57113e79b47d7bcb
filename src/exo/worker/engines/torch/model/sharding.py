"""The shard transform: a meta-device skeleton of the whole model is cut down to one rank's
part (pipeline: a range of decoder layers; tensor: a slice of every attention and MLP
projection), and each checkpoint tensor is mapped to its name and slice on that rank.

Parallelism is a transform on the unchanged transformers modules (the approach of gpt-fast's
`tp.py`): layers are dropped or their linears swapped for smaller ones; the model code is
never forked. Which linears split which way comes from the model's family file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from exo.shared.models.memory import vocab_share
from exo.shared.models.tensor_names import LAYER_TENSOR
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.comm.parallel_linears import (
    RowParallelLinear,
    VocabParallelHead,
)
from exo.worker.engines.torch.model.families import ModelFamily, UnsupportedArchitectureError

# How a tensor is read: the rank's part of a safetensors slice object.
TensorReader = Callable[[Any], torch.Tensor]


class AbsentModule(nn.Module):
    """Stands in for a module another pipeline rank holds (embedding, LM head)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"the {self.what} is not on this pipeline rank")


def split_head_by_vocab(model: nn.Module, rank: int, world_size: int) -> bool:
    """Keep only this tensor rank's rows of the model's LM head (`VocabParallelHead`);
    False (the head stays whole) for a head kind this cannot slice by rows, or a float32
    head tied to the embedding (it costs no memory of its own)."""
    from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear
    from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear
    from exo.worker.engines.torch.quant.quantize import Int4Linear, Int8Linear, QuantizedLinear

    head: Any = getattr(model, "lm_head", None)
    vocab = int(getattr(head, "out_features", 0) or 0)
    if head is None or world_size < 2 or vocab < world_size:
        return False
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(embedding, "weight", None)
    dense = type(head) is nn.Linear
    if dense and isinstance(weight, torch.Tensor) and head.weight.data_ptr() == weight.data_ptr():
        return False  # tied to the embedding every rank holds: rows would cost memory
    share = vocab_share(vocab, world_size)  # a multiple of 64: int4 layouts pack outputs in 64s
    start, end = min(vocab, rank * share), min(vocab, (rank + 1) * share)
    if end <= start:
        return False
    rows = slice(start, end)
    bias = None if head.bias is None else head.bias.detach()[rows].clone()
    local: nn.Module
    if type(head) is nn.Linear:
        local = nn.Linear(head.in_features, end - start, bias is not None, device="meta")
        local.weight = nn.Parameter(head.weight.detach()[rows].clone(), requires_grad=False)
        if bias is not None:
            local.bias = nn.Parameter(bias, requires_grad=False)
    elif isinstance(head, ScaledInt8Linear):
        local = head.rows(rows, bias)
    elif isinstance(head, Int8Linear | Int4Linear | SplitInt4Linear):
        # The same kind holding only these rows (every layout is row-major by output).
        kept: Any = type(head).__new__(type(head))
        QuantizedLinear.__init__(kept, head.in_features, end - start, bias)
        if isinstance(head, Int8Linear):
            kept.register_buffer("weight", head.weight[rows].clone())
            kept.register_buffer("scales", head.scales[rows].clone())
            kept.native = head.native
        elif isinstance(head, Int4Linear):
            kept = _int4_rows(head, rows)
        elif head._native:
            kept._native = True
            kept.register_buffer("values", head.values[rows].clone())
            kept.register_buffer("scale_zero", head.scale_zero[rows].clone())
        else:  # two int4 planes
            kept._native = False
            kept.planes = _int4_rows(head.planes, rows)
        local = kept
    else:
        return False
    model.lm_head = VocabParallelHead(local, vocab, start)
    return True


def _int4_rows(linear: Any, rows: slice) -> Any:
    """An `Int4Linear` holding output rows `rows` of `linear` (a multiple of 64 apart: both
    layouts are row-major by output, torch's blocked by 64 outputs)."""
    from exo.worker.engines.torch.quant.quantize import Int4Linear, QuantizedLinear

    kept: Any = Int4Linear.__new__(Int4Linear)
    bias = None if linear.bias is None else linear.bias[rows].clone()
    QuantizedLinear.__init__(kept, linear.in_features, rows.stop - rows.start, bias)
    # torch's layout unpacks by blocks of 64 outputs: a slice of them as the whole does.
    kept.group_size, kept.native = linear.group_size, linear.native
    kept._unpack_ok = linear._unpack_ok
    kept.register_buffer("packed", linear.packed[rows].clone())
    pairs = linear.scales_and_zeros  # exo's [out, groups, 2]; torch's [groups, out, 2]
    kept.register_buffer(
        "scales_and_zeros", (pairs[rows] if linear.native else pairs[:, rows]).clone()
    )
    return kept


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.model.layers`).

    Raises:
        UnsupportedArchitectureError: the model has no such list, or no embedding / final
            norm / LM head under the usual names.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    architecture = type(model).__name__
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


def cut_to_pipeline_stage(model: PreTrainedModel, shard: ShardMetadata) -> None:
    """Keep decoder layers [start_layer, end_layer) (renumbered from 0 for the KV cache), the
    embedding on the first rank only, the final norm and LM head on the last rank only.

    Raises:
        ValueError: the model's layer count differs from the card's.
    """
    layers = decoder_layers(model)
    inner: Any = model.model
    if len(layers) != shard.model_card.n_layers:
        raise ValueError(
            f"the model has {len(layers)} decoder layers, its card says {shard.model_card.n_layers}"
        )
    if (shard.start_layer, shard.end_layer) == (0, len(layers)) and shard.world_size == 1:
        return
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


def check_tensor_parallel(
    family: ModelFamily, architecture: str, config: PretrainedConfig, world_size: int
) -> None:
    """Raises UnsupportedArchitectureError / ValueError naming the architecture and field
    when the family refuses tensor parallelism, or attention heads, KV heads, the MLP width
    or a fused linear's parts do not divide by `world_size`."""
    if family.tensor_parallel_note is not None:
        raise UnsupportedArchitectureError(
            f"{architecture}: no tensor parallelism: {family.tensor_parallel_note}"
        )
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
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
        for path in (*family.column_parallel, *family.row_parallel):
            block_name, _, linear_name = path.rpartition(".")
            block = layer.get_submodule(block_name) if block_name else layer
            linear = getattr(block, linear_name, None)
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
        if family.after_tensor_split is not None:
            family.after_tensor_split(layer, text_config, world_size)


def apply_shard(model: PreTrainedModel, family: ModelFamily, shard: ShardMetadata) -> None:
    """Cut the meta skeleton down to `shard` in place (world size 1: the whole model).

    Raises:
        UnsupportedArchitectureError / ValueError: see `cut_to_pipeline_stage`,
            `check_tensor_parallel`, `split_linears`.
    """
    match shard:
        case ShardMetadata(
            sharding="pipeline",
        ):
            cut_to_pipeline_stage(model, shard)
        case ShardMetadata(
            sharding="tensor",
        ):
            decoder_layers(model)
            if shard.world_size > 1:
                config = model.config.get_text_config()
                check_tensor_parallel(family, type(model).__name__, config, shard.world_size)
                split_linears(model, family, shard.world_size)


def read_whole(tensor_slice: Any) -> torch.Tensor:
    tensor: torch.Tensor = tensor_slice[:]
    return tensor


def tensor_reader(
    family: ModelFamily, config: PretrainedConfig, model_name: str, shard: ShardMetadata
) -> TensorReader:
    """How rank `shard.device_rank` reads model tensor `model_name`: the rank's rows of
    column-parallel weights and biases (part by part for fused linears), its columns of
    row-parallel weights, everything else whole."""
    if shard.sharding != "tensor" or shard.world_size == 1:
        return read_whole
    match = LAYER_TENSOR.match(model_name)
    if match is None:
        return read_whole
    path, _, kind = match.group(2).rpartition(".")
    direction = family.split_direction(path)
    rank, world_size = shard.device_rank, shard.world_size
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
    if direction == "row" and kind == "weight":

        def columns(tensor_slice: Any) -> torch.Tensor:
            share = tensor_slice.get_shape()[1] // world_size
            tensor: torch.Tensor = tensor_slice[:, rank * share : (rank + 1) * share]
            return tensor

        return columns
    return read_whole


def model_tensor_name(name: str, prefix: str, shard: ShardMetadata) -> str | None:
    """The model's name on this rank for checkpoint tensor `name` (None: not the text model
    — a vision tower — or a layer outside the shard's range); the shard's layers are
    renumbered from 0, as its skeleton keeps them."""
    if prefix:
        if not name.startswith(prefix):
            return None
        name = name[len(prefix) :]
    match = LAYER_TENSOR.match(name)
    if match is None:
        return name
    index = int(match.group(1))
    if not shard.start_layer <= index < shard.end_layer:
        return None
    return f"model.layers.{index - shard.start_layer}.{match.group(2)}"


def loaded_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's distinct, non-meta parameters and buffers: what this rank holds
    (quantized weights are buffers)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_meta or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total
