"""MXFP4 weights held as stored (gpt-oss's experts: `quantization_config.quant_method =
"mxfp4"`), one `Mxfp4Linear` per expert linear.

The format (OCP Microscaling, MX v1.0): each run of 32 consecutive inputs of an output row
shares one power-of-two scale (e8m0: the byte `s` means `2 ** (s - 127)`), each value is a
4-bit E2M1 float (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}); two values per byte, the even-indexed one
in the low nibble (the layout of gpt-oss checkpoints and of transformers' `integrations/
mxfp4.py`). Blocks `[out, in / 32, 16]` uint8, scales `[out, in / 32]` uint8: 4.25 bits per
weight.

`mxfp4_linear` multiplies rows by such a weight without a float copy of it: up to
`NATIVE_MAX_ROWS` rows (decode, and the few rows an expert gets in a prompt chunk) by exo's
fused kernel (`native/mxfp4.cpp`: the blocks read inside the product, activations rounded
to int16 per block of 32 as exo's int4/int8 kernels do, so within ~1e-5 relative of the
exact product), more rows (an expert's share of a prompt chunk) by exo's prefill GEMM on
the blocks re-expressed exactly as int8 blocks (`mxfp4_int8_blocks`, a table gather per
call; the same rounding of the activations), and where exo's kernels do not run by
widening the weight 512 output rows at a time (one byte-pair table gather and one scale
product, then a dense matmul of those rows; exact). Only routed experts run, so a step
reads the MXFP4 bytes of its routed experts only. Figures:
docs/benchmarks/2026-12-04-gpt-oss-mxfp4.md. Every MXFP4 value is exact in bfloat16 and
float32, so a widened weight equals the checkpoint's dequantized weight bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel
from exo.worker.engines.torch.quant.quantized_linear import prefill_product

BLOCK = 32  # inputs sharing one scale
SCALE_BIAS = 127  # e8m0's exponent bias
# The 16 E2M1 values by 4-bit code (sign bit 3, then exponent and mantissa).
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
_FP4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
# Byte -> its two values (low nibble first) as two bfloat16 bit patterns in one int32 (the
# low half first on little-endian machines), so one int32 gather widens a byte.
_BYTE_PAIRS = torch.stack([_FP4[torch.arange(256) & 0x0F], _FP4[torch.arange(256) >> 4]], dim=1)
_BYTE_PAIR_BITS = _BYTE_PAIRS.to(torch.bfloat16).contiguous().view(torch.int32).flatten()
# Byte -> its two values doubled (low nibble first) as two int8 in one int16: 2 x E2M1 is an
# integer in [-12, 12], so a block of 32 is exactly 32 int8 times `2 ** (s - 128)`.
_BYTE_PAIR_INT8 = (2 * _BYTE_PAIRS).to(torch.int8).contiguous().view(torch.int16).flatten()
# Output rows widened at a time in `mxfp4_linear`: the widened rows stay in cache between
# their widening and their matmul (8x faster than widening a 5760 x 2880 expert at once on
# this machine's CPU; figures: docs/benchmarks/2026-12-04-gpt-oss-mxfp4.md).
WIDEN_ROWS = 512
# Rows up to which the fused kernel runs: it reads the blocks once per 4 rows and does the
# products in integers, so its time grows with the rows, while widening costs a fixed
# ~100 ms per gpt-oss-20b expert before matmuls that are cheap per row: the fused kernel
# was faster at 32 rows, slower at 64 (docs/benchmarks/2026-12-04-gpt-oss-mxfp4.md). More
# rows take the int8-block GEMM (1.6-1.9x the widened path at 64-128 rows, even at 512:
# docs/benchmarks/2026-12-05-moe-gpt-oss-20b-shapes.md).
NATIVE_MAX_ROWS = 32


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 blocks `[..., groups, 16]` uint8 and scales `[..., groups]` uint8 → the
    weight `[..., groups * 32]` in `dtype` (exact in float32 and bfloat16: an E2M1 value
    times a power of two is a bfloat16)."""
    table = _BYTE_PAIR_BITS.to(blocks.device)
    bits = table.index_select(0, blocks.reshape(-1).to(torch.int32))
    values = bits.view(torch.bfloat16).view(*scales.shape, BLOCK)
    scale = torch.exp2(scales.float() - SCALE_BIAS).to(torch.bfloat16)
    widened = values * scale.unsqueeze(-1)  # [..., groups, 32]
    return widened.flatten(-2).to(dtype)


def mxfp4_linear(rows: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`rows` `[T, in]` times an MXFP4 weight (`blocks` `[out, in / 32, 16]`, `scales`
    `[out, in / 32]`) transposed: `[T, out]` in the rows' dtype. exo's fused kernel for
    float32 rows up to `NATIVE_MAX_ROWS` where it runs (`native_int4_kernel`), else
    widening `WIDEN_ROWS` output rows of the weight at a time (no whole float copy of the
    weight). A MoE block's experts make the same choices in one native call
    (`native/moe_mxfp4_experts.cpp`, bit for bit this function's products): change both
    together (test_moe_mxfp4_native.py checks them equal)."""
    if rows.device.type == "cpu" and native_int4_kernel() is not None:
        if rows.dtype == torch.float32 and rows.shape[0] <= NATIVE_MAX_ROWS:
            product: torch.Tensor = torch.ops.exo_native.mxfp4_gemv(
                rows.contiguous(), blocks.contiguous(), scales.contiguous()
            )
            return product
        values, block_scales = mxfp4_int8_blocks(blocks, scales)
        product = prefill_product(rows.float().contiguous(), values, block_scales, "int16")
        return product.to(rows.dtype)
    total = blocks.shape[0]
    out = rows.new_empty(rows.shape[0], total)
    for start in range(0, total, WIDEN_ROWS):
        end = min(total, start + WIDEN_ROWS)
        weight = dequantize_mxfp4(blocks[start:end], scales[start:end], rows.dtype)
        out[:, start:end] = F.linear(rows, weight)
    return out


def mxfp4_int8_blocks(
    blocks: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks `[out, in / 32, 16]` and scales `[out, in / 32]` (uint8) as symmetric
    int8 blocks of 32 (`ScaledInt8Linear`'s layout): values `[out, in]` int8, each E2M1
    value doubled (integers in [-12, 12]), and scales `[out, in / 32]` bfloat16 `2 ** (s -
    128)` (a power of two, exact in bfloat16 down to its subnormals). Exact: values times
    scales are the MXFP4 weight bit for bit. One table gather per byte; the int8 copy takes
    twice the MXFP4 bytes."""
    table = _BYTE_PAIR_INT8.to(blocks.device)
    pairs = table.index_select(0, blocks.reshape(-1).to(torch.int32))
    values = pairs.view(torch.int8).view(blocks.shape[0], -1)
    block_scales = torch.exp2(scales.float() - (SCALE_BIAS + 1)).to(torch.bfloat16)
    return values, block_scales.contiguous()


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight `[..., in]` (`in` a multiple of 32) as MXFP4 blocks `[..., in / 32,
    16]` uint8 and scales `[..., in / 32]` uint8: each group's scale is `2 ** (floor(log2(
    amax)) - 2)` (E2M1's largest exponent is 2, as the OCP MX v1.0 spec chooses it), each
    value rounded to the nearest E2M1 value of `value / scale` (saturating at ±6).

    Raises:
        ValueError: the last dimension is not a multiple of 32.
    """
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs inputs in multiples of {BLOCK}, not {weight.shape[-1]}")
    groups = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))), 0.0) - 2
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - _FP4.to(weight.device)).abs().argmin(dim=-1)  # nearest
    codes = codes.to(torch.uint8).reshape(*groups.shape[:-1], BLOCK // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


class Mxfp4Linear(nn.Module):
    """A linear whose weight is held as MXFP4 (`blocks` `[out, in / 32, 16]`, `scales`
    `[out, in / 32]`, uint8 parameters filled by the loader by name) with an optional
    float32 `bias` `[out]`; `nn.Linear`'s call signature, widening the weight per call."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, device: str = "meta"
    ) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"MXFP4 needs inputs in multiples of {BLOCK}, not {in_features}")
        self.in_features = in_features
        self.out_features = out_features
        groups = in_features // BLOCK
        self.blocks = nn.Parameter(
            torch.empty(out_features, groups, BLOCK // 2, dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        self.scales = nn.Parameter(
            torch.empty(out_features, groups, dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight `[out, in]` in `dtype` (exact)."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = mxfp4_linear(rows, self.blocks, self.scales)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mxfp4"


class Mxfp4Projection:
    """The lean forward's view of MXFP4 linears reading the same rows (an expert's gate
    and up, or its down): their widened weights concatenated per call, one matmul, float32
    rows in and out (the duck type of `direct_forward_parts.Projection` that `LeanExpert`
    uses)."""

    __slots__ = ("bias", "modules", "out_features")

    in_dtype = torch.float32
    reduce = False

    def __init__(self, modules: list[Mxfp4Linear]) -> None:
        self.modules = modules
        self.out_features = sum(module.out_features for module in modules)
        biases = [module.bias for module in modules]
        self.bias = (
            None
            if any(bias is None for bias in biases)
            else torch.cat([bias.detach().float() for bias in biases if bias is not None])
        )

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.float()
        parts = [mxfp4_linear(rows, module.blocks, module.scales) for module in self.modules]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out if self.bias is None else out + self.bias
