"""One gpt-oss-20b expert (gate/up 2880 -> 2 x 2880, down 2880 -> 2880; random weights)
through `Mxfp4Linear` (MXFP4 held, `quant/mxfp4.py`) two ways: exo's kernels (up to
`NATIVE_MAX_ROWS` rows the fused one, `native/mxfp4.cpp`, the blocks read inside the
product; more rows the blocks re-expressed as int8 blocks for exo's prefill GEMM) and the
weight widened 512 output rows at a time then multiplied; against the same weights as
float32 `F.linear`: milliseconds per expert per call for 1, 4, 32, 64, 128 and 512 rows
(decode, and an expert's rows of a prompt chunk), on one thread, interleaved per run; and
the bytes each holds.

Usage: python bench/bench_mxfp4.py [--threads 1] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from exo.worker.engines.torch.quant.mxfp4 import Mxfp4Linear, quantize_mxfp4
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV, native_int4_kernel

HIDDEN = INTERMEDIATE = 2880  # gpt-oss-20b's config.json


def _mxfp4_linear(inputs: int, outputs: int) -> tuple[Mxfp4Linear, torch.Tensor]:
    weight = torch.randn(outputs, inputs) * 0.02
    linear = Mxfp4Linear(inputs, outputs, bias=False, device="cpu")
    blocks, scales = quantize_mxfp4(weight)
    linear.blocks.data, linear.scales.data = blocks, scales
    return linear, linear.dequantize()


def _milliseconds(function: object, runs: int, native: bool) -> float:
    """Median milliseconds of `function` with exo's fused kernel on or off."""
    assert callable(function)
    os.environ[NATIVE_INT4_ENV] = "1" if native else "0"
    try:
        function()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
    finally:
        os.environ.pop(NATIVE_INT4_ENV, None)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    gate_up, gate_up_float = _mxfp4_linear(HIDDEN, 2 * INTERMEDIATE)
    down, down_float = _mxfp4_linear(INTERMEDIATE, HIDDEN)
    fused = native_int4_kernel() is not None
    state = "built" if fused else "not available here"
    print(f"fused kernel: {state}; {options.threads} thread(s)")
    for rows in (1, 4, 32, 64, 128, 512):
        x = torch.randn(rows, HIDDEN)

        def expert(x: torch.Tensor = x) -> torch.Tensor:
            return down(gate_up(x)[:, :INTERMEDIATE])

        def dense(x: torch.Tensor = x) -> torch.Tensor:
            return F.linear(F.linear(x, gate_up_float)[:, :INTERMEDIATE], down_float)

        native = _milliseconds(expert, options.runs, True) if fused else float("nan")
        widened = _milliseconds(expert, options.runs, False)
        float32 = _milliseconds(dense, options.runs, False)
        print(
            f"{rows:3d} rows: MXFP4 exo kernels {native:7.2f} ms, MXFP4 widened {widened:7.2f} ms, "
            f"float32 {float32:7.2f} ms per expert"
        )
    mxfp4_bytes = sum(p.numel() for p in (*gate_up.parameters(), *down.parameters()))
    float_bytes = 4 * (gate_up_float.numel() + down_float.numel())
    print(f"bytes per expert: MXFP4 {mxfp4_bytes}, float32 {float_bytes}")


if __name__ == "__main__":
    main()
