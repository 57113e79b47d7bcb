"""GGUF's 8-bit and 5-bit blocks (Q8_0, Q5_0, Q5_1) held exactly as two int4 planes.

The engine's only sub-byte kernel, `aten._weight_int4pack_mm_for_cpu`, computes `x · Wᵀ` for
4-bit values in groups of 32 inputs, each group with its own (scale, zero):
`w = (q - 8) * scale + zero`, q in [0, 15]. A GGUF Q8_0 / Q5_0 / Q5_1 block is 32 weights
`w = d * v + m` with one fp16 scale `d` (and Q5_1's fp16 offset `m`; 0 otherwise) and
integer values `v`: int8 for Q8_0, `x - 16` for Q5_0 and `x` for Q5_1 with x in [0, 31]
(ggml's `block_q8_0` / `block_q5_0` / `block_q5_1`). Every such `v` splits into a high and a
low nibble, `v = 16 * h + l` with `l = v mod 16` in [0, 15] and `h` in [-8, 7], so

    w = (h + 8 - 8) * 16d + 0   +   (l - 8) * d + (8d + m)

is two int4 groups over the same inputs: a high plane (scale 16d, zero 0) and a low plane
(scale d, zero 8d + m). Stacking both planes along the inputs gives one int4 weight
`[out, 2 * in]` whose product with `[x, x]` is `x · Wᵀ` — one kernel call, 1 byte per weight
plus 4 bytes of bfloat16 (scale, zero) per plane and group: 1.25 bytes per weight against
bfloat16's 2. Nothing is rounded but the scales and zeros to bfloat16 (16d and 8d are d's
rounding times a power of two), the same loss as GGUF's 4-bit types get on their int4 route
and as a bfloat16 copy of the dequantized weight (which rounds each `d * v` instead).

Prefill (many rows) dequantizes both planes to bfloat16 and adds them, then runs one
oneDNN matmul, as `Int4Linear` does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from exo.shared.models.weight_formats import INT4_BLOCK_OUTPUTS as _BLOCK_OUTPUTS
from exo.worker.engines.torch.quant.int4_groups import Int4Linear, int4_linear_from_groups
from exo.worker.engines.torch.quant.native_kernels import (
    built_int8_block_kernel,
    native_int4_kernel,
)
from exo.worker.engines.torch.quant.quantized_linear import (
    QuantizedLinear,
    decode_kernel_takes,
    native_int8_block_max_rows,
    prefill_product,
)

# GGUF block types held as split int4 planes: bytes per block of 32 weights.
SPLIT_TYPES: dict[str, int] = {"Q8_0": 34, "Q5_0": 22, "Q5_1": 24}
BLOCK = 32


def block_values(raw: np.ndarray, gguf_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The integers, scales and offsets of GGUF blocks (`w = d * v + m`).

    Args:
        raw: uint8 `[rows, blocks * block bytes]`, each row a whole number of blocks.
        gguf_type: one of `SPLIT_TYPES`.

    Returns:
        values int16 `[rows, blocks * 32]` (in [-128, 127]), scales `d` and offsets `m`
        float32 `[rows, blocks]` (offsets 0 except for Q5_1).

    Raises:
        ValueError: another type, or a row that is not a whole number of blocks.
    """
    if gguf_type not in SPLIT_TYPES:
        raise ValueError(f"{gguf_type} blocks are not held as split int4 planes")
    size = SPLIT_TYPES[gguf_type]
    rows, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"a {gguf_type} row of {row_bytes} bytes is not whole blocks")
    blocks = raw.reshape(rows, row_bytes // size, size)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    offsets = np.zeros_like(scales)
    if gguf_type == "Q8_0":
        values = blocks[..., 2:].copy().view(np.int8).astype(np.int16)
        return values.reshape(rows, -1), scales, offsets
    if gguf_type == "Q5_1":
        offsets = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    start = 2 if gguf_type == "Q5_0" else 4
    high_bits = blocks[..., start : start + 4].copy().view("<u4")  # [rows, blocks, 1]
    nibbles = blocks[..., start + 4 : start + 20]  # [rows, blocks, 16]
    # Value j < 16: the low nibble of byte j and bit j; value 16 + j: the high nibble of
    # byte j and bit 16 + j.
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).astype(np.int16)
    bits = (high_bits >> np.arange(BLOCK, dtype=np.uint32)) & 1  # [rows, blocks, 32]
    values = low | (bits.astype(np.int16) << 4)
    if gguf_type == "Q5_0":
        values = values - 16
    return values.reshape(rows, -1), scales, offsets


def _nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 `[out, in / 2]` from int4 values `[out, in]` in [0, 15], column 2j low."""
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


class SplitInt4Linear(QuantizedLinear):
    """A GGUF Q8_0 / Q5_0 / Q5_1 weight `[out, in]` held exactly as two int4 planes (see the
    module docstring); `planes` is the `Int4Linear` over `[out, 2 * in]`. Where exo's own
    kernels run (`native_kernels`, AVX2 CPUs), the block integers are held instead as they are,
    int8 `values` `[out, in]` with bfloat16 `scale_zero` `[out, in / 32, 2]`, `w = (v - 8) *
    scale + zero` (scale d, zero 8d + m: rounded exactly as the low plane's), `native` True:
    1.125 bytes per weight, one kernel pass over each weight instead of two.

    Args:
        values: integers `[out, in]` in [-128, 127] (any integer dtype).
        scales, offsets: `[out, in / 32]` float (`w = scale * value + offset` per group).
        bias: `[out]` or None.

    Raises:
        ValueError: values outside int8, or a shape the int4 kernel cannot pack
            (`out % 64`, `in % 32`).
    """

    fused_max_rows = Int4Linear.fused_max_rows

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        out_features, in_features = values.shape
        super().__init__(in_features, out_features, bias)
        values = values.to(torch.int32)
        if values.numel() and (int(values.min()) < -128 or int(values.max()) > 127):
            raise ValueError("split int4 planes hold integers in [-128, 127]")
        scales, offsets = scales.float(), offsets.float()
        self._native = native_int4_kernel() is not None
        self.values: torch.Tensor
        self.scale_zero: torch.Tensor
        if self._native:
            if in_features % BLOCK or scales.shape != (out_features, in_features // BLOCK):
                raise ValueError(f"blocks of {BLOCK} do not fit a {tuple(values.shape)} weight")
            self.register_buffer("values", values.to(torch.int8))
            zeros = 8.0 * scales + offsets
            pairs = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16).contiguous()
            self.register_buffer("scale_zero", pairs)
            return
        low = values & 15  # two's complement: v mod 16, also for negative v
        high = (values - low) >> 4  # in [-8, 7]
        self.planes = int4_linear_from_groups(
            torch.cat([_nibbles(high + 8), _nibbles(low)], dim=1),
            torch.cat([16.0 * scales, scales], dim=1),
            torch.cat([torch.zeros_like(scales), 8.0 * scales + offsets], dim=1),
            None,
        )

    @classmethod
    def from_planes(cls, planes: Int4Linear, bias: torch.Tensor | None) -> SplitInt4Linear:
        """Wrap an `Int4Linear` that already holds a high and a low plane."""
        split = cls.__new__(cls)
        QuantizedLinear.__init__(split, planes.in_features // 2, planes.out_features, bias)
        split.planes = planes
        split._native = False
        return split

    @classmethod
    def concatenate(cls, parts: list[SplitInt4Linear]) -> SplitInt4Linear:
        """One linear whose outputs are `parts`' outputs in order (fused Q/K/V, gate/up).

        Raises:
            ValueError: the parts' input widths differ, or only some have a bias.
        """
        biases = [part.bias for part in parts]
        if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
            raise ValueError("cannot fuse linears where only some have a bias")
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        if len({part._native for part in parts}) != 1:
            raise ValueError("split linears in different layouts cannot be fused")
        if parts[0]._native:
            if len({part.in_features for part in parts}) != 1:
                raise ValueError("linears with different input widths cannot be fused")
            fused = cls.__new__(cls)
            out_features = sum(part.out_features for part in parts)
            QuantizedLinear.__init__(fused, parts[0].in_features, out_features, bias)
            fused._native = True
            fused.register_buffer("values", torch.cat([part.values for part in parts]))
            fused.register_buffer("scale_zero", torch.cat([p.scale_zero for p in parts]))
            return fused
        planes = Int4Linear.concatenate([part.planes for part in parts])
        return cls.from_planes(planes, bias)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        if self._native:
            return self._native_matmul(x)
        return self.planes._fused(torch.cat((x, x), dim=-1))

    def _native_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        kernel = built_int8_block_kernel()
        assert kernel is not None
        return kernel(rows.float().contiguous(), self.values, self.scale_zero).to(rows.dtype)

    def dequantize_float(self) -> torch.Tensor:
        """The weight as `[out, in]` float32, exact: the two planes added in float32 (or
        the held block integers times their scales plus offsets)."""
        if self._native:
            blocks = self.values.float().reshape(self.out_features, -1, BLOCK)
            pairs = self.scale_zero.float()
            offsets = pairs[..., 1:] - 8.0 * pairs[..., :1]
            weight = torch.addcmul(offsets, blocks, pairs[..., :1])
            return weight.reshape(self.out_features, self.in_features)
        planes = self.planes.dequantize_float()
        return planes[:, : self.in_features] + planes[:, self.in_features :]

    def dequantize_transposed(self) -> torch.Tensor:
        """The weight as `[in, out]` bfloat16: the integers `v` times the low plane's scale
        plus its offset (`zero - 8 * scale`), rounded once, as a bfloat16 copy of
        `d * v + m` would be. (Adding the planes' own bfloat16 dequantizations would round
        the high plane's `16 d h` before the low one is added.)

        `v + 128` is one byte, the high plane's nibble above the low plane's: in the
        packed AVX512 layout (see `Int4Linear._unpack_blocks`) both planes hold a channel's
        nibble at the same place of the same byte, so two byte operations per pair of
        bytes give the int8 values of 64 channels at once.
        """
        if self.native:
            return self.dequantize_float().to(torch.bfloat16).t()
        blocks = self.out_features // _BLOCK_OUTPUTS
        groups = self.in_features // self.planes.group_size
        packed = self.planes.packed.reshape(blocks, 2 * self.in_features, 32)
        high, low = packed[:, : self.in_features], packed[:, self.in_features :]
        # Byte b holds channel b (low nibble) and channel b + 32 (high nibble).
        first = (high << 4) | (low & 15)
        second = (high & 0xF0) | (low >> 4)
        values = (torch.cat([first, second], dim=-1) ^ 0x80).view(torch.int8)  # [blocks, in, 64]
        low_plane = self.planes.scales_and_zeros[groups:]  # [groups, out, 2] bfloat16
        scale_zero = low_plane.reshape(groups, blocks, _BLOCK_OUTPUTS, 2).permute(1, 0, 3, 2)
        # Contiguous [blocks, groups, 1, 64] operands: addcmul broadcasts them much faster.
        scales = scale_zero[:, :, 0].unsqueeze(2).contiguous()
        offsets = torch.sub(scale_zero[:, :, 1], scale_zero[:, :, 0], alpha=8.0)
        weight = torch.addcmul(
            offsets.unsqueeze(2).contiguous(),
            values.reshape(blocks, groups, self.planes.group_size, _BLOCK_OUTPUTS).to(
                torch.bfloat16
            ),
            scales,
        )
        weight = weight.reshape(blocks, self.in_features, _BLOCK_OUTPUTS).transpose(0, 1)
        return weight.reshape(self.in_features, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_transposed().t()

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize_transposed()

    @property
    def native(self) -> bool:
        """Whether exo's kernels run this weight (they take float32 rows)."""
        return self._native or self.planes.native

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self._native:  # the kernel for decode; prefill: the same sums by block_matmul
            if decode_kernel_takes(rows.shape[0], native_int8_block_max_rows()):
                return self._native_matmul(rows)
            out = prefill_product(
                rows.float().contiguous(), self.values, self.scale_zero,
                self.prefill_activations,
            )  # fmt: skip
            return out.to(rows.dtype)
        if self.planes.native:  # the planes' own rule for any row count (see Int4Linear)
            return self.planes.matmul(torch.cat((rows, rows), dim=-1))
        if not self.planes._unpack_ok:  # another packed layout: the fused kernel only
            return self._fused(rows)
        return super().matmul(rows)


class BlockPart:
    """A safetensors slice of raw GGUF blocks `[out, bytes per row]` seen as one part of
    `block_values`: the integers `[out, in]` (`part="values"`, int16), or the scales or
    offsets `[out, in / 32]` (float32). Rows are read as bytes, then columns sliced, so a
    tensor-parallel reader slices all three parts alike."""

    def __init__(self, raw: Any, gguf_type: str, part: str) -> None:
        self._raw, self._type, self._part = raw, gguf_type, part
        rows, row_bytes = raw.get_shape()
        blocks = row_bytes // SPLIT_TYPES[gguf_type]
        self._shape = [rows, blocks * BLOCK if part == "values" else blocks]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        chunk = self._raw[rows].numpy()
        values, scales, offsets = block_values(chunk, self._type)
        chosen = {"values": values, "scales": scales, "offsets": offsets}[self._part]
        return torch.from_numpy(np.ascontiguousarray(chosen))[:, columns]
