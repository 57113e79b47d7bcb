"""Weights held as int4 groups of 32 inputs with a (scale, zero) pair each (`Int4Linear`, as
gpt-fast), in torch's packed layout or exo's (`pack_native_int4`), and built straight from
given groups (GGUF's 4-bit blocks) without a float weight."""

from __future__ import annotations

import torch
from torch import nn

from exo.shared.models.weight_formats import INT4_BLOCK_OUTPUTS, INT4_GROUP_SIZE
from exo.worker.engines.torch.quant.native_kernels import (
    built_int4_kernel,
    native_int4_kernel,
)
from exo.worker.engines.torch.quant.q4k_scales import (
    compact_scales_held,
    is_q4k_scales,
    q4k_scale_pairs,
)
from exo.worker.engines.torch.quant.quantized_linear import (
    NATIVE_BLOCK_MAX_ROWS,
    QuantizedLinear,
    concatenated_bias,
    decode_kernel_takes,
    prefill_product,
)

_INT4_BLOCK_N = INT4_BLOCK_OUTPUTS  # output channels per block of the AVX512 int4 layout


class Int4Linear(QuantizedLinear):
    """Asymmetric int4 weights, one (scale, zero) per `group_size` inputs of each output
    channel: `w = (q - 8) * scale + zero`, q in [0, 15]."""

    fused_max_rows = 64

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        if not int4_supported(linear, group_size):
            raise ValueError(
                f"int4 needs out_features % {_INT4_BLOCK_N} == 0 and in_features % "
                f"{group_size} == 0; got {linear.out_features}x{linear.in_features}"
            )
        self.group_size = group_size
        out_features, in_features = linear.out_features, linear.in_features
        groups = in_features // group_size
        weight = linear.weight.detach().float().reshape(out_features, groups, group_size)
        low = weight.amin(dim=-1, keepdim=True)
        high = weight.amax(dim=-1, keepdim=True)
        scales = ((high - low) / 15.0).clamp(min=1e-10)  # [out, groups, 1]
        # In place after the first subtraction: one float32 scratch copy of the weight.
        levels = weight.sub(low).div_(scales).round_().clamp_(0, 15)
        quantized = levels.to(torch.int32).reshape(out_features, in_features)
        del levels
        zeros = low + 8.0 * scales
        self._hold(quantized, torch.cat([scales, zeros], dim=-1))

    def _hold(self, quantized: torch.Tensor, scales_and_zeros: torch.Tensor) -> None:
        """Pack int4 values `quantized` (int32 `[out, in]`, 0..15) and hold them with their
        `scales_and_zeros` (`[out, groups, 2]`), in one of two layouts:

        - torch's (`native` False): `packed` from `aten._convert_weight_to_int4pack_for_cpu`
          (its layout depends on the CPU capability torch dispatches to) and
          `scales_and_zeros` bfloat16 `[groups, out, 2]`, for `aten._weight_int4pack_mm_for_cpu`;
        - exo's (`native` True, where `native_kernels.native_int4_kernel()` is available):
          `packed` uint8 `[out, in / 2]` by pairs of blocks of 32 inputs
          (`pack_native_int4`) and `scales_and_zeros` bfloat16 `[out, groups, 2]`, or
          with `EXO_Q4K_COMPACT=1` compact Q4_K scales uint8 `[out, in / 256, 20]` as
          given (`q4k_scales`: 0.625 bits per weight instead of 1, read unrounded by the
          decode kernel; by default expanded to the pairs), for exo's AVX2 kernel.

        Both are row-major by output channel: a slice of rows is a slice of outputs."""
        self.packed: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        self.native = native_int4_kernel() is not None
        if is_q4k_scales(scales_and_zeros) and not (self.native and compact_scales_held()):
            scales_and_zeros = q4k_scale_pairs(scales_and_zeros)
        if self.native:
            self.register_buffer("packed", pack_native_int4(quantized.to(torch.uint8)))
            held = scales_and_zeros.contiguous()
            self.register_buffer(
                "scales_and_zeros", held if is_q4k_scales(held) else held.to(torch.bfloat16)
            )
            self._unpack_ok = False
            return
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(quantized, 1)
        )
        self.register_buffer(
            "scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)
        )  # [groups, out, 2]
        # The packed layout depends on the CPU capability torch dispatches to; prefill's
        # dequantization reads the AVX512 layout, so check it here and otherwise fall back
        # to the fused kernel for every call.
        self._unpack_ok = torch.equal(self._unpack(), quantized)

    def _unpack_blocks(self) -> torch.Tensor:
        """The int4 values (0..15) as `[out / 64, in, 64]` uint8, from the AVX512 packed
        layout: per block of 64 output channels `[in, 32]` bytes, byte d < 16 holding
        channels d (low nibble) and d + 32 (high), byte 16 + d channels 16 + d and 48 + d."""
        blocks = self.out_features // _INT4_BLOCK_N
        if self.packed.numel() * 2 != self.out_features * self.in_features:
            return torch.empty(0, dtype=torch.uint8)
        packed = self.packed.reshape(blocks, self.in_features, 2, 16)
        nibbles = torch.stack([packed & 15, packed >> 4], dim=2)  # [blocks, in, 2, 2, 16]
        return nibbles.reshape(blocks, self.in_features, _INT4_BLOCK_N)

    def _unpack(self) -> torch.Tensor:
        """The int4 values `[out, in]` (0..15) as int32."""
        if self.native:
            return (
                self._native_values().reshape(self.out_features, self.in_features).to(torch.int32)
            )
        values = self._unpack_blocks()
        if values.numel() == 0:
            return values
        values = values.transpose(1, 2).reshape(self.out_features, self.in_features)
        return values.to(torch.int32)

    def scale_zero_by_output(self) -> torch.Tensor:
        """The held (scale, zero) pairs as bfloat16 `[out, groups, 2]`, whichever layout
        (compact Q4_K scales expanded: a new tensor)."""
        if not self.native:
            return self.scales_and_zeros.transpose(0, 1)
        if is_q4k_scales(self.scales_and_zeros):
            return q4k_scale_pairs(self.scales_and_zeros)
        return self.scales_and_zeros

    def _native_values(self) -> torch.Tensor:
        """exo's layout: the int4 values as uint8 `[out, in / 32, 32]`."""
        return unpack_native_int4(self.packed).reshape(self.out_features, -1, 32)

    def dequantize_float(self) -> torch.Tensor:
        """The weight as `[out, in]` float32 (exact: `(q - 8) * scale + zero`)."""
        if not self.native:
            return self.dequantize().float()
        groups = self.in_features // self.group_size
        values = self._native_values().reshape(self.out_features, groups, self.group_size)
        scale_zero = self.scale_zero_by_output().float()  # [out, groups, 2]
        offsets = scale_zero[..., 1:] - 8.0 * scale_zero[..., :1]
        weight = torch.addcmul(offsets, values.float(), scale_zero[..., :1])
        return weight.reshape(self.out_features, self.in_features)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self._native_matmul(x)
        out: torch.Tensor = torch._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )
        return out

    def _native_product_by_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel's product for many rows (prefill) by exo's `block_matmul`
        (`native/prefill.cpp`: an integer GEMM on AVX2 CPUs): the weight times the
        activations rounded as the kernel rounds them, the same integer sums per block as
        the kernel's, scaled in another order, so a token's result does not depend on how
        many rows share its call (a pipeline rank and a single process chunk prompts
        differently; with int8 prefill activations, only among prefill's rows; with bf16,
        only among prefill's rows too, a short chunk beside decode rows taking int16)."""
        return prefill_product(
            rows.contiguous(), self.packed, self.scales_and_zeros, self.prefill_activations
        )

    def _native_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """exo's kernel on `[rows, in]` (float32, or bfloat16 widened); output in the
        rows' dtype."""
        kernel = built_int4_kernel()
        assert kernel is not None
        out = kernel(rows.float().contiguous(), self.packed, self.scales_and_zeros)
        return out.to(rows.dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`[rows, in]` → `[rows, out]` in the rows' dtype (bfloat16 for torch's layout;
        exo's also takes float32, with no cast around its kernel)."""
        if self.native:
            if decode_kernel_takes(rows.shape[0], NATIVE_BLOCK_MAX_ROWS):
                return self._native_matmul(rows)
            return self._native_product_by_matmul(rows.float()).to(rows.dtype)
        if not self._unpack_ok:
            return self._fused(rows)
        return super().matmul(rows)

    @classmethod
    def concatenate(cls, parts: list[Int4Linear]) -> Int4Linear:
        """One linear whose outputs are `parts`' outputs in order. The packed layout is
        blocked by 64 output channels along its first dimension and every part's output
        count is a multiple of 64, so the packed tensors concatenate along it as they are
        (and `scales_and_zeros` `[groups, out, 2]` along outputs).

        Raises:
            ValueError: the parts' input widths or group sizes differ, or only some have
                a bias.
        """
        if len({part.group_size for part in parts}) != 1:
            raise ValueError("int4 parts with different group sizes cannot be fused")
        bias = concatenated_bias(parts)
        fused = cls.__new__(cls)
        QuantizedLinear.__init__(
            fused, parts[0].in_features, sum(part.out_features for part in parts), bias
        )
        if len({part.native for part in parts}) != 1:
            raise ValueError("int4 parts in different layouts cannot be fused")
        fused.group_size = parts[0].group_size
        fused.native = parts[0].native
        fused.register_buffer("packed", torch.cat([part.packed for part in parts]))
        held = [part.scales_and_zeros for part in parts]
        if len({is_q4k_scales(scales) for scales in held}) != 1:
            # Compact Q4_K scales beside pairs (a Q4_K gate beside a Q4_0 up): all as pairs.
            held = [part.scale_zero_by_output() for part in parts]
        fused.register_buffer("scales_and_zeros", torch.cat(held, dim=0 if fused.native else 1))
        fused._unpack_ok = all(part._unpack_ok for part in parts)
        return fused

    def dequantize_transposed(self) -> torch.Tensor:
        """The weight as `[in, out]` bfloat16 (the layout the packed blocks unpack to)."""
        if self.native:
            return self.dequantize_float().to(torch.bfloat16).t()
        blocks = self.out_features // _INT4_BLOCK_N
        groups = self.in_features // self.group_size
        # Broadcasting (scale, zero) over a middle dimension with 64 contiguous channels
        # inside is several times faster than over a trailing group dimension.
        scale_zero = self.scales_and_zeros.float().reshape(groups, blocks, _INT4_BLOCK_N, 2)
        scale_zero = scale_zero.permute(1, 0, 3, 2).unsqueeze(3)  # [blocks, groups, 2, 1, 64]
        scales = scale_zero[:, :, 0].to(torch.bfloat16)
        offsets = (scale_zero[:, :, 1] - 8.0 * scale_zero[:, :, 0]).to(torch.bfloat16)
        values = self._unpack_blocks().reshape(blocks, groups, self.group_size, _INT4_BLOCK_N)
        weight = torch.addcmul(offsets, values.to(torch.bfloat16), scales)
        weight = weight.reshape(blocks, self.in_features, _INT4_BLOCK_N).transpose(0, 1)
        return weight.reshape(self.in_features, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_transposed().t()

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dequantize_transposed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native or self._unpack_ok:
            return super().forward(x)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        result = self._fused(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return result if self.bias is None else result + self.bias


def pack_native_int4(values: torch.Tensor) -> torch.Tensor:
    """int4 values (uint8 `[out, in]`, 0..15, `in % 32 == 0`) in exo's kernel layout
    (`native/int4_gemv.cpp`): per 64 inputs, 16 little-endian 16-bit lanes, lane i holding
    inputs i, 16 + i, 32 + i, 48 + i in its nibbles from the lowest; as bytes, byte 2i holds
    inputs i (low nibble) and 16 + i, byte 2i + 1 inputs 32 + i and 48 + i. An odd last
    block of 32 is 16 bytes, byte j holding inputs j and 16 + j.

    Returns:
        uint8 `[out, in / 2]`.
    """
    out_features, in_features = values.shape
    blocks = values.reshape(out_features, in_features // 32, 2, 16)
    gguf_order = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [out, blocks, 16]
    paired = in_features // 64
    lanes = gguf_order[:, : 2 * paired].reshape(out_features, paired, 2, 16).transpose(2, 3)
    tail = gguf_order[:, 2 * paired :]
    return torch.cat([lanes.reshape(out_features, -1), tail.reshape(out_features, -1)], dim=1)


def unpack_native_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int4 values of `pack_native_int4`'s layout: uint8 `[out, in / 2]` →
    `[out, in]`."""
    out_features, half = packed.shape
    paired = half // 32
    lanes = packed[:, : 32 * paired].reshape(out_features, paired, 16, 2).transpose(2, 3)
    gguf_order = torch.cat(
        [
            lanes.reshape(out_features, -1, 16),
            packed[:, 32 * paired :].reshape(out_features, -1, 16),
        ],
        dim=1,
    )  # [out, blocks, 16]
    return torch.cat([gguf_order & 15, gguf_order >> 4], dim=-1).reshape(out_features, -1)


def int4_linear_from_groups(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None
) -> Int4Linear:
    """An `Int4Linear` holding given int4 groups, with no float weight ever made.

    Args:
        packed: uint8 `[out, in / 2]`, column 2j in the low nibble, 2j + 1 in the high one.
        scales, zeros: `[out, in / group]` (any float dtype; held as bfloat16);
            `w = (q - 8) * scale + zero`.
        bias: `[out]` or None.

    Raises:
        ValueError: shapes that disagree or that the int4 kernel cannot pack
            (`out % 64`, `in % group`).
    """
    out_features, half = packed.shape
    in_features = 2 * half
    if scales.shape != zeros.shape or scales.shape[0] != out_features or not scales.shape[1]:
        raise ValueError(
            f"int4 groups disagree: packed {tuple(packed.shape)}, scales "
            f"{tuple(scales.shape)}, zeros {tuple(zeros.shape)}"
        )
    group_size = in_features // scales.shape[1]
    shape_probe = nn.Linear(in_features, out_features, bias=False, device="meta")
    if group_size * scales.shape[1] != in_features or not int4_supported(shape_probe, group_size):
        raise ValueError(
            f"int4 cannot pack a {out_features}x{in_features} weight in groups of {group_size}"
        )
    values = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(out_features, in_features)
    quantized = values.to(torch.int32)
    module = Int4Linear.__new__(Int4Linear)
    QuantizedLinear.__init__(module, in_features, out_features, bias)
    module.group_size = group_size
    module._hold(quantized, torch.stack([scales, zeros], dim=-1))
    return module


def int4_linear_from_q4k(
    packed: torch.Tensor, compact: torch.Tensor, bias: torch.Tensor | None
) -> Int4Linear:
    """An `Int4Linear` holding a GGUF Q4_K weight's int4 values and its compact scales
    (`q4k_scales`; held as they are by exo's kernels, expanded to pairs for torch's).

    Args:
        packed: uint8 `[out, in / 2]`, column 2j in the low nibble, 2j + 1 in the high one.
        compact: uint8 `[out, in / 256, 20]`.
        bias: `[out]` or None.

    Raises:
        ValueError: shapes that disagree or that the int4 kernel cannot pack (`out % 64`).
    """
    out_features, half = packed.shape
    if (
        not is_q4k_scales(compact)
        or compact.shape[0] != out_features
        or (compact.shape[1] * 128 != half)
    ):
        raise ValueError(
            f"Q4_K scales disagree: packed {tuple(packed.shape)}, compact {tuple(compact.shape)}"
        )
    shape_probe = nn.Linear(2 * half, out_features, bias=False, device="meta")
    if not int4_supported(shape_probe, INT4_GROUP_SIZE):
        raise ValueError(f"int4 cannot pack a {out_features}x{2 * half} weight")
    values = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(out_features, 2 * half)
    module = Int4Linear.__new__(Int4Linear)
    QuantizedLinear.__init__(module, 2 * half, out_features, bias)
    module.group_size = INT4_GROUP_SIZE
    module._hold(values.to(torch.int32), compact)
    return module


def int4_supported(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether `linear`'s shape fits the int4 kernel's packed layout."""
    return linear.out_features % _INT4_BLOCK_N == 0 and linear.in_features % group_size == 0
