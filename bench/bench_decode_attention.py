"""exo's decode attention (`native/decode_attention.cpp`, what the native decode layer runs
for every decode row, a draft's verify rows and short prompt chunks) on one layer's bfloat16
KV cache: the time of one call by rows, positions and chunk length.

Usage: PYTHONPATH=src python bench/bench_decode_attention.py [--shape 9x3x64]
       [--positions 100 2000 8000 16000] [--rows 1 8] [--chunks 2 4 8 12 16 32]
       [--chunk-position 1900] [--threads 1] [--repeats 30]

`--shape` is query heads x KV heads x head dimension (the default SmolLM2-135M's; Gemma 3
270M's is 4x1x256). Random keys, values and queries; `--rows` decode rows of as many slots
at each of `--positions`; then one slot's prompt chunk of each `--chunks` length ending at
`--chunk-position` (up to 12 rows the row kernel, longer ones torch's SDPA). Each figure is
the median over `--repeats` calls of the calling thread's CPU time (`time.thread_time`: on
a shared machine it moves far less than wall time; with `--threads` above 1 it leaves the
other threads' work out, so the default is 1), in microseconds per call, i.e. per layer,
with the multiply-adds per second (queries x keys x head dimension x 2: scores and weighted
sums) and the KV bytes read per second once per KV head. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    import torch

    from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--shape", default="9x3x64")
    parser.add_argument("--positions", type=int, nargs="+", default=[100, 2000, 8000, 16000])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 12, 16, 32])
    parser.add_argument("--chunk-position", type=int, default=1900)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    arguments = parser.parse_args()
    if built_int4_kernel() is None:
        raise SystemExit("exo's native kernels cannot be built here")
    torch.set_num_threads(arguments.threads)
    heads, kv_heads, head_dim = (int(part) for part in arguments.shape.split("x"))
    attend = torch.ops.exo_native.decode_attention_of
    generator = torch.Generator().manual_seed(0)

    def timed(slots: torch.Tensor, positions: torch.Tensor, slot_count: int) -> float:
        capacity = int(positions.max()) + 1
        shape = (slot_count, kv_heads, capacity, head_dim)
        keys = torch.randn(shape, generator=generator).to(torch.bfloat16)
        values = torch.randn(shape, generator=generator).to(torch.bfloat16)
        qkv = torch.randn(len(slots), (heads + 2 * kv_heads) * head_dim, generator=generator)
        times = []
        for _ in range(arguments.repeats + 2):
            started = time.thread_time()
            attend(qkv, keys, values, slots, positions, heads, 0, head_dim**-0.5)
            times.append(time.thread_time() - started)
        return statistics.median(times[2:]) * 1e6

    def report(label: str, micros: float, rows: int, keys: int, slots: int) -> None:
        multiply_adds = rows * heads * keys * head_dim * 2
        kv_bytes = slots * kv_heads * keys * head_dim * 2 * 2
        print(
            f"{label}: {micros:9.1f} us  {multiply_adds / micros / 1e3:6.1f} G multiply-adds/s"
            f"  {kv_bytes / micros / 1e3:6.1f} GB/s of KV"
        )

    print(f"shape {arguments.shape}, {arguments.threads} thread(s), bfloat16 KV")
    for rows in arguments.rows:
        for position in arguments.positions:
            slots = torch.arange(rows)
            micros = timed(slots, torch.full((rows,), position), rows)
            report(f"{rows} decode row(s) at {position:6d}", micros, rows, position + 1, rows)
    end = arguments.chunk_position
    for length in arguments.chunks:
        positions = torch.arange(end - length + 1, end + 1)
        micros = timed(torch.zeros(length, dtype=torch.long), positions, 1)
        # a chunk's rows see end - length + 1 .. end + 1 keys: their mean, for the rates
        mean_keys = end + 1 - (length - 1) // 2
        report(f"chunk of {length:2d} ending at {end}", micros, length, mean_keys, 1)


if __name__ == "__main__":
    main()
