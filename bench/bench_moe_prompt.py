"""One MoE block of Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of width 768, top 8,
random int4 weights held as exo's native experts) routed and run by the native call
(`Int4ExpertTable.route`, `native/moe_experts.cpp`) over a prompt's rows: wall and process
CPU time per call, and the multiply-adds per CPU second.

Usage: PYTHONPATH=src python bench/bench_moe_prompt.py [--rows 128 512] [--threads 2]
       [--calls 4] [--save PREFIX]

Compare two commits by running it under each one's `src` in turn (each loads the native
library built from its own sources): `--save` writes each row count's output
(`PREFIX-ROWS.pt`) so the two can be checked bit for bit. Process CPU time counts every
thread of the process, idle threads spinning in the OpenMP pool included; on a machine
shared with other work it moves far less than wall time. The best of `--calls` calls is
printed. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

# Qwen3-30B-A3B's config.json: hidden_size, moe_intermediate_size, num_experts,
# num_experts_per_tok.
HIDDEN, WIDTH, EXPERTS, PER_TOKEN = 2048, 768, 128, 8


def _int4_weight(outputs: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int4 pairs of blocks (any byte is a valid pair of nibbles) and bfloat16
    (scale, zero) pairs per 32 inputs, as exo's int4 layout holds them."""
    packed = torch.randint(0, 256, (outputs, inputs // 2), dtype=torch.uint8)
    pairs = torch.empty(outputs, inputs // 32, 2)
    pairs[..., 0] = torch.rand(outputs, inputs // 32) * 0.01 + 0.001
    pairs[..., 1] = torch.randn(outputs, inputs // 32) * 0.01
    return packed, pairs.to(torch.bfloat16).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4, help="measured calls per row count")
    parser.add_argument("--save", default=None, help="write each output to PREFIX-ROWS.pt")
    args = parser.parse_args()

    from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel

    if built_int4_kernel() is None:
        raise SystemExit("exo's native kernels are not built here")
    torch.manual_seed(0)
    gate_up = [_int4_weight(2 * WIDTH, HIDDEN) for _ in range(EXPERTS)]
    down = [_int4_weight(HIDDEN, WIDTH) for _ in range(EXPERTS)]
    router = torch.randn(EXPERTS, HIDDEN) * 0.05
    table = torch.classes.exo_native.Int4ExpertTable(
        [w[0] for w in gate_up], [w[1] for w in gate_up], [w[0] for w in down],
        [w[1] for w in down], list(range(EXPERTS)), EXPERTS, 0,
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN)

        def call(x: torch.Tensor = x) -> torch.Tensor:
            # softmax scores, top 8, norm_topk_prob; int16 activations (the default)
            out: torch.Tensor = table.route(
                x, router, None, None, 0, PER_TOKEN, True, 1.0, [16, 0, 0], [16, 0, 0]
            )
            return out

        out = call()
        wall, cpu = [], []
        for _ in range(args.calls):
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            out = call()
            wall.append(time.perf_counter() - wall_start)
            cpu.append(time.process_time() - cpu_start)
        multiply_adds = rows * PER_TOKEN * 3 * WIDTH * HIDDEN
        print(
            f"rows {rows:5d}, {args.threads} threads: wall {min(wall) * 1e3:7.1f} ms, "
            f"CPU {min(cpu) * 1e3:7.1f} ms ({multiply_adds / min(cpu) / 1e9:5.1f} G "
            f"multiply-adds per CPU second); load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        if args.save:
            torch.save(out, f"{args.save}-{rows}.pt")


if __name__ == "__main__":
    main()
