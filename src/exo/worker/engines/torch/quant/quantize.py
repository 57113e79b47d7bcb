"""Weight-only quantization of a loaded model's linear layers (CPU).

`quantize_linears` swaps every `nn.Linear` of the decoder layers and the LM head for a module
holding int8 (per output channel) or int4 (group-wise, asymmetric, as gpt-fast) weights. The
model's own code is untouched: the new modules have `nn.Linear`'s call signature.

Decode (a few rows per call) runs the fused kernels `aten._weight_int8pack_mm` and
`aten._weight_int4pack_mm_for_cpu` on bfloat16 activations: they read 1 or 1/2 byte per
weight instead of 4, and decode is memory-bandwidth bound. (The same kernels with float32
activations are several times slower than a float32 matmul, so activations are cast to
bfloat16 around each call.) Prefill (many rows) instead dequantizes the weight to bfloat16
for one oneDNN matmul, which is much faster than the row-by-row kernels there.

Measured on the 2-core reference machine (AVX512-BF16/AMX), SmolLM2-135M: see
bench/bench_engine.py and the engine's `weight_dtype` option.

On x86 CPUs with AVX2 + FMA (AVX512 ones included: measured slower there too, see
`native_kernels`), int4 linears hold exo's layout and run exo's own kernel on float32 rows
(`native_kernels`, `Int4Linear._hold`); torch's kernels remain for other CPUs.
"""

from __future__ import annotations

import abc
from contextvars import ContextVar

import torch
from torch import nn

from exo.shared.models.memory import (
    INT4_BLOCK_OUTPUTS,
    INT4_GROUP_SIZE,
    PREFILL_ACTIVATIONS,
    PrefillActivations,
    WeightFormat,
)
from exo.worker.engines.torch.comm.parallel_linears import AllReducedLinear, RowParallelLinear
from exo.worker.engines.torch.quant.native_kernels import (
    built_int4_kernel,
    native_int4_kernel,
)

# The formats the engine holds weights in; `exo.shared.models.memory` sizes each of them.
WeightDtype = WeightFormat
WEIGHT_DTYPES: tuple[WeightDtype, ...] = ("float32", "int8", "int4")

_INT4_BLOCK_N = INT4_BLOCK_OUTPUTS  # output channels per block of the AVX512 int4 layout
_INT8_ROWS_PER_STEP = 4096
# Rows up to which exo's bfloat16 kernel (`bf16_gemv`) runs; more rows widen the weight to
# float32 for one matmul. A chosen bound, not a measured crossover.
NATIVE_MAX_ROWS = 16
# Rows up to which exo's int4 / int8-block decode kernels run; more rows take the integer
# GEMM (`block_matmul`, native/prefill.cpp). Measured crossovers on a 2-core AMD EPYC (Zen 3),
# a 1536x576 int4 and a 1536x640 int8-block weight, 1 and 2 threads: 6 and 8 rows.
NATIVE_BLOCK_MAX_ROWS = 7


# How many rows at the start of a batched step's activations are decode tokens (one per
# running request: `batch_attention.BatchPlan` puts them first; set by its `prepare`). With
# int8 prefill activations they keep int16, so a stream's tokens do not depend on prompts
# prefilled beside it.
DECODE_ROWS: ContextVar[int] = ContextVar("exo_decode_rows", default=0)


def prefill_product(
    rows: torch.Tensor, held: torch.Tensor, scales: torch.Tensor, activations: PrefillActivations
) -> torch.Tensor:
    """exo's `block_matmul` (native/prefill.cpp) of float32 `[T, in]` rows: `[T, out]`
    float32, rounding the activations as `activations` says except the step's leading
    decode rows (`DECODE_ROWS`), which keep int16 (so a stream's tokens do not depend on
    the prompts prefilled beside it)."""
    decode_rows = DECODE_ROWS.get() if activations != "int16" else 0
    bits = 8 if activations == "int8" else 16
    out: torch.Tensor = torch.ops.exo_native.block_matmul(
        rows, held, scales, bits, decode_rows, activations == "bf16"
    )
    return out


class QuantizedLinear(nn.Module, abc.ABC):
    """Base: bias handling, reshaping to 2-D and the choice between fused kernel and
    dequantize-then-matmul. Subclasses provide `_fused` and `dequantize`."""

    in_features: int
    out_features: int
    # Rows (tokens) up to which a call uses the fused kernel; with more rows, dequantizing
    # the weight to bfloat16 for one oneDNN matmul is faster (measured crossovers).
    fused_max_rows = 32
    # How prefill's product (`block_matmul`) rounds the activations: "int16", "int8" where
    # the engine was loaded with int8 prefill activations (`set_prefill_activations`; taken
    # where the weight's integers fit: int4, 5-bit, int8 blocks with values in [-32, 31]
    # such as Q6_K's), or "bf16" (AMX CPUs; every block weight).
    prefill_activations: PrefillActivations = "int16"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @abc.abstractmethod
    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        """`[rows, in]` bfloat16 → `[rows, out]` bfloat16 with the quantized kernel."""

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weight as `[out, in]` bfloat16."""

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantize())

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`[rows, in]` bfloat16 → `[rows, out]` bfloat16, without the bias: the fused
        kernel up to `fused_max_rows` rows, else dequantize-then-matmul (the lean forward
        calls this directly, keeping its activations in bfloat16)."""
        if rows.shape[0] <= self.fused_max_rows:
            return self._fused(rows)
        return self._dequantized_matmul(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self, "native", False):  # exo's kernels take and give float32 rows
            rows = x.reshape(-1, self.in_features).float()
            result = self.matmul(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return result if self.bias is None else result + self.bias
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = self.matmul(rows)
        result = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            result = result + self.bias
        return result

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantizedLinear):
    """Symmetric int8 weights with one scale per output channel. Where exo's kernels run
    (`native_kernels`, AVX2 CPUs; `native` True) every call runs exo's `int8_channel_gemv` on
    float32 rows (activations rounded to int16 blocks as its int4 kernel rounds them): on
    the 2-core AMD EPYC (Zen 3) it took SmolLM2-135M's 49152x576 LM head in 1.6 ms against
    2.1 ms for torch's int8 kernel on bfloat16 rows."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        weight = linear.weight.detach()  # [out, in]
        quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        scales = torch.empty(weight.shape[0], dtype=torch.bfloat16, device=weight.device)
        # Row blocks bound the float32 temporaries (an LM head is the largest weight).
        for start in range(0, weight.shape[0], _INT8_ROWS_PER_STEP):
            rows = weight[start : start + _INT8_ROWS_PER_STEP].float()
            row_scales = (rows.abs().amax(dim=1) / 127.0).clamp(min=1e-10).to(torch.bfloat16)
            quantized[start : start + rows.shape[0]] = torch.round(
                rows / row_scales.float()[:, None]
            ).clamp(-127, 127)
            scales[start : start + rows.shape[0]] = row_scales
        self.weight: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("weight", quantized)  # [out, in] int8
        self.register_buffer("scales", scales)  # [out] bf16
        self.native = self.in_features % 32 == 0 and native_int4_kernel() is not None

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self._native_matmul(x)
        out: torch.Tensor = torch._weight_int8pack_mm(x, self.weight, self.scales)
        return out

    def _native_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """exo's kernel on `[rows, in]` (float32, or bfloat16 widened); output in the
        rows' dtype."""
        out: torch.Tensor = torch.ops.exo_native.int8_channel_gemv(
            rows.float().contiguous(), self.weight, self.scales
        )
        return out.to(rows.dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self._native_matmul(rows)
        return super().matmul(rows)

    @classmethod
    def concatenate(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One linear whose outputs are `parts`' outputs in order (a fused Q/K/V or
        gate/up projection); the weights are copied (the caller may re-point the parts).

        Raises:
            ValueError: the parts' input widths differ or only some have a bias.
        """
        bias = _concatenated_bias(parts)
        fused = cls.__new__(cls)
        QuantizedLinear.__init__(
            fused, parts[0].in_features, sum(part.out_features for part in parts), bias
        )
        fused.register_buffer("weight", torch.cat([part.weight for part in parts]))
        fused.register_buffer("scales", torch.cat([part.scales for part in parts]))
        fused.native = all(part.native for part in parts)
        return fused

    def dequantize(self) -> torch.Tensor:
        return self.weight.to(torch.bfloat16) * self.scales[:, None]


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
          (`pack_native_int4`) and `scales_and_zeros` bfloat16 `[out, groups, 2]`, for
          exo's AVX2 kernel.

        Both are row-major by output channel: a slice of rows is a slice of outputs."""
        self.packed: torch.Tensor
        self.scales_and_zeros: torch.Tensor
        self.native = native_int4_kernel() is not None
        if self.native:
            self.register_buffer("packed", pack_native_int4(quantized.to(torch.uint8)))
            self.register_buffer(
                "scales_and_zeros", scales_and_zeros.contiguous().to(torch.bfloat16)
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
        """The held (scale, zero) pairs as bfloat16 `[out, groups, 2]`, whichever layout."""
        return self.scales_and_zeros if self.native else self.scales_and_zeros.transpose(0, 1)

    def _native_values(self) -> torch.Tensor:
        """exo's layout: the int4 values as uint8 `[out, in / 32, 32]`."""
        return unpack_native_int4(self.packed).reshape(self.out_features, -1, 32)

    def dequantize_float(self) -> torch.Tensor:
        """The weight as `[out, in]` float32 (exact: `(q - 8) * scale + zero`)."""
        if not self.native:
            return self.dequantize().float()
        groups = self.in_features // self.group_size
        values = self._native_values().reshape(self.out_features, groups, self.group_size)
        scale_zero = self.scales_and_zeros.float()  # [out, groups, 2]
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
            if rows.shape[0] <= NATIVE_BLOCK_MAX_ROWS:
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
        bias = _concatenated_bias(parts)
        fused = cls.__new__(cls)
        QuantizedLinear.__init__(
            fused, parts[0].in_features, sum(part.out_features for part in parts), bias
        )
        if len({part.native for part in parts}) != 1:
            raise ValueError("int4 parts in different layouts cannot be fused")
        fused.group_size = parts[0].group_size
        fused.native = parts[0].native
        fused.register_buffer("packed", torch.cat([part.packed for part in parts]))
        fused.register_buffer(
            "scales_and_zeros",
            torch.cat([part.scales_and_zeros for part in parts], dim=0 if fused.native else 1),
        )
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


def _concatenated_bias(parts: list[Int8Linear] | list[Int4Linear]) -> torch.Tensor | None:
    """The parts' biases concatenated (None when none has one); checks the input widths.

    Raises:
        ValueError: input widths differ, or only some parts have a bias.
    """
    if len({part.in_features for part in parts}) != 1:
        raise ValueError("linears with different input widths cannot be fused")
    biases = [part.bias for part in parts]
    if all(bias is None for bias in biases):
        return None
    if any(bias is None for bias in biases):
        raise ValueError("cannot fuse linears where only some have a bias")
    return torch.cat([bias for bias in biases if bias is not None])


def int4_supported(linear: nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether `linear`'s shape fits the int4 kernel's packed layout."""
    return linear.out_features % _INT4_BLOCK_N == 0 and linear.in_features % group_size == 0


def quantize_output_layer(model: nn.Module, weight_dtype: WeightDtype) -> bool:
    """Put the model's LM head (its output embeddings) in int8 for any quantized
    `weight_dtype`: an int4 LM head flipped greedy answers of SmolLM2-135M (it no longer
    answered "Paris"), an int8 one did not. A tied head gets its own int8 copy; the input
    embedding stays float32 (one row is read per token; an int8 embedding on top of int4
    layers flipped answers too). (A head stored as GGUF Q8_0 / Q5_x blocks is held exactly
    instead: `gguf_weights.split_output_layer`.)

    Returns:
        whether a head was replaced (False for "float32" or a rank without the head).
    """
    if weight_dtype == "float32":
        return False
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    lm_head = get_output_embeddings() if callable(get_output_embeddings) else None
    if type(lm_head) is not nn.Linear:
        return False
    for name, module in model.named_modules():
        if module is lm_head:
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attribute, Int8Linear(lm_head))
            return True
    return False


def quantize_linears(model: nn.Module, weight_dtype: WeightDtype) -> int:
    """Replace the `nn.Linear` modules of `model` (a whole model, or one decoder layer as
    the loader does) in place.

    "int4" puts linears in int4 and a model's LM head in int8 (see
    `quantize_output_layer`); a linear whose shape int4 cannot pack also gets int8.

    Returns:
        the number of replaced modules.
    """
    if weight_dtype == "float32":
        return 0
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; expected one of {WEIGHT_DTYPES}")
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    lm_head = get_output_embeddings() if callable(get_output_embeddings) else None
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) in (nn.Linear, RowParallelLinear)
    ]
    for name, found in targets:
        # A tensor-parallel row slice is quantized like any linear, minus its bias, which
        # goes after the all-reduce; its int4 groups are the full weight's (K/world % 32 == 0).
        linear = found
        if type(found) is RowParallelLinear:
            linear = nn.Linear(found.in_features, found.out_features, bias=False)
            linear.weight = found.weight
        replacement: nn.Module
        if weight_dtype == "int4" and found is not lm_head and int4_supported(linear):
            replacement = Int4Linear(linear)
        else:
            replacement = Int8Linear(linear)
        if type(found) is RowParallelLinear:
            replacement = AllReducedLinear(replacement, found.bias)
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attribute, replacement)
    return len(targets)


def set_prefill_activations(model: nn.Module, activations: PrefillActivations) -> int:
    """Round prefill's activations as `activations` says ("int16" or "int8" per block of 32,
    or "bf16") in every quantized linear of `model`; the number of linears set. On AVX2
    CPUs, with int8 the block weights whose integers fit change (int4, 5-bit, int8 values in
    [-32, 31] such as Q6_K's: native/prefill_int8.cpp), with bf16 every block weight where
    the CPU has AMX-BF16 (native/prefill_bf16.cpp; elsewhere int16); a step's decode rows
    keep int16 (`DECODE_ROWS`).

    Raises:
        ValueError: an unknown `activations`.
    """
    if activations not in PREFILL_ACTIVATIONS:
        raise ValueError(
            f"prefill activations must be one of {', '.join(PREFILL_ACTIVATIONS)}, "
            f"not {activations!r}"
        )
    count = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prefill_activations = activations
            count += 1
    return count
