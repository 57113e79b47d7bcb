"""Decode step time of a pipeline split, engine only (no node, no API), each rank pinned to
its own core: what `exo bench --pin-cores` measures minus the serving around the engine.

For each world size asked (1: one pinned process), rank 0 submits N greedy requests at once
(N from `--streams`) and steps the engine until they finish; after `--skip` steps (the
prefill and the first decode steps) the tokens sampled and the time are counted. Prints
the aggregate decode tok/s (tokens / time) and the time of one token of every stream
(N / tok/s); JSON with `--json`.

    python bench/bench_pipeline_steps.py [--worlds 1,2] [--streams 1,4] [--tokens 80]
        [--model-dir DIR (default: SmolLM2-135M from the catalog)] [--mode pipeline|tensor]
        [--split 17,13 (a pipeline's layers per rank; default even)]

`EXO_RANK_LINKS=0` in the environment runs the ranks over gloo only, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as multiprocessing

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.torch.engine_factory import load_engine

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


def _shard(
    model_dir: Path, mode: str, rank: int, world_size: int, split: list[int] | None
) -> ShardMetadata:
    card = card_from_local_directory(model_dir)
    if mode == "tensor":
        return ShardMetadata(
            sharding="tensor", model_card=card, device_rank=rank, world_size=world_size
        )
    bounds = [round(index * card.n_layers / world_size) for index in range(world_size + 1)]
    if split is not None and len(split) == world_size:
        bounds = [sum(split[:index]) for index in range(world_size + 1)]
    return ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=rank, world_size=world_size,
        start_layer=bounds[rank], end_layer=bounds[rank + 1],
    )  # fmt: skip


def _rank_main(rank: int, world_size: int, port: int, args: Any, out: Any) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    try:
        if world_size > 1:
            init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=300)
        model_dir = Path(args.model_dir)
        engine = load_engine(model_dir, _shard(model_dir, args.mode, rank, world_size, args.split))
        engine.warmup()
        if rank != 0:
            engine.serve_forever()
            destroy_group()
            return
        engine.eos_token_ids = frozenset()  # every request decodes --tokens tokens
        params = TextGenerationTaskParams(
            model=ModelId("bench"), prompt="hello there " * 60, max_tokens=args.tokens,
            temperature=0.0,
        )  # fmt: skip
        figures: dict[int, dict[str, float]] = {}
        for streams in args.streams:
            for index in range(streams):
                engine.submit(params, request_id=f"bench-{streams}-{index}")
            # A pipeline keeps up to world-size steps in flight: a `step()` may sample
            # none, so time and tokens are counted over the whole timed stretch.
            timed_s = 0.0
            tokens = 0
            steps = 0
            while engine.has_work and steps < 10_000:
                started = time.perf_counter()
                outputs = engine.step()
                steps += 1
                if steps > args.skip:
                    timed_s += time.perf_counter() - started
                    tokens += sum(len(piece.token_ids) for _, piece in outputs
                                  if not isinstance(piece, Exception))  # fmt: skip
            tok_s = tokens / timed_s
            figures[streams] = {"step_ms": round(streams / tok_s * 1000, 2), "tok_s": tok_s}
        if world_size > 1:
            engine.shutdown()
            destroy_group()
        out.put(figures)
    except Exception:
        traceback.print_exc()
        if rank == 0:
            out.put(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--worlds", default="1,2", help="world sizes, comma-separated")
    parser.add_argument("--streams", default="1,4", help="requests at once, comma-separated")
    parser.add_argument("--tokens", type=int, default=80, help="tokens each request decodes")
    parser.add_argument("--skip", type=int, default=20, help="first steps not timed")
    parser.add_argument("--mode", choices=("pipeline", "tensor"), default="pipeline")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument(
        "--split", default=None, help="a pipeline's layers per rank, e.g. 17,13 (default even)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.split = [int(part) for part in args.split.split(",")] if args.split else None
    args.streams = [int(part) for part in args.streams.split(",")]
    if args.model_dir is None:
        card = load_builtin_cards()[DEFAULT_MODEL]
        args.model_dir = str(prepare_model(card, models_dir(), offline=False))
    context = multiprocessing.get_context("spawn")
    results: dict[str, Any] = {}
    for world_size in (int(part) for part in args.worlds.split(",")):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        out = context.Queue()
        processes = [
            context.Process(target=_rank_main, args=(rank, world_size, port, args, out))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        try:
            figures = out.get(timeout=1800)
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
        if figures is None:
            print(f"{args.mode} x{world_size}: failed (see the traceback above)")
            return 1
        results[f"{args.mode} x{world_size}"] = figures
        line = ", ".join(
            f"{streams} streams: step {figure['step_ms']:.1f} ms, {figure['tok_s']:.1f} tok/s"
            for streams, figure in figures.items()
        )
        print(f"{args.mode} x{world_size} (pinned): {line}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
