"""Prefill and decode speed of one model split across processes (gloo over 127.0.0.1)
against the single-process engine.

Usage: PYTHONPATH=src python bench/bench_distributed.py [--runs 3] [--decode-tokens 32]
       [--prompt-words 200] [--weight-dtype float32] [--models-dir DIR] [--concurrency 1,4]
       [--models all|default|random]

Rows: the default model (SmolLM2-135M) single / 2-rank pipeline / 2-rank tensor (not
possible: 9 attention heads), then a random-weight Llama of similar size with 8 heads
(hidden 512, 30 layers) single / pipeline / tensor. Each process gets cores // ranks intra-op
threads so every row uses the same cores. Prefill tok/s = prompt tokens / time to the first
piece; decode tok/s = tokens after the first / time after the first piece (EOS ignored).
Figures are medians of `--runs` runs after the collective warm-up. Then, per `--concurrency`
N: N requests submitted together (the multi-rank engines batch them: tensor ranks in
lockstep, pipeline steps in micro-batches); aggregate decode tok/s = tokens streamed after
every request had its first token / the time from then to the last token (JSON in
`--json`, if given).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
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

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_shard(model_dir: Path, mode: str, rank: int, world_size: int) -> ShardMetadata:
    card = card_from_local_directory(model_dir)
    if mode == "tensor":
        return ShardMetadata(
            sharding="tensor", model_card=card, device_rank=rank, world_size=world_size
        )
    bounds = [round(index * card.n_layers / world_size) for index in range(world_size + 1)]
    return ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=rank, world_size=world_size,
        start_layer=bounds[rank], end_layer=bounds[rank + 1],
    )  # fmt: skip


def measure(engine: TorchEngine, args: argparse.Namespace) -> tuple[int, float, float]:
    """One generation: (prompt tokens, prefill tok/s, decode tok/s)."""
    content = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9))
    params = TextGenerationTaskParams(
        model=ModelId("bench"), messages=(ChatMessage(role="user", content=content),),
        max_tokens=args.decode_tokens, temperature=0.0,
    )  # fmt: skip
    prompt_tokens = engine.count_prompt_tokens(params)
    started = time.perf_counter()
    first = 0.0
    tokens = 0
    for piece in engine.generate(params):
        if not first:
            first = time.perf_counter()
        tokens += len(piece.token_ids)
    ended = time.perf_counter()
    decode = (tokens - 1) / (ended - first) if tokens > 1 else float("nan")
    return prompt_tokens, prompt_tokens / (first - started), decode


def measure_concurrent(engine: TorchEngine, requests: int, args: argparse.Namespace) -> float:
    """`requests` greedy requests submitted together: aggregate decode tok/s."""
    content = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9))
    params = TextGenerationTaskParams(
        model=ModelId("bench"), messages=(ChatMessage(role="user", content=content),),
        max_tokens=args.decode_tokens, temperature=0.0,
    )  # fmt: skip
    for index in range(requests):
        engine.submit(params, request_id=f"bench-{index}")
    started: set[str] = set()
    all_started = 0.0
    tokens_after = 0
    while engine.has_work:
        for request_id, piece in engine.step():
            assert not isinstance(piece, Exception), piece
            if all_started:
                tokens_after += len(piece.token_ids)
            started.add(request_id)
        if not all_started and len(started) == requests:
            all_started = time.perf_counter()
    return tokens_after / (time.perf_counter() - all_started)


def rank_main(
    rank: int, world_size: int, port: int, mode: str, model_dir: str, args: Any, results: Any
) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if world_size > 1:
            init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=120)
        shard = make_shard(Path(model_dir), mode, rank, world_size)
        engine = load_engine(Path(model_dir), shard, weight_dtype=args.weight_dtype)
        engine.warmup()
        if rank != 0:
            engine.serve_forever()
        else:
            engine.eos_token_ids = frozenset()  # decode the same number of tokens every run
            runs = [measure(engine, args) for _ in range(args.runs)]
            concurrent = {
                requests: statistics.median(
                    measure_concurrent(engine, requests, args) for _ in range(args.runs)
                )
                for requests in args.concurrency
            }
            engine.shutdown()
            results.put(
                (
                    runs[0][0],
                    statistics.median(run[1] for run in runs),
                    statistics.median(run[2] for run in runs),
                    concurrent,
                )
            )
        if world_size > 1:
            destroy_group()
    except Exception as error:
        traceback.print_exc()
        if rank == 0:
            results.put(str(error).splitlines()[0])


def bench(
    mode: str, world_size: int, model_dir: Path, args: argparse.Namespace
) -> tuple[str, dict[int, float]]:
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
    try:
        outcome = results.get(timeout=900)
    except queue.Empty:
        outcome = "timed out"
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    if isinstance(outcome, str):
        return f"not possible: {outcome}", {}
    prompt_tokens, prefill, decode, concurrent = outcome
    line = (
        f"prompt {prompt_tokens:4d} tok  prefill {prefill:7.1f} tok/s  decode {decode:6.1f} tok/s"
    )
    for requests, rate in concurrent.items():
        line += f"  x{requests}: {rate:6.1f} tok/s"
    return line, concurrent


def random_llama(directory: Path, tokenizer_source: Path) -> Path:
    """A random-weight Llama close to SmolLM2-135M in size, with 8 heads (tensor-shardable)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, directory / name)
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--weight-dtype", default="float32", choices=("float32", "int8", "int4"))
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument(
        "--concurrency", type=lambda text: [int(part) for part in text.split(",")],
        default=[1, 4], help="requests submitted together, comma-separated",
    )  # fmt: skip
    parser.add_argument("--models", choices=("all", "default", "random"), default="all")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    card = load_builtin_cards()[DEFAULT_MODEL]
    real_dir = prepare_model(card, args.models_dir or default_models_dir(), offline=False)
    print(f"cpus {os.cpu_count()}, weights {args.weight_dtype}, runs {args.runs}", flush=True)
    rows = [("SmolLM2-135M", real_dir)] if args.models != "random" else []
    figures: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.models != "default":
            rows.append(("random Llama 8 heads", random_llama(Path(scratch), real_dir)))
        for name, directory in rows:
            for label, mode, world_size in (
                ("single", "pipeline", 1),
                ("pipeline x2", "pipeline", 2),
                ("tensor x2", "tensor", 2),
            ):
                line, concurrent = bench(mode, world_size, directory, args)
                figures[f"{name} / {label}"] = concurrent
                print(f"{name:22s} {label:12s} {line}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"aggregate_decode_tok_s": figures}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
