"""Weights held as int8 per output channel (`Int8Linear`): 1 byte a weight and one scale a
row, run by torch's `_weight_int8pack_mm` or exo's `int8_channel_gemv`."""

from __future__ import annotations

import torch
from torch import nn

from exo.worker.engines.torch.quant.native_kernels import (
    native_int4_kernel,
)
from exo.worker.engines.torch.quant.quantized_linear import (
    QuantizedLinear,
    concatenated_bias,
)

_INT8_ROWS_PER_STEP = 4096


class Int8Linear(QuantizedLinear):
    """Symmetric int8 weights with one scale per output channel. Where exo's kernels run
    (`native_kernels`, AVX2 CPUs; `native` True) every call runs exo's `int8_channel_gemv` on
    float32 rows (activations rounded to int16 blocks as its int4 kernel rounds them), faster
    than torch's int8 kernel on bfloat16 rows (figures:
    docs/benchmarks/engine-design-figures.md#int8_channelspy)."""

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
        bias = concatenated_bias(parts)
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
