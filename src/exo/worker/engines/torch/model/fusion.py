"""Module swaps that cut per-token operator count in a loaded model (same math, fewer ops).

Decode of a small model on CPU spends as much time dispatching small operators as in the
matmuls, so replacing a multi-op module by a single fused kernel is measurable per token.
`fuse_linears` concatenates linears that read the same input (Q/K/V, gate/up) along their
outputs, as gpt-fast's `wqkv` and vLLM's `QKVParallelLinear` do: one matmul instead of three.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear
from exo.worker.engines.torch.quant.int5_blocks import Int5Linear
from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.quantized_linear import QuantizedLinear


class FusedRMSNorm(nn.Module):
    """`torch.nn.functional.rms_norm` (one kernel) in place of a float32 model's RMSNorm."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = eps
        self._shape = (weight.shape[-1],)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(hidden_states, self._shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}"


def fuse_rms_norms(model: nn.Module, norm_classes: tuple[type[nn.Module], ...]) -> int:
    """Replace the float32 model's RMSNorm modules of `norm_classes` (a family file's
    `rms_norms`: classes computing `weight * (x.float() * rsqrt(mean(x.float()^2) + eps))
    .to(dtype)`, not Gemma's `1 + weight` variant) by `FusedRMSNorm` in place.

    Only float32 weights are swapped: the originals compute in float32 and cast back to
    the input dtype before scaling, which one float32 kernel reproduces exactly only then.

    Returns:
        the number of replaced modules.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) in norm_classes
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dtype == torch.float32
        and isinstance(getattr(module, "variance_epsilon", None), float)
    ]
    for name, module in targets:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, FusedRMSNorm(module.weight, module.variance_epsilon))
    return len(targets)


def fuse_linears(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear computing `parts`' outputs concatenated in order (for linears reading the
    same input: a layer's Q/K/V or gate/up projections; on a tensor rank, its own slices).

    The fused weight is new; each part is then re-pointed at its rows of it (views, and
    small per-part copies of int4 scales), so the model's own modules keep working and
    the weights are held once.

    Args:
        parts: `nn.Linear`, `Int4Linear`, `SplitInt4Linear`, `ScaledInt8Linear` or
            `Int8Linear` modules of one kind, same input width (`Int5Linear` ones may sit
            beside `SplitInt4Linear` ones: they are widened to its int8 blocks).

    Returns:
        The fused module (`parts[0]` itself when there is one part), or None when the parts
        are of different kinds (e.g. one fell back to int8 because int4 cannot pack its
        shape), int4 groups of different sizes, or of a kind this cannot fuse. A fused
        quantized module rounds prefill's activations as `parts[0]` does.
    """
    fused = _fuse(parts)
    if isinstance(fused, QuantizedLinear) and isinstance(parts[0], QuantizedLinear):
        fused.prefill_activations = parts[0].prefill_activations
    return fused


def _fuse(parts: Sequence[nn.Module]) -> nn.Module | None:
    if len(parts) == 1:
        return parts[0]
    kinds = {type(part) for part in parts}
    if kinds <= {Int5Linear, SplitInt4Linear} and Int5Linear in kinds:
        return _fuse_int5(parts)
    if len(kinds) != 1 or len({getattr(part, "in_features", None) for part in parts}) != 1:
        return None
    kind = kinds.pop()
    if kind is nn.Linear:
        linears = [part for part in parts if isinstance(part, nn.Linear)]
        biases = [linear.bias for linear in linears]
        if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
            return None
        weight = torch.cat([linear.weight.detach() for linear in linears])
        dense = nn.Linear(weight.shape[1], weight.shape[0], biases[0] is not None, "meta")
        dense.weight = nn.Parameter(weight, requires_grad=False)
        if dense.bias is not None:
            bias = torch.cat([b.detach() for b in biases if b is not None])
            dense.bias = nn.Parameter(bias, requires_grad=False)
        offset = 0
        for linear in linears:
            rows = slice(offset, offset + linear.out_features)
            linear.weight = nn.Parameter(dense.weight[rows], requires_grad=False)
            if linear.bias is not None:
                assert dense.bias is not None
                linear.bias = nn.Parameter(dense.bias[rows], requires_grad=False)
            offset += linear.out_features
        return dense
    if kind is Int4Linear:
        int4 = [part for part in parts if isinstance(part, Int4Linear)]
        if len({part.group_size for part in int4}) != 1:  # e.g. GGUF Q4_0 beside Q4_K
            return None
        fused4 = Int4Linear.concatenate(int4)
        offset = 0
        for part in int4:
            rows = slice(offset, offset + part.out_features)
            part.packed = fused4.packed[rows]  # the blocked layout is row-major by output
            if part.bias is not None and fused4.bias is not None:
                part.bias = fused4.bias[rows]
            offset += part.out_features
        return fused4
    if kind is SplitInt4Linear:
        split = [part for part in parts if isinstance(part, SplitInt4Linear)]
        fused_split = SplitInt4Linear.concatenate(split)
        offset = 0
        for part_split in split:
            rows = slice(offset, offset + part_split.out_features)
            if fused_split._native:  # int8 block values (exo's kernels)
                part_split.values = fused_split.values[rows]
                part_split.scale_zero = fused_split.scale_zero[rows]
            else:
                part_split.planes.packed = fused_split.planes.packed[rows]
            if part_split.bias is not None and fused_split.bias is not None:
                part_split.bias = fused_split.bias[rows]
            offset += part_split.out_features
        return fused_split
    if kind is ScaledInt8Linear:
        scaled = [part for part in parts if isinstance(part, ScaledInt8Linear)]
        if len({part.block_size for part in scaled}) != 1:  # Q8_0 beside Q6_K
            return None
        fused_scaled = ScaledInt8Linear.concatenate(scaled)
        offset = 0
        for part_scaled in scaled:
            rows = slice(offset, offset + part_scaled.out_features)
            part_scaled.values = fused_scaled.values[rows]
            part_scaled.block_scales = fused_scaled.block_scales[rows]
            if part_scaled.bias is not None and fused_scaled.bias is not None:
                part_scaled.bias = fused_scaled.bias[rows]
            offset += part_scaled.out_features
        return fused_scaled
    if kind is Int8Linear:
        int8 = [part for part in parts if isinstance(part, Int8Linear)]
        fused8 = Int8Linear.concatenate(int8)
        offset = 0
        for part8 in int8:
            rows = slice(offset, offset + part8.out_features)
            part8.weight = fused8.weight[rows]
            part8.scales = fused8.scales[rows]
            if part8.bias is not None and fused8.bias is not None:
                part8.bias = fused8.bias[rows]
            offset += part8.out_features
        return fused8
    return None


def _fuse_int5(parts: Sequence[nn.Module]) -> nn.Module | None:
    """`Int5Linear` parts (and `SplitInt4Linear` ones in exo's int8-block form) fused: 5-bit
    lanes when every part holds them, else every part widened to int8 blocks in place
    (`Int5Linear.widen`), each part then re-pointed at its rows of the fused weight."""
    try:
        fused = Int5Linear.concatenate(list(parts))
    except ValueError:  # widths, biases, or split planes beside int8 blocks
        return None
    offset = 0
    for part in parts:
        assert isinstance(part, SplitInt4Linear)
        rows = slice(offset, offset + part.out_features)
        if isinstance(fused, Int5Linear) and not fused.widened:
            assert isinstance(part, Int5Linear)
            assert fused.int5_lanes is not None and fused.block_scales is not None
            part.int5_lanes = fused.int5_lanes[rows]
            part.block_scales = fused.block_scales[rows]
        else:
            part.values = fused.values[rows]
            part.scale_zero = fused.scale_zero[rows]
        if part.bias is not None and fused.bias is not None:
            part.bias = fused.bias[rows]
        offset += part.out_features
    return fused
