"""What cutting a meta-device skeleton to one rank's part shares across parallelisms: the
decoder layers' list, stand-ins for modules another rank holds, a tensor rank's rows of the
LM head, and the map from checkpoint tensor names to the rank's renumbered layers.

Parallelism is a transform on the unchanged transformers modules (the approach of gpt-fast's
`tp.py`): each kind's cut lives in `exo.worker.engines.torch.parallel` (one file per kind);
the model code is never forked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from exo.shared.models.memory import vocab_share
from exo.shared.models.tensor_names import LAYER_TENSOR
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.comm.parallel_linears import (
    VocabParallelHead,
)
from exo.worker.engines.torch.model.families import UnsupportedArchitectureError

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
    False (the head stays whole) for a head kind this cannot slice by rows, a float32
    head tied to the embedding (it costs no memory of its own), or a vocabulary too small
    for every rank to hold rows (`vocab_share`: 64 ids over 2 ranks in shares of 64 would
    leave rank 1 none).

    Every rank of the group decides the same way from the same inputs: a rank with a split
    head all-gathers its logits, so a rank that kept its head whole while another split
    would leave the ranks one collective out of step."""
    from exo.worker.engines.torch.quant.int4_groups import Int4Linear
    from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear
    from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear
    from exo.worker.engines.torch.quant.int8_channels import Int8Linear
    from exo.worker.engines.torch.quant.q6k_blocks import Q6KLinear
    from exo.worker.engines.torch.quant.quantized_linear import QuantizedLinear

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
    if share >= vocab:  # some rank would hold no rows
        return False
    start, end = rank * share, min(vocab, (rank + 1) * share)
    rows = slice(start, end)
    bias = None if head.bias is None else head.bias.detach()[rows].clone()
    local: nn.Module
    if type(head) is nn.Linear:
        local = nn.Linear(head.in_features, end - start, bias is not None, device="meta")
        local.weight = nn.Parameter(head.weight.detach()[rows].clone(), requires_grad=False)
        if bias is not None:
            local.bias = nn.Parameter(bias, requires_grad=False)
    elif isinstance(head, ScaledInt8Linear | Q6KLinear):
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
    from exo.worker.engines.torch.quant.int4_groups import Int4Linear
    from exo.worker.engines.torch.quant.quantized_linear import QuantizedLinear

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


def read_whole(tensor_slice: Any) -> torch.Tensor:
    tensor: torch.Tensor = tensor_slice[:]
    return tensor


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
