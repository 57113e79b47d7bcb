"""GGUF Q8_0 and Q6_K weights held as symmetric int8 blocks for exo's AVX2 kernels.

Both types are integers times one scale per small block of inputs, `w = scale * v`:
Q8_0 (ggml's `block_q8_0`) has an fp16 `d` per 32 int8 values; Q6_K (`block_q6_K`, 256
weights) has 6-bit values `q` in [0, 63] (`v = q - 32`), an int8 scale `sc` per 16 weights
and one fp16 `d`, so each block of 16 has the scale `d * sc`. `ScaledInt8Linear` holds `v`
as int8 `[out, in]` with the scales in bfloat16 `[out, in / S]` (S = 32 or 16): 1.0625 and
1.125 bytes per weight, where the other routes cost 1.125 (Q8_0 as int8 blocks with a zero:
`int4_planes`) and 2 (Q6_K as bfloat16). Nothing is rounded but the scales to bfloat16 (the
same loss as the int4 route of GGUF's 4-bit types); the integers are exact.

The engine holds Q6_K decoder linears and a Q8_0 LM head this way (`gguf_weights`; a Q8_0
decoder linear keeps the (scale, zero) blocks that fuse with Q5_0 ones). Gemma 3 270M's
Q4_K_M: its tied 262144 x 640 Q8_0 head reads 178 MB per token instead of 189, the Q6_K
`ffn_down` of nine layers 13 MB instead of 24, and both run faster for it (figures:
docs/benchmarks/engine-design-figures.md#int8_blockspy).

Decode rows run `int8_scaled_gemv` (`native/int8_blocks.cpp`); more rows the integer GEMM
(`block_matmul`, `native/prefill.cpp`), both with the activations rounded to int16 per block
of 32 as for every other block weight.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from exo.worker.engines.torch.quant.native_kernels import built_int8_scaled_kernel
from exo.worker.engines.torch.quant.quantized_linear import (
    QuantizedLinear,
    decode_kernel_takes,
    native_int8_block_max_rows,
    prefill_product,
)

# GGUF block types held as symmetric int8 blocks: (bytes per block, weights per block,
# weights per scale).
SCALED_TYPES: dict[str, tuple[int, int, int]] = {"Q8_0": (34, 32, 32), "Q6_K": (210, 256, 16)}


def scaled_block_values(raw: np.ndarray, gguf_type: str) -> tuple[np.ndarray, np.ndarray]:
    """The integers and scales of GGUF Q8_0 / Q6_K blocks (`w = scale * value`).

    Args:
        raw: uint8 `[rows, blocks * block bytes]`, each row a whole number of blocks.
        gguf_type: "Q8_0" or "Q6_K".

    Returns:
        values int8 `[rows, in]` (Q8_0 in [-128, 127], Q6_K in [-32, 31]) and scales float32
        `[rows, in / S]` (S: 32 for Q8_0, 16 for Q6_K).

    Raises:
        ValueError: another type, or a row that is not a whole number of blocks.
    """
    if gguf_type not in SCALED_TYPES:
        raise ValueError(f"{gguf_type} blocks are not held as scaled int8 blocks")
    size, _, per_scale = SCALED_TYPES[gguf_type]
    rows, row_bytes = raw.shape
    if row_bytes % size:
        raise ValueError(f"a {gguf_type} row of {row_bytes} bytes is not whole blocks")
    blocks = raw.reshape(rows, row_bytes // size, size)
    if gguf_type == "Q8_0":
        scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        values = blocks[..., 2:].copy().view(np.int8)
        return values.reshape(rows, -1), scales
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-block scales, fp16 d.
    # The integers come from gguf's own dequantizer divided by each sub-block's scale (an
    # exact integer in [-32, 31]; checked), so the bit layout is gguf's, not restated here.
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    sub_scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[..., 208:210].copy().view(np.float16).astype(np.float32)
    scales = (d * sub_scales).reshape(rows, -1)  # [rows, in / 16]
    weights = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType.Q6_K).reshape(rows, -1)
    per_weight = np.repeat(scales, per_scale, axis=1)
    nonzero = per_weight != 0
    quotient = np.divide(weights, per_weight, out=np.zeros_like(weights), where=nonzero)
    values = np.rint(quotient)
    if np.abs(quotient - values).max(initial=0.0) > 1e-3 or np.abs(values).max(initial=0) > 32:
        raise ValueError("Q6_K blocks whose weights are not integers times their scales")
    return values.astype(np.int8), scales


class ScaledInt8Linear(QuantizedLinear):
    """Symmetric int8 blocks: `w[o, i] = values[o, i] * scales[o, i // block_size]`, for
    exo's AVX2 kernels (`native` True; built only where they run).

    Args:
        values: integers `[out, in]` in [-128, 127] (any integer dtype).
        scales: `[out, in / block_size]` float (rounded to bfloat16).
        bias: `[out]` or None.
        block_size: inputs per scale, 16 or 32.

    Raises:
        ValueError: values outside int8, a block size other than 16 / 32, shapes that do
            not fit (`in % 32`, scales' width), or no exo kernels on this machine.
    """

    native = True

    def __init__(
        self,
        values: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        block_size: int,
    ) -> None:
        out_features, in_features = values.shape
        super().__init__(in_features, out_features, bias)
        if block_size not in (16, 32):
            raise ValueError(f"scaled int8 blocks hold 16 or 32 inputs per scale, not {block_size}")
        if in_features % 32 or scales.shape != (out_features, in_features // block_size):
            raise ValueError(
                f"scales {tuple(scales.shape)} do not fit a {tuple(values.shape)} weight in "
                f"blocks of {block_size}"
            )
        wide = values.to(torch.int32)
        if wide.numel() and (int(wide.min()) < -128 or int(wide.max()) > 127):
            raise ValueError("scaled int8 blocks hold integers in [-128, 127]")
        if built_int8_scaled_kernel() is None:
            raise ValueError("scaled int8 blocks need exo's native kernels")
        self.block_size = block_size
        self.values: torch.Tensor
        self.block_scales: torch.Tensor
        self.register_buffer("values", values.to(torch.int8).contiguous())
        self.register_buffer("block_scales", scales.to(torch.bfloat16).contiguous())

    @classmethod
    def _holding(
        cls,
        values: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        block_size: int,
    ) -> ScaledInt8Linear:
        """A module over tensors already in the held dtypes (no copy, no checks)."""
        held = cls.__new__(cls)
        QuantizedLinear.__init__(held, values.shape[1], values.shape[0], bias)
        held.block_size = block_size
        held.register_buffer("values", values)
        held.register_buffer("block_scales", scales)
        return held

    @classmethod
    def concatenate(cls, parts: list[ScaledInt8Linear]) -> ScaledInt8Linear:
        """One linear whose outputs are `parts`' outputs in order (fused Q/K/V, gate/up).

        Raises:
            ValueError: the parts' input widths or block sizes differ, or only some have
                a bias.
        """
        if len({(part.in_features, part.block_size) for part in parts}) != 1:
            raise ValueError("scaled int8 linears of different widths or blocks cannot be fused")
        biases = [part.bias for part in parts]
        if any(bias is None for bias in biases) and not all(bias is None for bias in biases):
            raise ValueError("cannot fuse linears where only some have a bias")
        bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
        return cls._holding(
            torch.cat([part.values for part in parts]),
            torch.cat([part.block_scales for part in parts]),
            bias,
            parts[0].block_size,
        )

    def rows(self, kept: slice, bias: torch.Tensor | None) -> ScaledInt8Linear:
        """A module holding output rows `kept` (copies), with `bias`."""
        return self._holding(
            self.values[kept].clone(), self.block_scales[kept].clone(), bias, self.block_size
        )

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`[rows, in]` → `[rows, out]` in the rows' dtype: the decode kernel up to
        `native_int8_block_max_rows()` rows, else the integer GEMM (the same block sums)."""
        x = rows.float().contiguous()
        if decode_kernel_takes(rows.shape[0], native_int8_block_max_rows()):
            out: torch.Tensor = torch.ops.exo_native.int8_scaled_gemv(
                x, self.values, self.block_scales
            )
        else:
            out = prefill_product(x, self.values, self.block_scales, self.prefill_activations)
        return out.to(rows.dtype)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def dequantize_float(self) -> torch.Tensor:
        """The weight as `[out, in]` float32, exact (held integers times held scales)."""
        scales = self.block_scales.float().repeat_interleave(self.block_size, dim=1)
        return self.values.float() * scales

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_float().to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"


class ScaledBlockPart:
    """A safetensors slice of raw GGUF Q8_0 / Q6_K blocks `[out, bytes per row]` seen as
    its integers `[out, in]` (`part="values"`, int8) or scales `[out, in / S]` (float32):
    rows are read as bytes, then columns sliced, so a tensor-parallel reader slices both
    parts alike."""

    def __init__(self, raw: Any, gguf_type: str, part: str) -> None:
        self._raw, self._type, self._part = raw, gguf_type, part
        rows, row_bytes = raw.get_shape()
        size, per_block, per_scale = SCALED_TYPES[gguf_type]
        weights = row_bytes // size * per_block
        self._shape = [rows, weights if part == "values" else weights // per_scale]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        values, scales = scaled_block_values(self._raw[rows].numpy(), self._type)
        chosen = values if self._part == "values" else scales
        return torch.from_numpy(np.ascontiguousarray(chosen))[:, columns]
