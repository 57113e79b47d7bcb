"""What a pipeline's last rank sends back to rank 0 for a *sampling* request's n-gram drafts,
and the decode speed, engine only (no node, no API), each rank pinned to its own core.

Rank 0 of a pipeline x2 of the default model (SmolLM2-135M-Instruct, int4) runs the
copy-edit task of `bench_speculative.py` (rewrite a ~340-token passage with one name
changed) as one seeded sampling request, with speculation off and on, `--rounds` times
interleaved. Prints per run: decode tok/s (first token to last), verify rounds, draft
tokens accepted, logit rows answered whole and as chosen tokens, and the bytes that came
back from the last rank per verify round trip (`PipelineTraffic.values` x 4), plus a hash
of the text (one seed: the same text with and without drafts, and before and after a
change to how the rows travel). Only `PipelineTraffic`'s and `SpeculationCounters`'
fields that older commits have are read, so the script measures them too.

    PYTHONPATH=src python bench/bench_pipeline_sampled_drafts.py [--rounds 3] [--tokens 200]
        [--temperature 0.7] [--top-p 0.95] [--seed 7] [--logprobs N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
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
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine_factory import load_engine

MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
sys.path.insert(0, str(Path(__file__).parent))
from bench_speculative import TASKS  # noqa: E402


def _shard(model_dir: Path, rank: int, world_size: int) -> ShardMetadata:
    card = card_from_local_directory(model_dir)
    bounds = [round(index * card.n_layers / world_size) for index in range(world_size + 1)]
    return ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=rank, world_size=world_size,
        start_layer=bounds[rank], end_layer=bounds[rank + 1],
    )  # fmt: skip


def _run(engine: Any, args: Any, speculative: bool, label: str) -> dict[str, Any]:
    """One request to its end: its figures (see the module docstring)."""
    prompt, _ = TASKS["copy"]
    logprobs = {"logprobs": True, "top_logprobs": args.logprobs} if args.logprobs >= 0 else {}
    params = TextGenerationTaskParams(
        model=MODEL, messages=(ChatMessage(role="user", content=prompt),),
        max_tokens=args.tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, speculative=speculative, **logprobs,
    )  # fmt: skip
    engine.clear_prefix_cache()
    traffic = engine.group.traffic
    counters = engine.scheduler.speculation.counters
    before = (traffic.full_rows, traffic.lean_rows, traffic.values)
    rounds_before = (counters.verify_rounds, counters.accepted_tokens, counters.drafted_tokens)
    engine.submit(params, request_id=label)
    text, tokens, first, last = "", 0, 0.0, 0.0
    for _ in range(100_000):
        if not engine.has_work:
            break
        for _request, piece in engine.step():
            assert not isinstance(piece, Exception), piece
            now = time.perf_counter()
            first = first or now
            last = now
            text += piece.text
            tokens += len(piece.token_ids)
    verify = counters.verify_rounds - rounds_before[0]
    values = traffic.values - before[2]
    return {
        "tok_s": (tokens - 1) / (last - first) if last > first else 0.0,
        "tokens": tokens,
        "verify_rounds": verify,
        "accepted": counters.accepted_tokens - rounds_before[1],
        "drafted": counters.drafted_tokens - rounds_before[2],
        "full_rows": traffic.full_rows - before[0],
        "lean_rows": traffic.lean_rows - before[1],
        "bytes_back": 4 * values,
        "bytes_per_verify": 4 * values / verify if verify else 0.0,
        "text_hash": hashlib.sha256(text.encode()).hexdigest()[:12],
    }


def _rank_main(rank: int, world_size: int, port: int, args: Any, out: Any) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=300)
        model_dir = Path(args.model_dir)
        engine = load_engine(model_dir, _shard(model_dir, rank, world_size))
        engine.warmup()
        if rank != 0:
            engine.serve_forever()
            destroy_group()
            return
        runs: list[tuple[str, dict[str, Any]]] = []
        for round_index in range(args.rounds):
            for mode in ("off", "on"):
                figures = _run(engine, args, mode == "on", f"{mode}-{round_index}")
                runs.append((mode, figures))
                print(f"round {round_index} {mode}: {figures}", flush=True)
        engine.shutdown()
        destroy_group()
        out.put(runs)
    except Exception:
        traceback.print_exc()
        if rank == 0:
            out.put(None)


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--logprobs", type=int, default=-1, help="top_logprobs (-1: none)")
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args()
    if args.model_dir is None:
        card = load_builtin_cards()[MODEL]
        args.model_dir = str(prepare_model(card, models_dir(), offline=False))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    processes = [
        context.Process(target=_rank_main, args=(rank, 2, port, args, out)) for rank in range(2)
    ]
    for process in processes:
        process.start()
    try:
        runs = out.get(timeout=1800)
    finally:
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    if runs is None:
        print("failed (see the traceback above)")
        return 1
    for mode in ("off", "on"):
        figures = [one for kind, one in runs if kind == mode]
        speeds = [one["tok_s"] for one in figures]
        print(
            f"{mode}: decode tok/s median {statistics.median(speeds):.1f} "
            f"({min(speeds):.1f}-{max(speeds):.1f}), bytes back per verify round trip "
            f"{figures[0]['bytes_per_verify']:.0f}, full rows {figures[0]['full_rows']}, "
            f"texts {sorted({one['text_hash'] for one in figures})}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
