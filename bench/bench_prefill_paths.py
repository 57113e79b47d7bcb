"""Prefill's block-weight products on this CPU, interleaved call by call in one process:
`block_matmul` with the activations rounded to int16 (exact integer sums), to int8, and to
bfloat16 (the AMX-BF16 product, where the CPU and build have it; calls of fewer rows than
its minimum, 32, take int16), on a model's layer shapes (random int4 weights in groups of
32, random float32 activations).

Usage: PYTHONPATH=src python bench/bench_prefill_paths.py [--rows 32 128 512]
       [--threads 2] [--calls 30] [--shapes gemma3-270m|smollm2-135m]

Prints GMAC/s (multiply-adds of the product / the call's time) per rounding, the median over
`--calls` calls and the min-max, for each shape and row count, then the four products' time
one after another (a layer's) per rounding, and each rounding's error: the RMS of its
difference from the exact (float64) product over the exact product's RMS.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

SHAPES = {
    # (inputs, outputs) of the fused q/k/v, o, fused gate/up and down products
    "gemma3-270m": [(640, 1536), (1024, 640), (640, 4096), (2048, 640)],
    "smollm2-135m": [(576, 960), (576, 576), (576, 3072), (1536, 576)],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="gemma3-270m")
    arguments = parser.parse_args()
    import torch

    from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
    from exo.worker.engines.torch.quant.native_kernels import (
        bf16_prefill_available,
        built_int4_kernel,
    )

    if built_int4_kernel() is None:
        print("exo's native kernels are not available here", file=sys.stderr)
        return 1
    torch.set_num_threads(arguments.threads)
    matmul = torch.ops.exo_native.block_matmul
    paths: dict[str, Callable[..., torch.Tensor]] = {
        "int16": lambda x, w, s: matmul(x, w, s, 16),
        "int8": lambda x, w, s: matmul(x, w, s, 8),
    }
    if bf16_prefill_available():
        paths["bf16"] = lambda x, w, s: matmul(x, w, s, 16, 0, True)
    else:
        print("no bf16 product here (it needs AMX-BF16)")
    generator = torch.Generator().manual_seed(0)
    print(f"{arguments.threads} threads, {arguments.calls} calls, paths: {', '.join(paths)}")
    for rows in arguments.rows:
        layer = {name: 0.0 for name in paths}
        for inputs, outputs in SHAPES[arguments.shapes]:
            values = torch.randint(0, 16, (outputs, inputs), generator=generator)
            held = pack_native_int4(values.to(torch.uint8))
            pairs = (torch.randn(outputs, inputs // 32, 2, generator=generator) * 0.02).to(
                torch.bfloat16
            )
            x = torch.randn(rows, inputs, generator=generator)
            weight = (values.double().reshape(outputs, -1, 32) - 8) * pairs[..., :1].double()
            weight = (weight + pairs[..., 1:].double()).reshape(outputs, inputs)
            exact = x.double() @ weight.t()
            products = {name: path(x, held, pairs) for name, path in paths.items()}
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(arguments.calls):
                for name, path in paths.items():
                    started = time.perf_counter()
                    path(x, held, pairs)
                    times[name].append(time.perf_counter() - started)
            macs = rows * inputs * outputs / 1e9
            cells = []
            for name in paths:
                median = statistics.median(times[name])
                layer[name] += median
                cells.append(
                    f"{name} {macs / median:5.0f} ({macs / max(times[name]):.0f}-"
                    f"{macs / min(times[name]):.0f})"
                )
            scale = float(exact.pow(2).mean().sqrt())
            difference = "  rms error / rms y: " + " ".join(
                f"{name} {float((product - exact).pow(2).mean().sqrt()) / scale:.1e}"
                for name, product in products.items()
            )
            print(f"rows {rows:4d} {inputs:5d}->{outputs:5d} GMAC/s: " + "  ".join(cells)
                  + difference)  # fmt: skip
        print(f"rows {rows:4d} layer: " + "  ".join(
            f"{name} {1000 * seconds:.2f} ms" for name, seconds in layer.items()
        ))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
