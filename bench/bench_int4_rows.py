"""exo's int4 products per activation row, as a step calls them (`Int4Linear.matmul`: the
decode kernel for up to 7 rows, prefill's `block_matmul` above), on one thread, for a range
of row counts: how the cost of a row falls as rows share one read of the weight.

Usage: PYTHONPATH=src python bench/bench_int4_rows.py [--shapes 1536x2048 2048x768]
       [--rows 1 2 4 8 16 32 128 512] [--calls-rows 2048] [--repeats 7]
       [--decode-activations int16 int8] [--decode-kernel]

`--decode-kernel` calls the decode kernel (`native_kernels.built_int4_kernel`) at every row
count instead, as the native decode layer does up to its GEMM crossover (`decode_layer.cpp`).

Each shape is OUTxIN (outputs x inputs) of one random int4 linear (groups as `Int4Linear`
quantizes them). Each figure is the median over `--repeats` of the thread CPU time
(`time.thread_time`) of a loop of calls over about `--calls-rows` rows in all, divided by
the calls: on a machine shared with other work that moves far less than wall time. Prints
per row count the time per call, per row, the multiple of the one-row call's time, and
GOP/s (2 x outputs x inputs x rows per second). The defaults are Qwen3-30B-A3B's expert
shapes (fused gate/up 1536x2048, down 2048x768). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch
    from torch import nn

    from exo.worker.engines.torch.quant.int4_groups import Int4Linear
    from exo.worker.engines.torch.quant.native_kernels import (
        built_int4_kernel,
        set_decode_activations,
    )

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shapes", nargs="+", default=["1536x2048", "2048x768"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 512])
    parser.add_argument("--calls-rows", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--decode-activations",
        nargs="+",
        choices=("int16", "int8"),
        default=["int16"],
        help="the int4 products' activation rounding (the node's --decode-activations); "
        "several: interleaved repeat by repeat, each printed",
    )
    parser.add_argument(
        "--decode-kernel",
        action="store_true",
        help="call the decode kernel at every row count (not Int4Linear.matmul's choice)",
    )
    args = parser.parse_args()
    decode_kernel = built_int4_kernel() if args.decode_kernel else None
    if args.decode_kernel and decode_kernel is None:
        parser.error("exo's native kernels are not built on this machine")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    for shape in args.shapes:
        outputs, inputs = (int(part) for part in shape.split("x"))
        linear = nn.Linear(inputs, outputs, bias=False)
        nn.init.normal_(linear.weight, std=0.02)
        quantized = Int4Linear(linear)

        def product(x: torch.Tensor, quantized: Int4Linear = quantized) -> torch.Tensor:
            if decode_kernel is not None:
                return decode_kernel(x, quantized.packed, quantized.scales_and_zeros)
            return quantized.matmul(x)

        print(f"{shape}: native {quantized.native}, prefill activations "
              f"{quantized.prefill_activations}")  # fmt: skip
        first: dict[str, float] = {}
        for rows in args.rows:
            x = torch.randn(rows, inputs)
            calls = max(1, args.calls_rows // rows)
            for activations in args.decode_activations:
                set_decode_activations(activations)
                for _ in range(3):
                    product(x)
            times: dict[str, list[float]] = {value: [] for value in args.decode_activations}
            for _ in range(args.repeats):  # the settings interleaved repeat by repeat
                for activations in args.decode_activations:
                    set_decode_activations(activations)
                    started = time.thread_time()
                    for _ in range(calls):
                        product(x)
                    times[activations].append((time.thread_time() - started) / calls)
            for activations in args.decode_activations:
                call = statistics.median(times[activations])
                first.setdefault(activations, call)
                print(
                    f"  rows {rows:4d} {activations:5s}: {call * 1e3:8.3f} ms/call "
                    f"{call / rows * 1e6:8.2f} us/row "
                    f"x{call / first[activations]:6.2f} of the first  "
                    f"{2 * outputs * inputs * rows / call / 1e9:6.1f} GOP/s"
                )
    set_decode_activations("int16")


if __name__ == "__main__":
    main()
