"""One MoE block's routed experts at Qwen3-30B-A3B's shapes (hidden 2048, experts of width
768, top 8, random int4 weights): the per-expert path (`moe.dispatch` over `LeanExpert`s,
one Python call per chosen expert) against the native call that replaced it for int4
experts (`direct_forward_moe.NativeInt4Experts`, `native/moe_experts.cpp`), and the bare
int4 kernels of the chosen experts alone (one `int4_gemv` per gate/up and down, no
activation, no gathering: the floor the MoE block's dispatch adds to), interleaved.

Usage: PYTHONPATH=src python bench/bench_moe_layer.py [--experts 32] [--threads 1]
       [--rows 1 4 128] [--calls 50] [--rounds 6]

Each figure is the median thread CPU time of one call (`time.thread_time`, the calling
thread's): with `--threads 1` that is all of the call's work, and on a machine shared with
other work it moves far less than wall time (a descheduled thread does not count). Wall
time is printed beside it. `--experts` builds fewer than the model's 128 experts (each is
quantized on load, seconds apiece on a busy machine); `--rows 128` over 32 experts gives
32 rows per expert, a 512-token prompt's group size with 128. Numbers only; nothing is
asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = 2048
INTERMEDIATE = 768
PER_TOKEN = 8


def main() -> None:
    from exo.worker.engines.torch.model.direct_forward_moe import LeanExpert, NativeInt4Experts
    from exo.worker.engines.torch.model.direct_forward_parts import Projection
    from exo.worker.engines.torch.model.families.spec import Routing
    from exo.worker.engines.torch.model.moe import ExpertFunction, dispatch, route
    from exo.worker.engines.torch.quant.int4_groups import Int4Linear

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 128])
    parser.add_argument("--calls", type=int, default=50, help="calls per path per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    def int4(out_features: int, in_features: int) -> Int4Linear:
        linear = nn.Linear(in_features, out_features, bias=False)
        nn.init.normal_(linear.weight, std=0.02)
        return Int4Linear(linear)

    started = time.perf_counter()
    experts: list[ExpertFunction | None] = [
        LeanExpert(
            Projection([int4(INTERMEDIATE, HIDDEN), int4(INTERMEDIATE, HIDDEN)], False),
            Projection([int4(HIDDEN, INTERMEDIATE)], False),
            F.silu,
        )
        for _ in range(args.experts)
    ]
    native = NativeInt4Experts.of(experts)
    if native is None:
        raise SystemExit("exo's native int4 kernels are not built here: nothing to compare")
    print(f"{args.experts} experts built in {time.perf_counter() - started:.0f} s; "
          f"threads {args.threads}; load average {os.getloadavg()}")  # fmt: skip
    router = torch.randn(args.experts, HIDDEN) * 0.02
    routing = Routing(experts=args.experts, experts_per_token=PER_TOKEN, normalize=True)

    def kernels_only(groups: list[tuple[int, torch.Tensor]]) -> None:
        for expert, rows in groups:  # the rows routed to each chosen expert, gathered
            pair = native.linears[expert]
            assert pair is not None
            middle = pair[0].matmul(rows)  # int4_gemv, or block_matmul above 7 rows
            pair[1].matmul(middle[:, :INTERMEDIATE].contiguous())

    def measure(rows: int) -> None:
        inputs = [torch.randn(rows, HIDDEN) for _ in range(args.calls)]
        routed = [route(F.linear(x, router), routing) for x in inputs]
        groups = [
            [(expert, x[(chosen == expert).any(dim=1)]) for expert in chosen.unique().tolist()]
            for x, (_, chosen) in zip(inputs, routed, strict=True)
        ]
        paths: dict[str, Callable[[int], object]] = {
            "per-expert": lambda i: dispatch(inputs[i], routed[i][1], routed[i][0], experts),
            "native": lambda i: native(inputs[i], routed[i][1], routed[i][0]),
            "kernels only": lambda i: kernels_only(groups[i]),
        }
        cpu: dict[str, list[float]] = {name: [] for name in paths}
        wall: dict[str, list[float]] = {name: [] for name in paths}
        for round_index in range(args.rounds):
            names = list(paths) if round_index % 2 == 0 else list(paths)[::-1]
            for name in names:
                for index in range(args.calls):
                    cpu_start, wall_start = time.thread_time(), time.perf_counter()
                    paths[name](index)
                    cpu[name].append(time.thread_time() - cpu_start)
                    wall[name].append(time.perf_counter() - wall_start)
        for name in cpu:
            print(
                f"rows {rows:4d} {name:12s}: thread CPU median "
                f"{statistics.median(cpu[name]) * 1e3:8.3f} ms, wall median "
                f"{statistics.median(wall[name]) * 1e3:8.3f} ms",
                flush=True,
            )

    for rows in args.rows:
        measure(rows)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
