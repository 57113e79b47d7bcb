"""The LM head product alone at Qwen3-30B-A3B's shape (151,936 x 2,048): the engine's int8
head (`Int8Linear`, one scale per output row, 311 MB) against the same head held as GGUF
Q6_K blocks (`Q6KLinear`, 255 MB), interleaved in one process.

Usage: PYTHONPATH=src python bench/bench_q6k_head.py [--vocab 151936] [--hidden 2048]
       [--rows 1 8] [--calls 20] [--rounds 5] [--threads 2]

The Q6_K head is random blocks (every value and scale pattern, fp16 `d` of Gaussian-sized
weights); the int8 head is `Int8Linear` of the same weights dequantized by `gguf`. Both
are far larger than any cache, so each call reads its head from memory as a decode step
does. A measurement is `--calls` products of one form at one row count (wall time, torch's
intra-op threads: `--threads`); the forms alternate measurement by measurement (the first
alternating too) for `--rounds` pairs. Prints per form and row count the median ms per
call with the spread (min-max), the median of the per-pair ratios Q6_K / int8, the bytes
each reads per call and the rate that makes, and how far each form's output is from the
float64 product (largest difference over the largest |output|, 1 row). The load average
before and after is printed: other work on the machine slows both forms. Numbers only;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def measure(head: Any, x: Any, calls: int) -> float:
    """Wall ms per call of `calls` products."""
    started = time.perf_counter()
    for _ in range(calls):
        head.matmul(x)
    return (time.perf_counter() - started) * 1000.0 / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    arguments = parser.parse_args()

    import numpy as np
    import torch

    from exo.testing.random_gguf import random_q6_k
    from exo.worker.engines.torch.quant.int8_channels import Int8Linear
    from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
    from exo.worker.engines.torch.quant.q6k_blocks import Q6KLinear, q6k_dequantized

    torch.set_num_threads(arguments.threads)
    if built_int4_kernel() is None:
        raise SystemExit("exo's native kernels cannot be built here")
    print(f"load average before: {os.getloadavg()}")
    vocab, hidden = arguments.vocab, arguments.hidden
    raw = random_q6_k((vocab, hidden), np.random.default_rng(0), 1.5e-5)
    q6k = Q6KLinear(torch.from_numpy(raw), None)
    dense = torch.nn.Linear(hidden, vocab, bias=False, device="meta")
    dense.weight = torch.nn.Parameter(torch.from_numpy(q6k_dequantized(raw)), requires_grad=False)
    int8 = Int8Linear(dense)
    weight = dense.weight.double()
    del dense
    forms = {"int8": int8, "q6k": q6k}
    sizes = {
        "int8": int8.weight.numel() + 2 * int8.scales.numel(),
        "q6k": q6k.blocks.numel(),
    }
    print(f"bits: {torch.ops.exo_native.int4_decode_bits()}, threads {torch.get_num_threads()}")
    x1 = torch.randn(1, hidden)
    exact = (x1.double() @ weight.T).float()
    for name, head in forms.items():
        error = (head.matmul(x1) - exact).abs().max() / exact.abs().max()
        print(f"{name}: {sizes[name] / 1e6:.1f} MB, largest error / largest |output| {error:.2e}")
    del weight, exact
    for rows in arguments.rows:
        x = torch.randn(rows, hidden)
        for head in forms.values():
            head.matmul(x)  # warm-up: buffers sized
        times: dict[str, list[float]] = {name: [] for name in forms}
        for round_index in range(arguments.rounds):
            order = list(forms) if round_index % 2 == 0 else list(reversed(forms))
            for name in order:
                times[name].append(measure(forms[name], x, arguments.calls))
        ratios = [q / i for q, i in zip(times["q6k"], times["int8"], strict=True)]
        for name, spread in times.items():
            median = statistics.median(spread)
            rate = sizes[name] / median / 1e6
            print(
                f"rows {rows} {name}: {median:.2f} ms ({min(spread):.2f}-{max(spread):.2f}), "
                f"{rate:.1f} GB/s"
            )
        print(f"rows {rows} q6k / int8: {statistics.median(ratios):.3f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
