"""One MoE block's routed experts at Qwen3-30B-A3B's shapes (hidden 2048, experts of width
768, top 8, random int4 weights) or, with `--shape gpt-oss-20b`, gpt-oss-20b's (hidden
2880, 32 experts of width 2880, top 4, random MXFP4 weights with biases, the clamped
SwiGLU): the per-expert path (`moe.dispatch` over `LeanExpert`s, one Python call per
chosen expert) against the native call that replaced it (`direct_forward_moe.
NativeInt4Experts`, `native/moe_experts.cpp`; `NativeMxfp4Experts`,
`native/moe_mxfp4_experts.cpp`), and the bare kernels of the chosen experts alone (int4:
one `int4_gemv` per gate/up and down; MXFP4: one `mxfp4_linear` per gate, up and down; no
activation, no gathering: the floor the MoE block's dispatch adds to), interleaved.

Usage: PYTHONPATH=src python bench/bench_moe_layer.py [--shape qwen3-30b-a3b|gpt-oss-20b]
       [--experts 32] [--threads 1] [--rows 1 4 128] [--calls 50] [--rounds 6]

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

# (hidden, intermediate, experts per token) by `--shape`, from the models' config.json.
SHAPES = {"qwen3-30b-a3b": (2048, 768, 8), "gpt-oss-20b": (2880, 2880, 4)}
# gpt-oss's clamped SwiGLU (its config: swiglu_limit 7.0; alpha transformers' 1.702).
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


def main() -> None:
    from exo.worker.engines.torch.model.direct_forward_moe import (
        LeanExpert,
        NativeInt4Experts,
        NativeMxfp4Experts,
    )
    from exo.worker.engines.torch.model.direct_forward_parts import Projection
    from exo.worker.engines.torch.model.families.gpt_oss import ClampedSwiglu
    from exo.worker.engines.torch.model.families.spec import Routing
    from exo.worker.engines.torch.model.moe import ExpertFunction, dispatch, route
    from exo.worker.engines.torch.quant.int4_groups import Int4Linear
    from exo.worker.engines.torch.quant.mxfp4 import Mxfp4Linear, Mxfp4Projection, mxfp4_linear

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 128])
    parser.add_argument("--calls", type=int, default=50, help="calls per path per round")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    hidden, intermediate, per_token = SHAPES[args.shape]

    def int4(out_features: int, in_features: int) -> Int4Linear:
        linear = nn.Linear(in_features, out_features, bias=False)
        nn.init.normal_(linear.weight, std=0.02)
        return Int4Linear(linear)

    def mxfp4(out_features: int, in_features: int) -> Mxfp4Linear:
        """Random E2M1 codes, scales 2 ** -9 to 2 ** -5 (weights up to ~0.2), a bias."""
        linear = Mxfp4Linear(in_features, out_features, bias=True, device="cpu")
        with torch.no_grad():
            linear.blocks.copy_(torch.randint(0, 256, linear.blocks.shape, dtype=torch.uint8))
            linear.scales.copy_(torch.randint(118, 123, linear.scales.shape, dtype=torch.uint8))
            assert linear.bias is not None
            linear.bias.normal_(0.0, 0.02)
        return linear

    started = time.perf_counter()
    experts: list[ExpertFunction | None] = []
    for _ in range(args.experts):
        if args.shape == "gpt-oss-20b":
            gate_up = Mxfp4Projection([mxfp4(intermediate, hidden), mxfp4(intermediate, hidden)])
            down = Mxfp4Projection([mxfp4(hidden, intermediate)])
            swiglu = ClampedSwiglu(alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT)
            experts.append(LeanExpert(gate_up, down, None, swiglu))
        else:
            experts.append(
                LeanExpert(
                    Projection([int4(intermediate, hidden), int4(intermediate, hidden)], False),
                    Projection([int4(hidden, intermediate)], False),
                    F.silu,
                )
            )
    native = NativeInt4Experts.of(experts) or NativeMxfp4Experts.of(experts)
    if native is None:
        raise SystemExit("exo's native kernels are not built here: nothing to compare")
    print(f"{args.shape}: {args.experts} experts built in {time.perf_counter() - started:.0f} s; "
          f"threads {args.threads}; load average {os.getloadavg()}")  # fmt: skip
    router = torch.randn(args.experts, hidden) * 0.02
    routing = Routing(experts=args.experts, experts_per_token=per_token, normalize=True)

    def kernels_only(groups: list[tuple[int, torch.Tensor]]) -> None:
        for expert, rows in groups:  # the rows routed to each chosen expert, gathered
            if isinstance(native, NativeInt4Experts):
                pair = native.linears[expert]
                assert pair is not None
                middle = pair[0].matmul(rows)  # int4_gemv, or block_matmul above 7 rows
                pair[1].matmul(middle[:, :intermediate].contiguous())
            else:
                held = native.weights[expert]  # (blocks, scales, biases) of gate, up, down
                assert held is not None
                gate = mxfp4_linear(rows, held[0][0], held[1][0])  # mxfp4_gemv, or block_matmul
                mxfp4_linear(rows, held[0][1], held[1][1])
                mxfp4_linear(gate, held[0][2], held[1][2])

    def measure(rows: int) -> None:
        inputs = [torch.randn(rows, hidden) for _ in range(args.calls)]
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
