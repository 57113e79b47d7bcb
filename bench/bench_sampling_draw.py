"""CPU time of one sampled token's draw: the Gumbel-max race (`decoding/gumbel_race.py`,
native kernel at each built width, and the torch fallback) against the cumulative-sum draw
it replaced (softmax, float64 cumulative sum, inverted at a uniform number), at SmolLM2's
and Gemma 3's vocabulary sizes.

Each draw starts from `[vocab]` float32 logits and includes the filters
(`sampling_candidates`: temperature, top-p). The methods run interleaved, round by round,
on one intra-op thread, and the thread's CPU time (`time.thread_time`) per draw is
reported (median over rounds), so other processes on a busy machine count less than in
wall time. Logits are normal with standard deviation 3 (no token pruned or favoured).

Usage: `python bench/bench_sampling_draw.py [--rounds 7] [--draws 200]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from exo.worker.engines.torch.decoding.gumbel_race import (
    native_gumbel_kernel,
    race_winner,
    reference_gumbel_scores,
)
from exo.worker.engines.torch.decoding.sampling import sampling_candidates
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel

native_int4_kernel()  # loads exo's native library and hands the sampler its race kernel

VOCABULARIES = {"SmolLM2": 49_152, "Gemma 3": 262_144}

Draw = Callable[[torch.Tensor, SamplingParams, int], int]


def cumulative_sum_draw(logits: torch.Tensor, params: SamplingParams, key: int) -> int:
    """The draw before 2026-12-07: the candidates' softmax, its float64 cumulative sum
    inverted at a uniform number (here derived from `key`)."""
    ids, kept = sampling_candidates(logits, params)
    cumulative = torch.cumsum(torch.softmax(kept, dim=-1).double(), dim=-1)
    point = torch.tensor((key % 1_000_003) / 1_000_003, dtype=torch.float64) * cumulative[-1]
    index = min(int(torch.searchsorted(cumulative, point, right=True)), kept.shape[-1] - 1)
    return index if ids is None else int(ids[index])


def native_race(width: int) -> Draw:
    kernel = native_gumbel_kernel()
    assert kernel is not None

    def draw(logits: torch.Tensor, params: SamplingParams, key: int) -> int:
        ids, kept = sampling_candidates(logits, params)
        index = race_winner(kernel(kept.contiguous(), ids, key, width))
        return index if ids is None else int(ids[index])

    return draw


def torch_race(logits: torch.Tensor, params: SamplingParams, key: int) -> int:
    ids, kept = sampling_candidates(logits, params)
    index = race_winner(reference_gumbel_scores(kept, ids, key))
    return index if ids is None else int(ids[index])


def built_widths() -> list[int]:
    kernel = native_gumbel_kernel()
    widths = []
    for width in (512, 256) if kernel is not None else ():
        try:
            kernel(torch.zeros(1), None, 0, width)  # type: ignore[misc]
        except RuntimeError:
            continue
        widths.append(width)
    return widths


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    methods: dict[str, Draw] = {"cumulative sum (before)": cumulative_sum_draw}
    for width in built_widths():
        methods[f"race, native {width}-bit"] = native_race(width)
    methods["race, torch fallback"] = torch_race
    print(f"ms of thread CPU time per draw (median of {args.rounds} rounds x {args.draws})")
    for name, vocab in VOCABULARIES.items():
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab)) * 3
        for top_p in (1.0, 0.9):
            params = SamplingParams(temperature=args.temperature, top_p=top_p)
            times: dict[str, list[float]] = {method: [] for method in methods}
            for round_index in range(args.rounds):
                for method, draw in methods.items():
                    draws = args.draws if "torch" not in method else max(args.draws // 10, 5)
                    draw(logits, params, round_index)  # warm
                    started = time.thread_time()
                    for key in range(draws):
                        draw(logits, params, key)
                    times[method].append((time.thread_time() - started) / draws * 1e3)
            for method, samples in times.items():
                print(
                    f"{name:8s} vocab {vocab:7d} top_p {top_p:.1f}  {method:26s}"
                    f" {statistics.median(samples):7.3f}"
                )


if __name__ == "__main__":
    main()
