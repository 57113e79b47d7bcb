"""Latency of the rank-to-rank messages of the decode hot path: gloo against exo's links.

Two processes form a group over loopback (as `exo bench --pin-cores` does: one pinned to core
0, one to core 1, or both unpinned) and time, per operation, `--iterations` repetitions of:

- `gloo_all_reduce`: `dist.all_reduce` (sum) of a `[rows, hidden]` float32 tensor;
- `links_all_reduce`: `RankLinks.all_reduce_sum` of the same tensor;
- `gloo_ping_pong` / `links_ping_pong`: rank 0 sends the tensor, rank 1 sends it back (one
  round trip; halve it for a one-way hop);
- `links_all_reduce_after_work_spin` / `_sleep`: decode's pattern, each rank busy for
  `WORK_US` (rank 1 `WORK_IMBALANCE_US` longer) before every all-reduce, timed on the rank
  that waits; with the links' spin (`EXO_LINK_SPIN_US`) and without it (the waiting rank
  sleeps in the kernel and its idle core must be woken).

Prints median / p90 / mean microseconds per operation and writes JSON (`--json`).

    python bench/bench_links.py [--rows 1] [--hidden 1024] [--iterations 2000] [--json out]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

WORK_US = 300
WORK_IMBALANCE_US = 100


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _timed(operation: Any, iterations: int) -> list[float]:
    for _ in range(min(100, iterations)):
        operation()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter_ns()
        operation()
        samples.append((time.perf_counter_ns() - started) / 1000)
    return samples


def _rank_main(
    rank: int, port: int, core: int | None, rows: int, hidden: int, iterations: int, out: Any
) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.comm.tcp_mesh import current_links

    init_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=60, with_gloo=True)
    links = current_links()
    assert links is not None
    tensor = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rank))
    peer = 1 - rank

    def gloo_ping_pong() -> None:
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(tensor, src=1)
        else:
            dist.recv(tensor, src=0)
            dist.send(tensor, dst=0)

    def links_ping_pong() -> None:
        if rank == 0:
            links.send(tensor, peer)
            links.recv(tensor, peer)
        else:
            links.recv(tensor, peer)
            links.send(tensor, peer)

    spin_s = links.spin_s
    # Decode's pattern: each rank computes (rank 1 a little longer), then they all-reduce;
    # rank 0 waits ~WORK_IMBALANCE_US for rank 1 in every all-reduce.
    work_s = (WORK_US + rank * WORK_IMBALANCE_US) / 1e6

    def after_work(spin: float) -> Any:
        def operation() -> None:
            until = time.perf_counter() + work_s
            while time.perf_counter() < until:
                pass
            links.spin_s = spin
            started = time.perf_counter_ns()
            links.all_reduce_sum(tensor)
            waits.append((time.perf_counter_ns() - started) / 1000)
            links.spin_s = spin_s

        return operation

    waits: list[float] = []
    operations = {
        "gloo_all_reduce": lambda: dist.all_reduce(tensor),
        "links_all_reduce": lambda: links.all_reduce_sum(tensor),
        "gloo_ping_pong": gloo_ping_pong,
        "links_ping_pong": links_ping_pong,
        "links_all_reduce_after_work_spin": after_work(spin_s),
        "links_all_reduce_after_work_sleep": after_work(0.0),
    }
    results: dict[str, list[float]] = {}
    for _round in range(2):  # interleaved twice: the machine's load drifts
        for name, operation in operations.items():
            dist.barrier()
            tensor.normal_(generator=torch.Generator().manual_seed(rank))
            waits.clear()
            samples = _timed(operation, iterations // 2)
            # After work: the all-reduce's own time (the waiting rank's, rank 0's).
            results.setdefault(name, []).extend(waits[-len(samples) :] if waits else samples)
            tensor.clamp_(-1e3, 1e3)
    destroy_group()
    if rank == 0:
        out.put(results)


def measure(pinned: bool, rows: int, hidden: int, iterations: int) -> dict[str, dict[str, float]]:
    """Run both ranks; return {operation: {median_us, p90_us, mean_us}}."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = _free_port()
    cores = sorted(os.sched_getaffinity(0))
    processes = [
        context.Process(
            target=_rank_main,
            args=(
                rank,
                port,
                cores[rank % len(cores)] if pinned else None,
                rows,
                hidden,
                iterations,
                out,
            ),
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    try:
        results: dict[str, list[float]] = out.get(timeout=600)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    summary = {}
    for name, samples in results.items():
        ordered = sorted(samples)
        summary[name] = {
            "median_us": round(statistics.median(ordered), 1),
            "p90_us": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
            "mean_us": round(statistics.fmean(ordered), 1),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    figures: dict[str, Any] = {"rows": args.rows, "hidden": args.hidden}
    for pinned in (True, False):
        label = "pinned" if pinned else "unpinned"
        summary = measure(pinned, args.rows, args.hidden, args.iterations)
        figures[label] = summary
        print(f"[{args.rows}, {args.hidden}] float32, {label} (cores 0 and 1):")
        for name, figure in summary.items():
            print(
                f"  {name:33s} median {figure['median_us']:7.1f} us  p90 {figure['p90_us']:7.1f} us"
                f"  mean {figure['mean_us']:7.1f} us"
            )
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(figures, handle, indent=2)


if __name__ == "__main__":
    main()
