"""exo's int4 decode product with compact Q4_K scales against the bfloat16 (scale, zero)
pairs of the same weights (`quant/q4k_scales.py`), one thread, per-call A/B in one process.

Usage: PYTHONPATH=src python bench/bench_q4k_scales.py [--shapes 1536x2048 2048x768]
       [--weights 96] [--rows 1 4] [--repeats 15] [--rounds 5]

Each shape is OUTxIN of `--weights` distinct random Q4_K weights (random nibbles and scale
fields, as `gguf_repack` converts them), each held both ways: the same nibbles, compact
scales (20 bytes per 256 inputs) or pairs (32 bytes). A measurement is `--rounds` passes of
one product per weight over the whole stack (96 of Qwen3-30B-A3B's gate/up: 151 MiB of
nibbles, far past any cache, so each pass reads the weights from memory as a decode step
does); the two forms alternate measurement by measurement, the first alternating too, for
`--repeats` pairs. Prints per form the median time per product (thread CPU, `thread_time`,
and wall) with the spread (min-max of the repeats), and the median of the per-pair ratios
compact / pairs, and how far apart the two forms' outputs are (the decode kernel reads the
compact scales unrounded, the pairs are bfloat16: largest difference relative to the
largest |output|). Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def measure(kernel: Any, x: Any, stack: list[Any], form: int, rounds: int) -> tuple[float, float]:
    """(thread CPU, wall) seconds per product of `rounds` passes over `stack`, each weight's
    nibbles with its scales of `form` (1: pairs, 2: compact)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(rounds):
        for weight in stack:
            kernel(x, weight[0], weight[form])
    calls = rounds * len(stack)
    return (time.thread_time() - cpu) / calls, (time.perf_counter() - wall) / calls


def main() -> None:
    import numpy as np
    import torch

    from exo.download.gguf_repack import q4k_compact_scales, repack_q4_k
    from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
    from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
    from exo.worker.engines.torch.quant.q4k_scales import compact_from_stored

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shapes", nargs="+", default=["1536x2048", "2048x768"])
    parser.add_argument("--weights", type=int, default=96)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    kernel = built_int4_kernel()
    if kernel is None:
        raise SystemExit("exo's native kernels are not available on this machine")
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"int4 decode width {torch.ops.exo_native.int4_decode_bits()} bits, 1 thread")
    for shape in args.shapes:
        outputs, inputs = (int(part) for part in shape.split("x"))
        stack: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for _ in range(args.weights):
            raw = rng.integers(0, 256, (outputs, inputs // 256, 144), dtype=np.uint8)
            halves = rng.uniform(1e-4, 1e-3, (outputs, inputs // 256, 2)).astype(np.float16)
            raw[..., 0:4] = halves.view(np.uint8)
            data = raw.reshape(outputs, -1)
            groups = repack_q4_k(data, outputs)
            values = torch.from_numpy(groups.packed)
            unpacked = torch.stack([values & 15, values >> 4], dim=-1).reshape(outputs, inputs)
            pairs = torch.stack(
                [torch.from_numpy(groups.scales), torch.from_numpy(groups.zeros)], dim=-1
            ).to(torch.bfloat16)
            compact = compact_from_stored(torch.from_numpy(q4k_compact_scales(data, outputs)))
            stack.append((pack_native_int4(unpacked), pairs, compact.contiguous()))
        nibbles = sum(packed.numel() for packed, _, _ in stack)
        print(f"{shape} x {args.weights}: nibbles {nibbles / 2**20:.0f} MiB, scales "
              f"pairs {sum(p.numel() * 2 for _, p, _ in stack) / 2**20:.1f} MiB, compact "
              f"{sum(c.numel() for _, _, c in stack) / 2**20:.1f} MiB")  # fmt: skip
        for rows in args.rows:
            x = torch.randn(rows, inputs)
            apart = max(
                float((kernel(x, p, c) - kernel(x, p, s)).abs().max() / kernel(x, p, s).abs().max())
                for p, s, c in stack[:4]
            )
            print(f"  rows {rows}: outputs apart by {apart:.1e} of the largest |output|")
            times: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
            measure(kernel, x, stack, 1, args.rounds)
            measure(kernel, x, stack, 2, args.rounds)
            for repeat in range(args.repeats):
                for form in (1, 2) if repeat % 2 == 0 else (2, 1):
                    times[form].append(measure(kernel, x, stack, form, args.rounds))
            for form, name in ((1, "pairs  "), (2, "compact")):
                cpu = [sample[0] * 1e6 for sample in times[form]]
                wall = [sample[1] * 1e6 for sample in times[form]]
                print(f"  rows {rows} {name}: cpu {statistics.median(cpu):8.1f} us "
                      f"[{min(cpu):.1f}-{max(cpu):.1f}]  wall {statistics.median(wall):8.1f} us "
                      f"[{min(wall):.1f}-{max(wall):.1f}]")  # fmt: skip
            ratios_cpu = [c[0] / p[0] for c, p in zip(times[2], times[1], strict=True)]
            ratios_wall = [c[1] / p[1] for c, p in zip(times[2], times[1], strict=True)]
            print(f"  rows {rows} compact / pairs: cpu x{statistics.median(ratios_cpu):.3f} "
                  f"[{min(ratios_cpu):.3f}-{max(ratios_cpu):.3f}]  wall "
                  f"x{statistics.median(ratios_wall):.3f} "
                  f"[{min(ratios_wall):.3f}-{max(ratios_wall):.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
