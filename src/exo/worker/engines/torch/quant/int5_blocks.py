"""GGUF Q5_0 weights held as 5-bit lanes for exo's AVX2 kernels.

A Q5_0 block (ggml's `block_q5_0`) is 32 weights `w = d * (x - 16)`: an fp16 `d`, 4 bytes of
high bits (bit j: weight j's fifth bit) and 16 bytes of low nibbles (byte j: weight j in its
low nibble, weight j + 16 in its high one), x in [0, 31]. `Int5Linear` holds the values
`x` three to a 16-bit lane (`int5_lanes` uint8 `[out, ceil(in / 96) * 64]`, the layout in
`native/int5_blocks.cpp`: each group of 3 blocks as two vectors of 16 lanes, 5 bits per
value, a row's last group zero-padded) with `d` rounded to bfloat16 (`block_scales`
`[out, in / 32]`): 0.729 bytes per weight (0.7625 for rows of 640), where the exact int8
blocks of `int4_planes` take 1.125. Only the scales are rounded (as on every exact GGUF
route). GGUF's own 20-byte blocks would be a little smaller (0.6875) but took ~15 vector
operations per block to unpack, where a lane's three values take one shift and one mask
each (figures: docs/benchmarks/engine-design-figures.md#int5_blockspy). The kernel sums
the values' products with the int16-rounded activations exactly, as the int8 kernel does on
the same integers; more rows run the integer GEMM (`block_matmul`).

Gemma 3 270M's Q4_K_M keeps 63M of its 100M layer weights in Q5_0 (its 640 inputs are no
multiple of Q4_K's 256); there they take 48 MB per token instead of 71.

An `Int5Linear` is a `SplitInt4Linear`: where a projection's parts mix 5-bit lanes with
int8 blocks (Gemma's Q5_0 `attn_q` / `attn_k` beside a Q8_0 `attn_v` in half its layers),
`widen` turns it, in place, into the int8 blocks it stands for, so the parts fuse into one
kernel call (`fusion.fuse_linears`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from exo.worker.engines.torch.quant.int4_planes import BLOCK, SplitInt4Linear
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.quantized_linear import (
    NATIVE_BLOCK_MAX_ROWS,
    QuantizedLinear,
    decode_kernel_takes,
    prefill_product,
)

Q5_0_BLOCK_BYTES = 22  # fp16 d, 4 bytes of high bits, 16 of low nibbles
HELD_BLOCK_BYTES = 20  # the block without its scale
GROUP_BLOCKS = 3  # blocks per group of 5-bit lanes
GROUP_BYTES = 64  # two vectors of 16 16-bit lanes
LANE_VALUES = 3  # 5-bit values per 16-bit lane


def q5_0_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGUF Q5_0 rows as held: the blocks without their scales, and the scales.

    Args:
        raw: uint8 `[rows, blocks * 22]`.

    Returns:
        packed uint8 `[rows, blocks * 20]` and scales float32 `[rows, blocks]`.

    Raises:
        ValueError: a row that is not a whole number of blocks.
    """
    rows, row_bytes = raw.shape
    if row_bytes % Q5_0_BLOCK_BYTES:
        raise ValueError(f"a Q5_0 row of {row_bytes} bytes is not whole blocks")
    blocks = raw.reshape(rows, row_bytes // Q5_0_BLOCK_BYTES, Q5_0_BLOCK_BYTES)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = np.ascontiguousarray(blocks[..., 2:]).reshape(rows, -1)
    return packed, scales


def int5_values(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values `x - 16` `[out, in]` of held 5-bit blocks `[out, in / 32 * 20]`."""
    out = packed.shape[0]
    blocks = packed.reshape(out, -1, HELD_BLOCK_BYTES).to(torch.int16)
    bit = torch.arange(8, dtype=torch.int16)
    high = ((blocks[..., :4, None] >> bit) & 1).reshape(out, -1, BLOCK)  # bit j: byte j // 8
    nibbles = blocks[..., 4:]
    low = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    return ((low | (high << 4)) - 16).to(torch.int8).reshape(out, -1)


def int5_row_bytes(in_features: int) -> int:
    """Bytes of one row of 5-bit lanes for `in_features` inputs (a multiple of 32)."""
    return -(-(in_features // BLOCK) // GROUP_BLOCKS) * GROUP_BYTES


def int5_lanes(values: torch.Tensor) -> torch.Tensor:
    """Integers `[out, in]` in [-16, 15] (`in` a multiple of 32) as 5-bit lanes, uint8
    `[out, int5_row_bytes(in)]` (the layout of `native/int5_blocks.cpp`).

    Raises:
        ValueError: values outside [-16, 15], or `in` not a multiple of 32.
    """
    out, width = values.shape
    if width % BLOCK:
        raise ValueError(f"5-bit lanes hold whole blocks of {BLOCK} inputs, not {width}")
    wide = values.to(torch.int32)
    if wide.numel() and (int(wide.min()) < -16 or int(wide.max()) > 15):
        raise ValueError("5-bit lanes hold integers in [-16, 15]")
    groups = int5_row_bytes(width) // GROUP_BYTES
    padded = torch.zeros(out, groups * GROUP_BLOCKS * BLOCK, dtype=torch.int32)
    padded[:, :width] = wide + 16
    # [out, group, vector h, field f, lane j]: input 16 (3h + f) + j of the group.
    fields = padded.reshape(out, groups, 2, LANE_VALUES, 16)
    lanes = fields[..., 0, :] | (fields[..., 1, :] << 5) | (fields[..., 2, :] << 10)
    return lanes.to(torch.int16).reshape(out, -1).view(torch.uint8).contiguous()


def lane_values(lanes: torch.Tensor, in_features: int) -> torch.Tensor:
    """The int8 values `[out, in_features]` in [-16, 15] of 5-bit lanes (`int5_lanes`'
    inverse)."""
    out = lanes.shape[0]
    wide = lanes.contiguous().view(torch.int16).to(torch.int32).reshape(out, -1, 2, 1, 16)
    shifts = torch.tensor([0, 5, 10], dtype=torch.int32).reshape(1, 1, 1, LANE_VALUES, 1)
    fields = (wide >> shifts) & 0x1F  # [out, group, h, f, j]
    return (fields.reshape(out, -1)[:, :in_features] - 16).to(torch.int8)


class Int5Linear(SplitInt4Linear):
    """Q5_0 blocks held as 5-bit lanes: `w = (x - 16) * scale` per block of 32 inputs
    (see the module docstring), for exo's AVX2 kernels (built only where they run).

    Args:
        packed: uint8 `[out, in / 32 * 20]`: GGUF's blocks without their scales
            (`q5_0_blocks`), repacked into lanes here.
        scales: `[out, in / 32]` float (rounded to bfloat16).
        bias: `[out]` or None.

    Raises:
        ValueError: shapes that do not fit, or no exo kernels on this machine.
    """

    def __init__(
        self, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        out_features, blocks = scales.shape
        if packed.dtype != torch.uint8 or packed.shape != (out_features, blocks * HELD_BLOCK_BYTES):
            raise ValueError(
                f"5-bit blocks {tuple(packed.shape)} do not fit {blocks} scales per row"
            )
        if built_int4_kernel() is None:
            raise ValueError("5-bit blocks need exo's native kernels")
        QuantizedLinear.__init__(self, blocks * BLOCK, out_features, bias)
        self._native = True
        self.int5_lanes: torch.Tensor | None
        self.block_scales: torch.Tensor | None
        self.register_buffer("int5_lanes", int5_lanes(int5_values(packed)))
        self.register_buffer("block_scales", scales.to(torch.bfloat16).contiguous())

    @property
    def widened(self) -> bool:
        """Whether `widen` turned it into int8 blocks."""
        return self.int5_lanes is None

    def widen(self) -> None:
        """Hold the same integers as int8 blocks with (scale, zero) pairs (`SplitInt4Linear`'s
        native form: scale d, zero 8d), freeing the 5-bit blocks."""
        if self.widened:
            return
        assert self.int5_lanes is not None and self.block_scales is not None
        scales = self.block_scales.float()
        self.register_buffer("values", lane_values(self.int5_lanes, self.in_features))
        pairs = torch.stack([scales, 8.0 * scales], dim=-1).to(torch.bfloat16).contiguous()
        self.register_buffer("scale_zero", pairs)
        self.int5_lanes = None
        self.block_scales = None

    @classmethod
    def concatenate(cls, parts: list[Any]) -> Any:
        """One linear whose outputs are `parts`' outputs in order: 5-bit lanes when every
        part holds them, else (some widened) `SplitInt4Linear.concatenate` of the widened
        parts.

        Raises:
            ValueError: the parts' input widths differ, or only some have a bias.
        """
        if not all(isinstance(part, Int5Linear) and not part.widened for part in parts):
            for part in parts:
                if isinstance(part, Int5Linear):
                    part.widen()
            return SplitInt4Linear.concatenate(parts)
        if len({part.in_features for part in parts}) != 1:
            raise ValueError("linears with different input widths cannot be fused")
        biases = [part.bias for part in parts]
        if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
            raise ValueError("cannot fuse linears where only some have a bias")
        fused = cls.__new__(cls)
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        QuantizedLinear.__init__(
            fused, parts[0].in_features, sum(part.out_features for part in parts), bias
        )
        fused._native = True
        fused.register_buffer("int5_lanes", torch.cat([part.int5_lanes for part in parts]))
        fused.register_buffer("block_scales", torch.cat([part.block_scales for part in parts]))
        return fused

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`[rows, in]` → `[rows, out]` in the rows' dtype: the decode kernel up to
        `NATIVE_BLOCK_MAX_ROWS` rows, else the integer GEMM (the same block sums)."""
        if self.widened:
            return super().matmul(rows)
        x = rows.float().contiguous()
        if decode_kernel_takes(rows.shape[0], NATIVE_BLOCK_MAX_ROWS):
            out: torch.Tensor = torch.ops.exo_native.int5_gemv(
                x, self.int5_lanes, self.block_scales
            )
        else:
            assert self.int5_lanes is not None and self.block_scales is not None  # not widened
            out = prefill_product(x, self.int5_lanes, self.block_scales, self.prefill_activations)
        return out.to(rows.dtype)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def dequantize_float(self) -> torch.Tensor:
        """The weight as `[out, in]` float32, exact (held integers times held scales)."""
        if self.widened:
            return super().dequantize_float()
        assert self.int5_lanes is not None and self.block_scales is not None
        scales = self.block_scales.float().repeat_interleave(BLOCK, dim=1)
        return lane_values(self.int5_lanes, self.in_features).float() * scales

    def dequantize_transposed(self) -> torch.Tensor:
        return self.dequantize_float().to(torch.bfloat16).t()


class Int5BlockPart:
    """A safetensors slice of raw GGUF Q5_0 blocks `[out, bytes per row]` seen as its held
    blocks `[out, blocks * 20]` (`part="packed"`, uint8) or scales `[out, blocks]`
    (float32): rows are read as bytes, then columns sliced, so a tensor-parallel reader
    slices both parts alike (whole blocks when the blocks divide by the world size)."""

    def __init__(self, raw: Any, part: str) -> None:
        self._raw, self._part = raw, part
        rows, row_bytes = raw.get_shape()
        blocks = row_bytes // Q5_0_BLOCK_BYTES
        self._shape = [rows, blocks * HELD_BLOCK_BYTES if part == "packed" else blocks]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        packed, scales = q5_0_blocks(self._raw[rows].numpy())
        chosen = packed if self._part == "packed" else scales
        return torch.from_numpy(np.ascontiguousarray(chosen))[:, columns]
