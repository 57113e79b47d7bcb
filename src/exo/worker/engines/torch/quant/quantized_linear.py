"""The base of every quantized linear (`QuantizedLinear`: `nn.Linear`'s call signature over
weights held in a smaller format), the bounds on rows that pick a kernel, and the prefill
product of exo's block weights."""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from contextvars import ContextVar

import torch
from torch import nn

from exo.shared.models.weight_formats import PrefillActivations

# Rows up to which exo's bfloat16 kernel (`bf16_gemv`) runs; more rows widen the weight to
# float32 for one matmul. A chosen bound, not a measured crossover.
NATIVE_MAX_ROWS = 16

# Rows up to which exo's int4 / int8-block decode kernels run; more rows take the integer
# GEMM (`block_matmul`, native/prefill.cpp). Between the measured crossovers of an int4 and
# an int8-block weight (figures: docs/benchmarks/engine-design-figures.md#quantized_linearpy).
NATIVE_BLOCK_MAX_ROWS = 7

# The same bound for int8 blocks (symmetric, as `ScaledInt8Linear`, or with (scale, zero)
# pairs) where exo's 512-bit int8 tile runs (`native_int8_block_max_rows`): it reads each
# weight row once for 8 activation rows; on a 49,152 x 576 LM head it took about half the
# GEMM's time at 8 and 12 rows and about as long at 16
# (figures: docs/benchmarks/2026-12-05-batching-vnni.md).
NATIVE_INT8_BLOCK_MAX_ROWS_AVX512 = 15


@functools.cache
def native_int8_block_max_rows() -> int:
    """Rows up to which an int8-block weight takes exo's decode kernel rather than the
    integer GEMM: `NATIVE_INT8_BLOCK_MAX_ROWS_AVX512` where the 512-bit tiles run (the
    library built with AVX512BW and not `EXO_NATIVE_AVX512=0`: `int4_decode_bits() == 512`),
    else `NATIVE_BLOCK_MAX_ROWS`. Only called where exo's kernels are loaded."""
    if int(torch.ops.exo_native.int4_decode_bits()) == 512:
        return NATIVE_INT8_BLOCK_MAX_ROWS_AVX512
    return NATIVE_BLOCK_MAX_ROWS


# How many rows at the start of a batched step's activations are decode tokens (one per
# running request: `batch_attention.BatchPlan` puts them first; set by its `prepare`). With
# int8 prefill activations they keep int16, so a stream's tokens do not depend on prompts
# prefilled beside it.
DECODE_ROWS: ContextVar[int] = ContextVar("exo_decode_rows", default=0)

# True while a step of prompt rows only runs its decoder layers' projections
# (`direct_forward.LeanModel`): exo's block weights then take the integer GEMM whatever the
# row count. Its rows come out the same bits at any row count (8 rows or 38, tested), the
# decode kernels' ~1e-6 apart (the same block sums scaled in another order), so a prompt's
# last token computed alone after a prefix-cache hit takes the product its cold prefill's
# row took, and a chunk boundary leaving a few rows changes nothing.
PROMPT_PRODUCT: ContextVar[bool] = ContextVar("exo_prompt_product", default=False)


def decode_kernel_takes(rows: int, bound: int) -> bool:
    """Whether a block weight's call of `rows` rows runs its decode kernel: up to `bound`
    rows (the measured crossover), and not for prompt rows (`PROMPT_PRODUCT`)."""
    return rows <= bound and not PROMPT_PRODUCT.get()


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


def concatenated_bias(parts: Sequence[QuantizedLinear]) -> torch.Tensor | None:
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
