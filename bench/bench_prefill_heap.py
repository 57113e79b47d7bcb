"""A runner's heap while it serves prompts of every length: torch's per-shape CPU kernel
caches, bounded (as a node starts its runners) against torch's defaults.

Each configuration runs in a fresh process: the default model (the embedded SmolLM2-135M)
is loaded into one single-rank engine and serves `--requests` chat prompts one after the
other, each of a random number of words (5-800, seeded) and `--max-tokens` greedy tokens.
Every `--every` requests the process trims its heap (`malloc_trim`) and prints its RSS, its
`[heap]` (brk) resident size and its anonymous mappings' resident size (KV slots, weights)
in MiB, from /proc/self/smaps. With the defaults (1024 entries per cache) the heap grows
with every new prompt length; bounded (`exo.utils.heap.bound_kernel_caches`) it levels off.

    python bench/bench_prefill_heap.py [--requests 400] [--every 50] [--only bounded]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "orbit",
    "garden",
    "copper",
    "violin",
    "harbor",
    "maple",
    "signal",
    "desert",
    "lantern",
    "meadow",
    "prism",
    "falcon",
    "ember",
    "glacier",
]


def _resident_kib() -> tuple[int, int]:
    """(`[heap]`, anonymous mappings) resident KiB of this process."""
    heap = anonymous = 0
    name: str | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                name = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "Rss:":
                if name == "[heap]":
                    heap += int(fields[1])
                elif name == "":
                    anonymous += int(fields[1])
    return heap, anonymous


def _serve(requests: int, every: int, max_tokens: int, seed: int) -> None:
    import gc
    import random

    import psutil
    from loguru import logger

    from exo.benchmark.engine_runner import load_engine_for_bench
    from exo.download.pypi_gguf import prepare_model
    from exo.node_options import DEFAULT_MODEL_ID
    from exo.shared.constants import models_dir
    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
    from exo.utils.heap import trim_heap

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    card = load_builtin_cards()[DEFAULT_MODEL_ID]
    engine = load_engine_for_bench(
        prepare_model(card, models_dir(), offline=True, on_progress=lambda message: None)
    )
    rng = random.Random(seed)
    process = psutil.Process()
    start = time.perf_counter()
    for number in range(1, requests + 1):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 800)))
        params = TextGenerationTaskParams(
            model=card.model_id,
            messages=(ChatMessage(role="user", content=text),),
            max_tokens=max_tokens,
            temperature=0.0,
        )
        engine.submit(params, request_id=f"request-{number}")
        finished = False
        for _ in range(max_tokens + 10_000):
            for _, piece in engine.step():
                if isinstance(piece, Exception) or getattr(piece, "finish_reason", None):
                    finished = True
            if finished:
                break
        if number % every == 0:
            gc.collect()
            trim_heap()
            heap, anonymous = _resident_kib()
            print(
                f"  {number:5d} requests {time.perf_counter() - start:6.0f} s:"
                f" RSS {process.memory_info().rss / 2**20:6.0f} MiB,"
                f" heap {heap / 1024:5.0f} MiB, anonymous {anonymous / 1024:5.0f} MiB",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--every", type=int, default=50, help="report every N requests")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=("bounded", "default"), help="one configuration")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _serve(args.requests, args.every, args.max_tokens, args.seed)
        return

    from exo.utils.heap import KERNEL_CACHE_VARIABLES, bound_kernel_caches

    for configuration in (args.only,) if args.only else ("default", "bounded"):
        environ = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHE_VARIABLES}
        if configuration == "bounded":
            bound_kernel_caches(environ)
        caches = ", ".join(
            f"{name}={environ.get(name, 'unset')}" for name in KERNEL_CACHE_VARIABLES
        )
        print(f"{configuration}: {caches}", flush=True)
        command = [sys.executable, __file__, "--child", "--requests", str(args.requests)]
        command += ["--every", str(args.every), "--max-tokens", str(args.max_tokens)]
        command += ["--seed", str(args.seed)]
        subprocess.run(command, env=environ, check=True)


if __name__ == "__main__":
    main()
