"""Loading weights repacked from GGUF (`exo.download.gguf_repack`) into the engine's modules.

A repacked weight is stored under its checkpoint name plus a suffix: `.int4_packed`,
`.int4_scales`, `.int4_zeros` (GGUF Q4_0 / Q4_1 / Q4_K as the engine's int4 groups),
`.int4_packed` and `.int4_q4k_scales` (Q4_K with compact scales, `q4k_scales`: held as
they are, or expanded to the groups they stand for where a rank's columns cut a super-block
of 256) or `.gguf_<TYPE>` (raw GGUF blocks of any other quantized type). Each is read through the
same tensor-parallel reader as a float weight: the packed bytes, scales and zeros are
row-major `[out, in / 2]`, `[out, in / 32]`, `[out, in / 32]`, so a rank's rows (or its
columns, when `in / world size` is a multiple of 32) are a plain slice of each; raw blocks
are dequantized per row and then sliced.

How a decoder-layer linear is built when the engine holds int4 (`weight_dtype="int4"`),
from the error each route adds to the GGUF's own values, measured on Gaussian weights with
0.1% outliers (relative Frobenius error; figures:
docs/benchmarks/engine-design-figures.md#gguf_weightspy):

- Q4_0 / Q4_1 / Q4_K → `Int4Linear` directly, no float detour: the bf16 rounding of scales
  and zeros only (a float32 load is exact).
- Q6_K where exo's AVX2 kernels run → `ScaledInt8Linear` (`int8_blocks`): the integers
  exactly as int8 with one bfloat16 scale per 16 inputs, 1.125 bytes per weight: only the
  bf16 rounding of the scales. (A Q8_0 linear takes the next route: fused with Q5_0 / Q5_1
  neighbours into one kernel call, which a mix of kinds could not be.)
- Q5_0 where exo's AVX2 kernels run → `Int5Linear` (`int5_blocks`): the blocks' integers
  exactly as 5-bit lanes (three values per 16-bit lane), ~0.75 bytes per weight: only the
  bf16 rounding of the scales.
- Q8_0, Q5_0 (elsewhere), Q5_1 → `SplitInt4Linear`: the block integers exactly, as two int4
  planes (high and low nibble, `int4_planes`; int8 blocks with a (scale, zero) pair, 1.125
  bytes, where exo's kernels run): again only the bf16 rounding of scales and zeros,
  1.25 bytes per weight.
- Q6_K (elsewhere) and any other quantized type → `Bf16Linear` (the dequantized weight in
  bfloat16): the bf16 rounding only, where requantizing to the engine's int8 per output
  channel adds several times Q8_0's own error and to int4 groups more. It costs 2 bytes per
  weight against int8's 1. (Q6_K's sub-blocks of 16 are smaller than the int4 kernel's
  smallest group, 32.)
- A split that cuts a block (a tensor-parallel rank's columns when `in / world size` is no
  multiple of 32) or an output count the int4 layout cannot pack (`out % 64`) takes the
  bfloat16 route.
- F32 / F16 / BF16 weights → the engine's own quantization, as for any checkpoint.

The LM head, when its stored weight (the embedding, for a tied head) is Q8_0 / Q5_0 / Q5_1
(or Q6_K, where exo's kernels run: `q6k_blocks`) and the engine quantizes, is held as those
blocks too (`split_output_layer`), in place of the engine's int8 head. Everything else
(the embedding, other heads, norms, any weight when the engine holds float32 or int8) is
dequantized to float32 and loaded as a checkpoint tensor would be, so the engine's other
policies (float32 embedding, int8 LM head) apply.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from exo.shared.models.tensor_names import (
    INT4_PACKED,
    INT4_Q4K_SCALES,
    INT4_SCALES,
    INT4_ZEROS,
    LAYER_TENSOR,
)
from exo.shared.models.weight_formats import INT4_GROUP_SIZE
from exo.worker.engines.torch.comm.parallel_linears import AllReducedLinear, RowParallelLinear
from exo.worker.engines.torch.quant.int4_groups import (
    int4_linear_from_groups,
    int4_linear_from_q4k,
)
from exo.worker.engines.torch.quant.int4_planes import (
    BLOCK,
    SPLIT_TYPES,
    BlockPart,
    SplitInt4Linear,
)
from exo.worker.engines.torch.quant.int5_blocks import HELD_BLOCK_BYTES, Int5BlockPart, Int5Linear
from exo.worker.engines.torch.quant.int8_blocks import (
    SCALED_TYPES,
    ScaledBlockPart,
    ScaledInt8Linear,
)
from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel
from exo.worker.engines.torch.quant.q4k_scales import (
    Q4K_SUPER_BLOCK,
    Q4kGroupPart,
    Q4kScalesPart,
)
from exo.worker.engines.torch.quant.q6k_blocks import q6k_head, q6k_head_wanted
from exo.worker.engines.torch.quant.quantized_linear import NATIVE_MAX_ROWS, QuantizedLinear

_REPACKED = re.compile(
    r"^(?P<base>.+?)(?P<suffix>\.int4_packed|\.int4_scales|\.int4_zeros|\.int4_q4k_scales"
    r"|\.gguf_(?P<type>[A-Z0-9_]+))$"
)
TensorReader = Callable[[Any], torch.Tensor]
_DEQUANTIZE_ROWS = 2048


@dataclass(frozen=True, slots=True)
class RepackedName:
    """A stored tensor name split into the checkpoint name it stands for and its form.
    `companion`: scales or zeros, read together with their `.int4_packed`."""

    base: str
    suffix: str
    gguf_type: str | None

    @property
    def companion(self) -> bool:
        return self.suffix in (INT4_SCALES, INT4_ZEROS, INT4_Q4K_SCALES)


def split_repacked_name(name: str) -> RepackedName | None:
    """`name` as a repacked tensor's parts, or None for a plain checkpoint tensor."""
    match = _REPACKED.match(name)
    if match is None:
        return None
    return RepackedName(match.group("base"), match.group("suffix"), match.group("type"))


class Bf16Linear(QuantizedLinear):
    """A weight held in bfloat16, `[out, in]` (GGUF types the int4 groups cannot hold
    without loss; see the module docstring). Where exo's kernels run (`native_kernels`: AVX2
    CPUs, which have no bfloat16 arithmetic; `native` True) it takes float32 rows: up to
    `NATIVE_MAX_ROWS` rows exo's `bf16_gemv` (exact float32 sums, bound by reading the
    weight), more rows torch's float32 matmul on the weight widened once per call (torch's
    bfloat16 matmul is emulated there and slower than exo's kernel; figures:
    docs/benchmarks/engine-design-figures.md#gguf_weightspy), and exo's decode layer reads
    it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.weight: torch.Tensor
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous())
        self.native = native_int4_kernel() is not None

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if not self.native:
            return super().matmul(rows)
        if rows.shape[0] <= NATIVE_MAX_ROWS:
            out: torch.Tensor = torch.ops.exo_native.bf16_gemv(
                rows.float().contiguous(), self.weight
            )
        else:
            out = torch.nn.functional.linear(rows.float(), self.weight.float())
        return out.to(rows.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight


class DequantizedBlocks:
    """A safetensors slice of raw GGUF blocks `[out, bytes per row]` seen as the float32
    `[out, in]` weight: rows are read as bytes and dequantized by `gguf`, then sliced."""

    def __init__(self, raw: Any, gguf_type: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self._raw = raw
        self._type = GGMLQuantizationType[gguf_type]
        block_size, type_size = GGML_QUANT_SIZES[self._type]
        rows, row_bytes = raw.get_shape()
        self._shape = [rows, row_bytes // type_size * block_size]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        from gguf.quants import dequantize

        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        if not isinstance(columns, slice):
            raise TypeError(f"columns are read by slice, not {columns!r}")
        selected = range(self._shape[0])[rows] if isinstance(rows, slice) else None
        if selected is None or selected.step != 1:
            raise TypeError(f"rows are read by a contiguous slice, not {rows!r}")
        width = len(range(self._shape[1])[columns])
        result = torch.empty(len(selected), width, dtype=torch.float32)
        # Row chunks, read from the file one at a time, bound the raw copy and gguf's float32
        # temporaries (an embedding is the largest weight).
        for start in range(0, len(selected), _DEQUANTIZE_ROWS):
            first = selected.start + start
            chunk = self._raw[first : min(first + _DEQUANTIZE_ROWS, selected.stop)].numpy()
            values = dequantize(chunk, self._type).reshape(chunk.shape[0], -1)
            result[start : start + chunk.shape[0]] = torch.from_numpy(values)[:, columns]
        return result


def _dequantize_groups(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """float32 `[out, in]` from int4 groups (`(q - 8) * scale + zero`)."""
    out_features = packed.shape[0]
    values = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(
        out_features, scales.shape[1], -1
    )
    weight = (values.float() - 8.0) * scales.float()[..., None] + zeros.float()[..., None]
    return weight.reshape(out_features, -1)


class DequantizedGroups:
    """Safetensors slices of int4 groups (packed, scales, zeros) seen as the float32
    `[out, in]` weight: rows are read and dequantized, then any columns sliced."""

    def __init__(self, packed: Any, scales: Any, zeros: Any) -> None:
        self._parts = (packed, scales, zeros)
        rows, half = packed.get_shape()
        self._shape = [rows, 2 * half]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        packed, scales, zeros = (part[rows] for part in self._parts)
        return _dequantize_groups(packed, scales, zeros)[:, columns]


def _bias_of(linear: nn.Linear) -> torch.Tensor | None:
    bias = linear.bias
    return None if bias is None or bias.is_meta else bias


def _direct_target(model: nn.Module, target: str, weight_dtype: str) -> tuple[Any, str] | None:
    """(parent module, attribute) of the decoder-layer linear whose weight is `target`, when
    the engine holds int4 and builds it straight from the stored form; else None."""
    if weight_dtype != "int4" or LAYER_TENSOR.match(target) is None:
        return None
    module_path, _, attribute = target.rpartition(".")
    if attribute != "weight":
        return None
    linear = model.get_submodule(module_path)
    if type(linear) not in (nn.Linear, RowParallelLinear):
        return None
    parent_path, _, name = module_path.rpartition(".")
    return model.get_submodule(parent_path), name


def _install(
    parent: nn.Module, name: str, build: Callable[[torch.Tensor | None], nn.Module]
) -> None:
    """Replace linear `parent.name` by `build(bias)`; a row-parallel one is wrapped so the
    partial sums are all-reduced before its bias is added."""
    linear = getattr(parent, name)
    bias = _bias_of(linear)
    if type(linear) is RowParallelLinear:
        setattr(parent, name, AllReducedLinear(build(None), bias))
    else:
        setattr(parent, name, build(bias))


def load_repacked(
    model: nn.Module,
    handle: Any,
    stored_name: str,
    target: str,
    reader: TensorReader,
    weight_dtype: str,
) -> torch.Tensor | None:
    """Read the repacked tensor `stored_name` for model tensor `target` on this rank.

    A decoder-layer linear's weight with `weight_dtype` "int4" replaces the linear by its
    quantized module (see the module docstring) and returns None; anything else is returned
    as the float32 tensor the caller assigns.

    Args:
        model: the meta skeleton being filled.
        handle: the open safetensors file holding `stored_name` (and its companions).
        stored_name: a name `split_repacked_name` accepts, not a companion.
        target: the model tensor name on this rank.
        reader: this rank's slice of a tensor (`parallel/tensor.py`'s `tensor_reader`).
        weight_dtype: the format the engine holds weights in.

    Raises:
        ValueError: a name that is no repacked tensor.
    """
    parts = split_repacked_name(stored_name)
    if parts is None or parts.companion:
        raise ValueError(f"{stored_name} is not a repacked weight")
    direct = _direct_target(model, target, weight_dtype)
    # Q6_K only: a layer's Q8_0 linears (Gemma's Q4_K_M keeps some `attn_v` in Q8_0) stay
    # int8 blocks with (scale, zero) pairs, which fuse with their Q5_0 neighbours.
    if parts.gguf_type == "Q6_K" and direct is not None and native_int4_kernel() is not None:
        raw = handle.get_slice(stored_name)
        values, scales = (
            reader(ScaledBlockPart(raw, parts.gguf_type, part)) for part in ("values", "scales")
        )
        per_scale = SCALED_TYPES[parts.gguf_type][2]
        # Whole blocks on this rank (a row-parallel split may cut them: the routes below).
        if values.shape[1] == per_scale * scales.shape[1] and values.shape[1] % 32 == 0:
            _install(*direct, lambda bias: ScaledInt8Linear(values, scales, bias, per_scale))
            return None
    if parts.gguf_type == "Q5_0" and direct is not None and native_int4_kernel() is not None:
        raw = handle.get_slice(stored_name)
        packed, scales = (reader(Int5BlockPart(raw, part)) for part in ("packed", "scales"))
        if packed.shape[1] == HELD_BLOCK_BYTES * scales.shape[1]:  # whole blocks here
            _install(*direct, lambda bias: Int5Linear(packed, scales, bias))
            return None
    if parts.gguf_type in SPLIT_TYPES and direct is not None:
        raw = handle.get_slice(stored_name)
        values, scales, offsets = (
            reader(BlockPart(raw, parts.gguf_type, part))
            for part in ("values", "scales", "offsets")
        )
        parent, name = direct
        # Whole blocks on this rank (a row-parallel split of `in / world` % 32 == 0 columns)
        # and a packable shape; otherwise the bfloat16 route below.
        if (
            values.shape[1] == BLOCK * scales.shape[1]
            and getattr(parent, name).out_features % 64 == 0
        ):
            _install(parent, name, lambda bias: SplitInt4Linear(values, scales, offsets, bias))
            return None
    if parts.gguf_type is not None:
        weight = reader(DequantizedBlocks(handle.get_slice(stored_name), parts.gguf_type))
        if direct is None:
            return weight.contiguous()
        _install(*direct, lambda bias: Bf16Linear(weight, bias))
        return None
    compact = _q4k_slice(handle, parts.base)
    if compact is None:
        slices = [
            handle.get_slice(parts.base + suffix)
            for suffix in (INT4_PACKED, INT4_SCALES, INT4_ZEROS)
        ]
    else:  # Q4_K's compact scales (q4k_scales): held as they are where whole super-blocks
        packed_slice = handle.get_slice(parts.base + INT4_PACKED)
        if direct is not None and getattr(direct[0], direct[1]).out_features % 64 == 0:
            packed = reader(packed_slice)
            held = _whole_super_blocks(reader, compact, packed.shape[1] * 2)
            if held is not None:
                _install(*direct, lambda bias: int4_linear_from_q4k(packed, held, bias))
                return None
        # A split that cuts a super-block, or no int4 module: the groups they stand for.
        slices = [packed_slice, Q4kGroupPart(compact, "scales"), Q4kGroupPart(compact, "zeros")]
    packed, scales, zeros = (reader(tensor_slice) for tensor_slice in slices)
    if packed.shape[1] * 2 != scales.shape[1] * INT4_GROUP_SIZE:
        # This rank's columns cut an int4 group (in / world size is no multiple of 32):
        # its slice of the dequantized weight, held as the engine decides (int8).
        return reader(DequantizedGroups(*slices)).contiguous()
    if direct is not None:
        parent, name = direct
        linear = getattr(parent, name)
        if linear.out_features % 64 == 0:
            _install(
                parent, name, lambda bias: int4_linear_from_groups(packed, scales, zeros, bias)
            )
            return None
    return _dequantize_groups(packed, scales, zeros)


def _whole_super_blocks(reader: TensorReader, compact: Any, columns: int) -> torch.Tensor | None:
    """This rank's compact scales `[out, columns / 256, 20]` of stored slice `compact`, or
    None where its `columns` inputs are not whole super-blocks of 256."""
    if columns % Q4K_SUPER_BLOCK:
        return None
    try:
        held = reader(Q4kScalesPart(compact))
    except ValueError:  # the reader's columns cut a super-block
        return None
    return held if held.shape[1] * Q4K_SUPER_BLOCK == columns else None


def _q4k_slice(handle: Any, base: str) -> Any:
    """The safetensors slice of weight `base`'s compact Q4_K scales, or None where it was
    stored with scales and zeros (Q4_0 / Q4_1, or a directory converted before)."""
    try:
        return handle.get_slice(base + INT4_Q4K_SCALES)
    except Exception:  # safetensors' SafetensorError for a name the file does not hold
        return None


# Rows of an LM head converted to split planes at a time: bounds the int32 temporaries
# (Gemma 3's head is 262,144 x 640).
_HEAD_ROWS_PER_STEP = 8192


def split_output_layer(model: nn.Module, handle: Any, stored_name: str) -> bool:
    """Hold the model's LM head as exact split int4 planes (`SplitInt4Linear`) when its
    stored weight (the embedding, for tied heads) is GGUF Q8_0 / Q5_0 / Q5_1 blocks: the
    route that loses least, as for the decoder linears. Against the engine's int8 head (one
    scale per row, requantized from the dequantized blocks) it costs 1.25 bytes per weight
    instead of 1 and a slower decode row, for a KL from the float32 head a third of int8's,
    near bfloat16 weights' (figures: docs/benchmarks/engine-design-figures.md#gguf_weightspy).
    Where exo's AVX2
    kernels run, a Q8_0 head is held as symmetric int8 blocks instead (`ScaledInt8Linear`,
    1.0625 bytes per weight, the same integers and scales), and a Q6_K head (a Q4_K_M
    file's) as its own blocks (`q6k_blocks.Q6KLinear`, 0.82 bytes per weight, byte for byte
    the file's) unless `EXO_Q6K_HEAD=0`.

    Args:
        model: the loaded model, its LM head an `nn.Linear` (any weight, even meta).
        handle: the open safetensors file holding `stored_name`.
        stored_name: the head's stored tensor name (`...weight.gguf_<TYPE>`).

    Returns:
        whether the head was replaced (False: another type, a shape the int4 layout cannot
        pack, or no `nn.Linear` head on this rank).
    """
    parts = split_repacked_name(stored_name)
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if callable(get_output_embeddings) else None
    if parts is None or type(head) is not nn.Linear:
        return False
    assert isinstance(head, nn.Linear)
    if parts.gguf_type == "Q6_K":
        if not q6k_head_wanted():
            return False
        raw_q6k = handle.get_slice(stored_name)
        return _replace_head(model, head, q6k_head(raw_q6k, head.out_features, head.in_features))
    if parts.gguf_type not in SPLIT_TYPES:
        return False
    assert parts.gguf_type is not None
    raw = handle.get_slice(stored_name)
    if parts.gguf_type == "Q8_0" and native_int4_kernel() is not None:
        return _replace_head(model, head, _scaled_head(raw, head))
    kinds = ("values", "scales", "offsets")
    blocks = [BlockPart(raw, parts.gguf_type, kind) for kind in kinds]
    rows, columns = blocks[0].get_shape()
    if (rows, columns) != (head.out_features, head.in_features) or rows % 64:
        return False
    pieces = []
    for start in range(0, rows, _HEAD_ROWS_PER_STEP):
        chunk = slice(start, min(start + _HEAD_ROWS_PER_STEP, rows))
        values, scales, offsets = (part[chunk] for part in blocks)
        pieces.append(SplitInt4Linear(values, scales, offsets, None))
    split = pieces[0] if len(pieces) == 1 else SplitInt4Linear.concatenate(pieces)
    del pieces
    return _replace_head(model, head, split)


def _scaled_head(raw: Any, head: nn.Linear) -> ScaledInt8Linear | None:
    """A Q8_0 head as symmetric int8 blocks of 32 (`ScaledInt8Linear`), converted in row
    blocks; None where the stored shape is not the head's."""
    values_part, scales_part = (ScaledBlockPart(raw, "Q8_0", part) for part in ("values", "scales"))
    rows, columns = values_part.get_shape()
    if (rows, columns) != (head.out_features, head.in_features) or columns % 32:
        return None
    values = torch.empty(rows, columns, dtype=torch.int8)
    scales = torch.empty(rows, columns // 32, dtype=torch.bfloat16)
    for start in range(0, rows, _HEAD_ROWS_PER_STEP):
        chunk = slice(start, min(start + _HEAD_ROWS_PER_STEP, rows))
        values[chunk] = values_part[chunk]
        scales[chunk] = scales_part[chunk].to(torch.bfloat16)
    return ScaledInt8Linear(values, scales, None, 32)


def _replace_head(model: nn.Module, head: nn.Linear, held: QuantizedLinear | None) -> bool:
    """Put `held` (with the head's bias) where the model has `head`; False for None."""
    if held is None:
        return False
    if head.bias is not None and not head.bias.is_meta:
        held.bias = head.bias.detach().clone()
    for name, module in model.named_modules():
        if module is head:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, held)
            return True
    return False
