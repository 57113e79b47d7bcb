"""exo's int4 decode product read from memory: one call per weight over a stack of distinct
weights larger than the CPU's caches, one thread, as a decode step reads each weight once.

Usage: PYTHONPATH=src python bench/bench_int4_stream.py [--shapes 1536x2048 2048x768]
       [--stack-mib 150] [--rows 1 2 4] [--decode-activations int16 int8]
       [--passes 3] [--repeats 7]

Each shape is OUTxIN of random int4 weights in the engine's format (nibbles, bfloat16
(scale, zero) pairs per group of 32), as many distinct ones as fill `--stack-mib` MiB, so
every pass reads them from memory, not from the last-level cache (`bench_int4_rows.py`
calls one weight again and again: the cached case). A measurement is `--passes` passes of
one product per weight; the figure is the median over `--repeats` measurements of the
thread CPU time (`time.thread_time`) per product, and the GB/s of nibbles and scales that
time reads. Thread CPU time counts the core's stalls on memory, and moves far less than
wall time when other work shares the machine; compare figures of one run, or of processes
run alternately (the kernel's build is the process's). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from exo.worker.engines.torch.quant.native_kernels import (
        built_int4_kernel,
        set_decode_activations,
    )

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shapes", nargs="+", default=["1536x2048", "2048x768"])
    parser.add_argument("--stack-mib", type=float, default=150.0)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--decode-activations", nargs="+", choices=("int16", "int8"), default=["int16"]
    )
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    kernel = built_int4_kernel()
    if kernel is None:
        parser.error("exo's native kernels are not built on this machine")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        out, inputs = (int(value) for value in shape.split("x"))
        groups = inputs // 32
        weight_bytes = out * inputs // 2 + out * groups * 4
        count = max(1, int(args.stack_mib * 2**20 / weight_bytes))
        stack = []
        for _ in range(count):
            nibbles = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8,
                                    generator=generator)  # fmt: skip
            pairs = torch.empty(out, groups, 2)
            pairs[..., 0] = torch.rand(out, groups, generator=generator) * 0.01 + 0.001
            pairs[..., 1] = (torch.rand(out, groups, generator=generator) - 0.5) * 0.01
            stack.append((nibbles, pairs.to(torch.bfloat16)))
        print(f"{shape}: {count} weights, {count * weight_bytes / 2**20:.0f} MiB", flush=True)
        for rows in args.rows:
            x = torch.randn(rows, inputs, generator=generator)
            for activations in args.decode_activations:
                set_decode_activations(activations)
                times = []
                for _ in range(args.repeats):
                    started = time.thread_time()
                    for _ in range(args.passes):
                        for nibbles, pairs in stack:
                            kernel(x, nibbles, pairs)
                    times.append((time.thread_time() - started) / (args.passes * count))
                seconds = statistics.median(times)
                print(
                    f"  rows {rows} {activations}: {seconds * 1e6:8.1f} us a product "
                    f"[{min(times) * 1e6:.1f}-{max(times) * 1e6:.1f}], "
                    f"{weight_bytes / seconds / 1e9:5.1f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
