"""exo's decode kernels over more activation rows than one register tile holds, on weights
of many output rows: the kernels then run every group of rows over one span of the weight
before the next (`block_rows.h` `for_weight_spans`, so a weight is read from memory once per
call). Each row of such a product must be what the kernel computes for that row alone, on
one thread and on two, whatever the span and thread-chunk boundaries."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.int5_blocks import Int5Linear, q5_0_blocks
from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.mxfp4 import quantize_mxfp4
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel, native_int4_kernel

pytestmark = pytest.mark.skipif(
    native_int4_kernel() is None, reason="exo's native kernels cannot be built here"
)

# Output rows: several 64 KiB spans of each format's weight at these widths (an int8 row of
# 640 inputs takes 640 bytes: 96 rows a span), plus a remainder that is no multiple of 8.
OUTPUTS, INPUTS = 1_000, 640
# int4 holds outputs in multiples of 64: 1,088 (a 320-byte row, 200 rows a span).
INT4_OUTPUTS = 1_088
# More rows than a 4-row (AVX2) or 8-row (512-bit int4) tile, with a partial last group.
ROWS = (5, 9, 13)


def _weight(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(OUTPUTS, INPUTS, generator=generator) * 0.05


Product = Callable[[torch.Tensor], torch.Tensor]


def _int8_channels() -> Product:
    linear = Int8Linear(nn.Linear(INPUTS, OUTPUTS, bias=False))
    weight, scales = linear.weight, linear.scales
    return lambda x: torch.ops.exo_native.int8_channel_gemv(x, weight, scales)


def _int4_groups() -> Product:
    dense = nn.Linear(INPUTS, INT4_OUTPUTS, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.cat([_weight(1), _weight(5)])[:INT4_OUTPUTS])
    linear = Int4Linear(dense)
    assert linear.native
    kernel = built_int4_kernel()
    assert kernel is not None
    return lambda x: kernel(x, linear.packed, linear.scales_and_zeros)


def _q8_0_blocks() -> Product:
    values = torch.randint(-128, 128, (OUTPUTS, INPUTS), dtype=torch.int8)
    linear = ScaledInt8Linear(values, torch.rand(OUTPUTS, INPUTS // 32) * 0.01, None, 32)
    return lambda x: torch.ops.exo_native.int8_scaled_gemv(x, linear.values, linear.block_scales)


def _q5_0_blocks() -> Product:
    raw = quantize(_weight(3).numpy(), GGMLQuantizationType.Q5_0)
    packed, scales = q5_0_blocks(np.ascontiguousarray(raw))
    linear = Int5Linear(torch.from_numpy(packed), torch.from_numpy(scales), None)
    return lambda x: torch.ops.exo_native.int5_gemv(x, linear.int5_lanes, linear.block_scales)


def _mxfp4() -> Product:
    blocks, scales = quantize_mxfp4(_weight(4))
    return lambda x: torch.ops.exo_native.mxfp4_gemv(x, blocks, scales)


KERNELS = {
    "int8 channels": _int8_channels,
    "int4 groups": _int4_groups,
    "q8_0 blocks": _q8_0_blocks,
    "q5_0 blocks": _q5_0_blocks,
    "mxfp4": _mxfp4,
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_many_rows_over_many_spans_equal_each_row_alone(kernel: str, threads: int) -> None:
    product = KERNELS[kernel]()
    x = torch.randn(max(ROWS), INPUTS, generator=torch.Generator().manual_seed(7))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([product(x[row : row + 1].contiguous()) for row in range(len(x))])
        together = {rows: product(x[:rows].contiguous()) for rows in ROWS}
    finally:
        torch.set_num_threads(before)
    assert alone.shape[0] == max(ROWS) and alone.shape[1] in (OUTPUTS, INT4_OUTPUTS)
    # The same integer sums per row; only the 512-bit int4 tile (from 2 rows) folds its
    # scales in another order than the 256-bit one a single row takes.
    atol = 1e-5 * float(alone.abs().max())
    for rows, out in together.items():
        torch.testing.assert_close(out, alone[:rows], rtol=0, atol=atol, msg=f"{rows} rows")
