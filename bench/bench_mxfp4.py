"""One gpt-oss-20b expert (gate/up 2880 -> 2 x 2880, down 2880 -> 2880; random weights)
through `Mxfp4Linear` (MXFP4 held, widened per call, `quant/mxfp4.py`) against the same
weights as float32 `F.linear`: milliseconds per expert per call for 1 row (decode) and
32 rows, on one thread, and the bytes each holds.

Usage: python bench/bench_mxfp4.py [--threads 1] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from exo.worker.engines.torch.quant.mxfp4 import Mxfp4Linear, quantize_mxfp4

HIDDEN = INTERMEDIATE = 2880  # gpt-oss-20b's config.json


def _mxfp4_linear(inputs: int, outputs: int) -> tuple[Mxfp4Linear, torch.Tensor]:
    weight = torch.randn(outputs, inputs) * 0.02
    linear = Mxfp4Linear(inputs, outputs, bias=False, device="cpu")
    blocks, scales = quantize_mxfp4(weight)
    linear.blocks.data, linear.scales.data = blocks, scales
    return linear, linear.dequantize()


def _milliseconds(function: object, runs: int) -> float:
    assert callable(function)
    function()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    gate_up, gate_up_float = _mxfp4_linear(HIDDEN, 2 * INTERMEDIATE)
    down, down_float = _mxfp4_linear(INTERMEDIATE, HIDDEN)
    for rows in (1, 32):
        x = torch.randn(rows, HIDDEN)
        held = _milliseconds(lambda x=x: down(gate_up(x)[:, :INTERMEDIATE]), options.runs)
        dense = _milliseconds(
            lambda x=x: F.linear(F.linear(x, gate_up_float)[:, :INTERMEDIATE], down_float),
            options.runs,
        )
        print(f"{rows:3d} rows: MXFP4 {held:7.2f} ms, float32 {dense:7.2f} ms per expert")
    mxfp4_bytes = sum(p.numel() for p in (*gate_up.parameters(), *down.parameters()))
    float_bytes = 4 * (gate_up_float.numel() + down_float.numel())
    print(f"bytes per expert: MXFP4 {mxfp4_bytes}, float32 {float_bytes}")


if __name__ == "__main__":
    main()
