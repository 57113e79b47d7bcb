"""Expert ×2 on two pinned 1-core nodes against one pinned node (`bench_moe.py`'s last case;
also runnable alone).

Usage: PYTHONPATH=src python bench/bench_moe_expert.py MODEL_DIR [--streams 4]
       [--prompt-tokens 128] [--decode-tokens 32] [--rounds 1]

MODEL_DIR is a converted MoE model (`bench_moe.py` writes one under
~/.cache/exo-bench-moe/). Two arrangements run one after the other, never together:
- one node: one process pinned to the first CPU (`os.sched_setaffinity`, what `taskset -c`
  does) with one intra-op thread, the whole model;
- expert ×2: two processes pinned to the first and second CPU, one thread each, joined in a
  gloo process group over 127.0.0.1 (`comm.process_group.init_group`, as the multi-rank
  tests' `run_group` does), each holding half of every MoE layer's experts and the rest
  replicated (`"sharding": "expert"`); rank 0 batches the streams and the other rank serves
  its steps (`serve_forever`).
Each submits `--streams` requests of random prompts together through `submit` / `step`
(`exo.benchmark.engine_runner.run_engine`) and reports the aggregate decode tok/s (tokens
after each request's first over the time from the first first token to the last token) of
each round. On a machine whose cores other work also uses, both arrangements are disturbed
by different amounts: the figures say what ran, not what a quiet machine does.
"""

from __future__ import annotations

import argparse
import os
import queue
import time
import traceback
from pathlib import Path
from typing import Any

GROUP_TIMEOUT_S = 900.0
KV_CACHE_TOKENS = 2048


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    core: int,
    model_dir: str,
    settings: dict[str, int],
    results: Any,
) -> None:
    """One pinned process: load its shard, then measure (rank 0) or serve (the others)."""
    os.sched_setaffinity(0, {core})
    import torch

    from exo.benchmark.engine_runner import run_engine
    from exo.benchmark.prompts import ModelText
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.engine_factory import load_engine

    torch.set_num_threads(1)
    try:
        if world_size > 1:
            init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=GROUP_TIMEOUT_S)
        card = card_from_local_directory(Path(model_dir))
        shard = ShardMetadata(
            sharding="expert" if world_size > 1 else "pipeline", model_card=card,
            device_rank=rank, world_size=world_size, start_layer=0, end_layer=card.n_layers,
        )  # fmt: skip
        started = time.perf_counter()
        engine = load_engine(
            Path(model_dir), shard, weight_dtype="int4", kv_cache_tokens=KV_CACHE_TOKENS,
            max_concurrent_requests=max(4, settings["streams"]),
        )  # fmt: skip
        engine.warmup()
        load_seconds = time.perf_counter() - started
        if rank != 0:
            engine.serve_forever()
        else:
            model_text = ModelText.load(Path(model_dir))
            figures = []
            for round_index in range(settings["rounds"]):
                prompts = [
                    model_text.random_prompt(settings["prompt_tokens"], 100 * round_index + s)[0]
                    for s in range(settings["streams"])
                ]
                result = run_engine(engine, prompts, settings["decode_tokens"], model_text)
                figures.append(result.aggregate_decode_tok_s)
            engine.shutdown()
            results.put(("ok", figures, load_seconds))
        if world_size > 1:
            destroy_group()
    except Exception:
        results.put(("error", traceback.format_exc(), rank))


def run_arrangement(
    model_dir: Path, world_size: int, settings: dict[str, int]
) -> tuple[list[float], float] | str:
    """Spawn `world_size` pinned ranks (1: the whole model on one node) and return rank 0's
    aggregate decode tok/s per round and its load seconds, or the first error's text. Every
    process is ended before it returns."""
    import torch.multiprocessing as multiprocessing

    from exo.testing.ports import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cores = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = []
    for rank in range(world_size):
        core = cores[rank % len(cores)]
        arguments = (rank, world_size, port, core, str(model_dir), settings, results)
        processes.append(context.Process(target=_rank_main, args=arguments))
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's OpenMP pool: one thread each
    try:
        for process in processes:
            process.start()
        try:
            outcome = results.get(timeout=GROUP_TIMEOUT_S * 2)
        except queue.Empty:
            return f"no result in {GROUP_TIMEOUT_S * 2:.0f} s"
        if outcome[0] == "error":
            return f"rank {outcome[2]} failed:\n{outcome[1]}"
        return outcome[1], outcome[2]
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)


def run_pinned_expert_case(model_dir: Path, settings: dict[str, int]) -> dict[str, Any]:
    """One pinned node, then expert ×2 on two pinned 1-core nodes (module docstring);
    prints each and returns the figures (`{"one node": ..., "expert x2": ...}`, each a list
    of tok/s per round or an error's text)."""
    cores = sorted(os.sched_getaffinity(0))
    print(
        f"expert x2 on two pinned 1-core nodes (CPUs {cores[0]}, {cores[1 % len(cores)]}) "
        f"against one pinned node (CPU {cores[0]}): {settings['streams']} streams, prompts of "
        f"{settings['prompt_tokens']} tokens, {settings['decode_tokens']} decoded",
        flush=True,
    )
    if len(cores) < 2:
        print("  only one CPU is usable here: the two nodes would share it")
    figures: dict[str, Any] = {}
    for label, world_size in (("one node", 1), ("expert x2", 2)):
        outcome = run_arrangement(model_dir, world_size, settings)
        if isinstance(outcome, str):
            print(f"  {label}: {outcome}", flush=True)
            figures[label] = outcome
            continue
        rates, load_seconds = outcome
        shown = ", ".join(f"{rate:.2f}" for rate in rates)
        print(
            f"  {label:9s}: aggregate decode {shown} tok/s (loaded in {load_seconds:.0f} s)",
            flush=True,
        )
        figures[label] = rates
    one, two = figures.get("one node"), figures.get("expert x2")
    if isinstance(one, list) and isinstance(two, list) and one and two:
        print(f"  expert x2 / one node (best): {max(two) / max(one):.2f}x")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    run_pinned_expert_case(
        args.model_dir,
        {"streams": args.streams, "prompt_tokens": args.prompt_tokens,
         "decode_tokens": args.decode_tokens, "rounds": args.rounds},
    )  # fmt: skip


if __name__ == "__main__":
    main()
