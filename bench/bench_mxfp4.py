"""One gpt-oss-20b expert (gate/up 2880 -> 2 x 2880, down 2880 -> 2880; random weights)
through `Mxfp4Linear` (MXFP4 held, `quant/mxfp4.py`) two ways: exo's kernels (up to
`NATIVE_MAX_ROWS` rows the fused one, `native/mxfp4.cpp`, the blocks read inside the
product; more rows the blocks re-expressed as int8 blocks for exo's prefill GEMM) and the
weight widened 512 output rows at a time then multiplied; against the same weights as
float32 `F.linear`: milliseconds per expert per call for 1, 4, 32, 64, 128 and 512 rows
(decode, and an expert's rows of a prompt chunk), on one thread, interleaved per run; and
the bytes each holds.

`--tiles` instead compares the fused kernel's two AVX2 register tiles at decode row counts:
the pair tile (rows of whole pairs of blocks: 2880 inputs) against the block tile (which
the kernel takes for rows with an odd last block: 2912 inputs, one block more), each on 12
gate/up weights of 5760 x inputs (more bytes than the caches hold), thread CPU seconds per
weight and the bytes per CPU second, interleaved.

Usage: python bench/bench_mxfp4.py [--threads 1] [--runs 5] [--tiles]
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


def _tiles(runs: int) -> None:
    """The pair tile against the block tile (module docstring), thread CPU time."""
    weights = 12
    shapes = {"pair tile (2880 inputs)": HIDDEN, "block tile (2912 inputs)": HIDDEN + 32}
    held = {
        name: [quantize_mxfp4(torch.randn(2 * INTERMEDIATE, inputs) * 0.02) for _ in range(weights)]
        for name, inputs in shapes.items()
    }
    os.environ[NATIVE_INT4_ENV] = "1"
    for rows in (1, 2, 4, 8):
        for round_ in range(2):
            for name, inputs in shapes.items():
                x = torch.randn(rows, inputs)
                for blocks, scales in held[name]:
                    torch.ops.exo_native.mxfp4_gemv(x, blocks, scales)
                times = []
                for _ in range(runs):
                    start = time.thread_time()
                    for blocks, scales in held[name]:
                        torch.ops.exo_native.mxfp4_gemv(x, blocks, scales)
                    times.append(time.thread_time() - start)
                seconds = statistics.median(times) / weights
                size = sum(b.numel() + s.numel() for b, s in held[name]) / weights
                print(
                    f"{rows} rows, round {round_ + 1}, {name}: {seconds * 1e3:.3f} ms CPU per "
                    f"weight, {size / seconds / 1e9:.1f} GB per CPU second"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tiles", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    if options.tiles:
        if native_int4_kernel() is None:
            raise SystemExit("exo's native kernels are not built here")
        _tiles(options.runs)
        return
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
