"""Predicted against measured decode tok/s and TTFT, one process per rank, each pinned to its
own core (the `exo bench --pin-cores` setting: two 1-core machines on loopback).

Usage: PYTHONPATH=src python bench/bench_prediction.py [--prompts 32 128 512]
       [--decode-tokens 48] [--placements single pipeline2 tensor2] [--json PATH]

Each rank runs `exo.node.speed_probe.measure_node_speed` on its core (what a node pinned
there reports), loads its shard of the model in int4 and serves; rank 0 times one greedy
stream per prompt length (random prompt tokens, EOS ignored): TTFT = submit -> first token
(fastest of `--runs`), decode tok/s = tokens after the first / time after the first (median
of the runs), and the rate of the fastest decile's steps (the least disturbed by other work;
the probe's figures are its fastest repetitions too). The per-layer factor is computed from
the latter. The prediction is
`exo.master.speed_prediction.predict_speed` for the same layout, with loopback links.
Models: the default model (SmolLM2-135M, 9 heads: no tensor split) for single and
pipeline x2; a random-weight Llama of similar size with 8 heads (bench_distributed's) for
tensor x2 (and single, as its reference).

It also prints what the engine's time per token not explained by bytes comes to per layer,
relative to the probe's tiny layer (`ENGINE_LAYER_OVERHEAD_FACTOR`), and the measured TTFT
over the predicted one times `ENGINE_PREFILL_FACTOR` (approximately that factor): the
figures the model's constants were set from.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as multiprocessing

sys.path.insert(0, str(Path(__file__).parent))
from bench_distributed import DEFAULT_MODEL, make_shard, random_llama

from exo.chat_protocol.prompt import RenderedPrompt
from exo.download.pypi_gguf import prepare_model
from exo.master import speed_prediction
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.instances import Sharding
from exo.shared.types.nodes import NodeSpeed, TopologyEdge
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

PLACEMENTS: dict[str, tuple[Sharding, int]] = {
    "single": ("pipeline", 1),
    "pipeline2": ("pipeline", 2),
    "tensor2": ("tensor", 2),
}


def one_stream(engine: Any, prompt_ids: list[int], decode_tokens: int, request_id: str) -> dict:
    params = TextGenerationTaskParams(
        model=ModelId("bench"), messages=(ChatMessage(role="user", content="-"),),
        max_tokens=decode_tokens, temperature=0.0,
    )  # fmt: skip
    rendered = RenderedPrompt(
        token_ids=prompt_ids, text="", tool_call_format="generic", thinking_open=False,
        tools_in_template=False,
    )  # fmt: skip
    started = time.perf_counter()
    engine.submit(params, rendered, request_id)
    first = 0.0
    tokens = 0
    deadline = started + 600
    gaps: list[float] = []
    last = 0.0
    while engine.has_work and time.perf_counter() < deadline:
        for _, piece in engine.step():
            assert not isinstance(piece, Exception), piece
            now = time.perf_counter()
            if not first:
                first = now
            else:
                gaps.append(now - last)
            last = now
            tokens += len(piece.token_ids)
    ended = time.perf_counter()
    fast = sorted(gaps)[len(gaps) // 10]  # the fastest decile's edge: the least disturbed
    return {
        "ttft_s": first - started,
        "decode_tok_s": (tokens - 1) / (ended - first),
        "decode_tok_s_p10": 1 / fast,
    }


def rank_main(
    rank: int, world_size: int, port: int, mode: str, model_dir: str, args: Any, results: Any
) -> None:
    from exo.node.speed_probe import measure_node_speed
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.engine_factory import load_engine

    os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    try:
        speed = measure_node_speed(1)
        results.put(("speed", rank, speed.model_dump_json()))
        if world_size > 1:
            init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=120)
        engine = load_engine(
            Path(model_dir),
            make_shard(Path(model_dir), mode, rank, world_size),
            weight_dtype="int4",
        )
        engine.warmup()
        if rank != 0:
            engine.serve_forever()
        else:
            engine.eos_token_ids = frozenset({-1})  # every stream decodes its whole budget
            vocab = engine.card.vocab_size
            rows = []
            for prompt in args.prompts:
                runs = []
                for run in range(args.runs):
                    generator = torch.Generator().manual_seed(prompt * 100 + run)
                    ids = torch.randint(100, vocab - 100, (prompt,), generator=generator).tolist()
                    engine.clear_prefix_cache()
                    runs.append(one_stream(engine, ids, args.decode_tokens, f"p{prompt}-{run}"))
                rows.append(
                    {
                        "prompt_tokens": prompt,
                        "ttft_s": min(r["ttft_s"] for r in runs),
                        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                        "decode_tok_s_p10": max(r["decode_tok_s_p10"] for r in runs),
                    }
                )
            engine.shutdown()
            results.put(("rows", rank, rows))
        if world_size > 1:
            destroy_group()
    except Exception as error:
        traceback.print_exc()
        results.put(("error", rank, str(error).splitlines()[0]))


def run_placement(mode: str, world_size: int, model_dir: Path, args: Any) -> dict:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = [
        context.Process(
            target=rank_main, args=(rank, world_size, port, mode, str(model_dir), args, results)
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    speeds: dict[int, NodeSpeed] = {}
    rows: list[dict] | None = None
    deadline = time.monotonic() + 900
    try:
        while rows is None and time.monotonic() < deadline:
            try:
                kind, rank, payload = results.get(timeout=5)
            except queue.Empty:
                if not any(process.is_alive() for process in processes):
                    break
                continue
            if kind == "speed":
                speeds[rank] = NodeSpeed.model_validate_json(payload)
            elif kind == "rows":
                rows = payload
            else:
                raise RuntimeError(f"rank {rank}: {payload}")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if rows is None:
        raise RuntimeError("no result")
    return {"speeds": speeds, "rows": rows}


def loopback_edges(nodes: list[NodeId]) -> dict[NodeId, dict[NodeId, TopologyEdge]]:
    return {
        a: {
            b: TopologyEdge(source=a, sink=b, address="127.0.0.1", latency_ms=1, bandwidth_mbps=1e4)
            for b in nodes
            if b != a
        }
        for a in nodes
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS)
    )
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    real_dir = prepare_model(
        load_builtin_cards()[DEFAULT_MODEL], args.models_dir or default_models_dir(), offline=False
    )
    report: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        random_dir = None
        for name in args.placements:
            mode, world_size = PLACEMENTS[name]
            models = [("SmolLM2-135M", real_dir)] if mode == "pipeline" else []
            if mode == "tensor" or name == "single":
                if random_dir is None:
                    random_dir = random_llama(Path(scratch), real_dir)
                models.append(("random Llama 8 heads", random_dir))
            for model_name, directory in models:
                card = card_from_local_directory(directory)
                measured = run_placement(mode, world_size, directory, args)
                nodes = [NodeId(f"rank{rank}") for rank in range(world_size)]
                shards = [
                    make_shard(directory, mode, rank, world_size) for rank in range(world_size)
                ]
                ranges = [
                    (getattr(s, "start_layer", 0), getattr(s, "end_layer", card.n_layers))
                    for s in shards
                ]
                speeds = {nodes[rank]: speed for rank, speed in measured["speeds"].items()}
                for row in measured["rows"]:
                    context = row["prompt_tokens"] + args.decode_tokens // 2
                    predicted = speed_prediction.predict_speed(
                        card, mode, nodes, ranges, dict(speeds), loopback_edges(nodes), context
                    )
                    ttft = speed_prediction.predict_speed(
                        card, mode, nodes, ranges, dict(speeds), loopback_edges(nodes),
                        row["prompt_tokens"],
                    )  # fmt: skip
                    assert predicted is not None and ttft is not None
                    row["predicted_decode_tok_s"] = predicted.decode_tokens_per_second
                    row["predicted_ttft_s"] = ttft.ttft_seconds
                    rank0 = measured["speeds"][0]
                    share = WeightShare(layers=card.n_layers)
                    no_overhead = speed_prediction.decode_stage_seconds(
                        card, rank0, share, context
                    ) - card.n_layers * rank0.layer_overhead_seconds * (
                        speed_prediction.ENGINE_LAYER_OVERHEAD_FACTOR
                    )
                    row["unexplained_s_per_token"] = 1 / row["decode_tok_s_p10"] - no_overhead
                    row["layer_overhead_factor"] = (
                        row["unexplained_s_per_token"]
                        / card.n_layers
                        / rank0.layer_overhead_seconds
                    )
                    # Approximate: the factor scales the FLOP part, which dominates.
                    row["prefill_factor"] = (
                        row["ttft_s"]
                        / row["predicted_ttft_s"]
                        * speed_prediction.ENGINE_PREFILL_FACTOR
                    )
                    print(
                        f"{model_name:21s} {name:9s} prompt {row['prompt_tokens']:4d}: decode "
                        f"{row['decode_tok_s']:6.1f} tok/s measured (fastest decile's steps "
                        f"{row['decode_tok_s_p10']:6.1f}), "
                        f"{row['predicted_decode_tok_s']:6.1f} predicted "
                        f"({row['predicted_decode_tok_s'] / row['decode_tok_s'] - 1:+.0%}, "
                        f"{row['predicted_decode_tok_s'] / row['decode_tok_s_p10'] - 1:+.0%}); "
                        f"TTFT "
                        f"{row['ttft_s'] * 1000:6.0f} ms measured, "
                        f"{row['predicted_ttft_s'] * 1000:6.0f} predicted "
                        f"({row['predicted_ttft_s'] / row['ttft_s'] - 1:+.0%}); per layer "
                        f"{row['layer_overhead_factor']:.1f}x the probe's tiny layer, prefill "
                        f"factor ~{row['prefill_factor']:.2f}",
                        flush=True,
                    )
                report.append(
                    {
                        "model": model_name,
                        "placement": name,
                        "speeds": {str(k): v.model_dump() for k, v in measured["speeds"].items()},
                        "rows": measured["rows"],
                    }
                )
    print_fitted_factors(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def print_fitted_factors(report: list[dict]) -> None:
    """The single-rank rows' medians: what to set `ENGINE_LAYER_OVERHEAD_FACTOR` and
    `ENGINE_PREFILL_FACTOR` to in `exo.master.speed_prediction` (the factors scale with
    the engine's code, so rerun this after changing the forward)."""
    single = [row for entry in report if entry["placement"] == "single" for row in entry["rows"]]
    if not single:
        return
    layer = statistics.median(row["layer_overhead_factor"] for row in single)
    prefill = statistics.median(row["prefill_factor"] for row in single)
    print(
        f"fitted on {len(single)} single-rank rows: ENGINE_LAYER_OVERHEAD_FACTOR ~ {layer:.1f} "
        f"(now {speed_prediction.ENGINE_LAYER_OVERHEAD_FACTOR}), ENGINE_PREFILL_FACTOR ~ "
        f"{prefill:.2f} (now {speed_prediction.ENGINE_PREFILL_FACTOR})"
    )


if __name__ == "__main__":
    sys.exit(main())
