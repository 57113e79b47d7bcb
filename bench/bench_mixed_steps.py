"""What a prompt chunk adds to a decode step: one forward pass's CPU time, by chunk and position.

Usage: PYTHONPATH=src python bench/bench_mixed_steps.py [--chunks 1 2 4 8 16 32 64]
       [--positions 100 1000 1900] [--repeats 12] [--threads 1] [--json PATH]

On the default model (the engine's default weights), with two KV slots: request A decodes at
position 40, request B's prompt chunk of `chunk` tokens starts at `position`. For every
(position, chunk) it times, through `forward_batch` with hand-built plans (no scheduler, no
sampling):
- decode-only: A's row alone;
- mixed: A's row and B's chunk in one step (exo's decode layer runs every row where its
  kernels run: model/direct_forward.py);
- prompt-only: B's chunk alone (the lean forward's prefill operators),
and prints medians of the calling thread's CPU time (`time.thread_time`), so time lost to
other processes on a shared machine is not counted; with `--threads` above 1 the other
threads' work is not counted either, so keep 1 for per-part figures. `mixed - decode` is the
chunk's cost beside a stream (what the chunk sizer sees); `decode + prompt-only` what the
same work costs as two steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_concurrency import load_default_engine

from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
)

DECODE_POSITION = 40


def step_cpu_ms(
    engine: Any, slots: tuple[int, int], decode: bool, chunk: int, position: int, repeats: int
) -> float:
    """Median thread CPU time (ms) of one forward pass: A's decode row (when `decode`) and
    B's `chunk` prompt tokens from `position` (when `chunk` > 0); the first two are warm-up."""
    scheduler = engine.scheduler
    decode_slot, prompt_slot = slots
    ids: list[int] = [5] if decode else []
    positions: list[int] = [DECODE_POSITION] if decode else []
    prefill = [PrefillSegment(prompt_slot, position, len(ids), chunk)] if chunk else []
    ids += [7] * chunk
    positions += range(position, position + chunk)
    times = []
    for _ in range(repeats + 2):
        plan = BatchPlan(
            scheduler._cache, scheduler._windows, [decode_slot] if decode else [],
            [DECODE_POSITION] if decode else [], prefill, scheduler._layer_of,
        )  # fmt: skip
        started = time.thread_time()
        forward_batch(
            scheduler._model, plan, torch.tensor([ids]), torch.tensor([positions]),
            torch.tensor([len(ids) - 1]),
        )  # fmt: skip
        times.append(time.thread_time() - started)
    return statistics.median(times[2:]) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--positions", type=int, nargs="+", default=[100, 1000, 1900])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    engine = load_default_engine(arguments.models_dir)
    cache = engine.scheduler._cache
    slots = (cache.allocate(), cache.allocate())
    cache.reserve(max(arguments.positions) + max(arguments.chunks) + 1)
    rows: list[dict[str, float]] = []
    for position in arguments.positions:
        decode = step_cpu_ms(engine, slots, True, 0, position, arguments.repeats)
        print(f"prompt position {position}: decode-only step {decode:.2f} ms CPU")
        for chunk in arguments.chunks:
            mixed = step_cpu_ms(engine, slots, True, chunk, position, arguments.repeats)
            alone = step_cpu_ms(engine, slots, False, chunk, position, arguments.repeats)
            rows.append({
                "position": position, "chunk": chunk, "decode_ms": decode, "mixed_ms": mixed,
                "prompt_only_ms": alone,
            })  # fmt: skip
            print(
                f"  chunk {chunk:3d}: mixed {mixed:7.2f} ms (+{mixed - decode:6.2f}, "
                f"{(mixed - decode) / chunk:5.2f} per token), prompt-only {alone:7.2f} ms, "
                f"decode + prompt-only {decode + alone:7.2f} ms"
            )
    if arguments.json is not None:
        arguments.json.write_text(json.dumps({"threads": arguments.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
